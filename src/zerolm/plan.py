"""Know before you launch: per-device memory of ZeRO stages 0–3, the micro-batch that fits, the step time.

**Model states** (params, gradients, optimizer state), per device, on a dp × tp layout. A stage
shards over dp what it names (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5): stage 0 nothing, 1 the optimizer state, 2 also the gradients,
3 also the parameters. Bytes per parameter:

    --precision mixed   2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, Adam m and v)   the paper's K = 12
    --precision fp32    4 (fp32 params) + 4 (fp32 gradient accumulator) + 8 (fp32 Adam m, v)   what zerolm trains

From a config the bytes are exact: the planner asks `zerolm.sharding` for the very layouts the train
step uses (on an abstract mesh, so no devices are needed), padding and step counters included; stage
1 at fp32 is the train state. From `--params N` they are the paper's formulas in N.

**Activations** of one micro-batch of b sequences of s tokens, width h, a heads, L layers, e bytes per
compute element (bf16: 2), tensor parallelism t, stored for the backward pass. Per layer, after
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
4.1) without dropout: the two LayerNorm inputs and outputs (4·sbh, replicated over tp), q, k, v
(3·sbh/t), the attention output (sbh/t), the MLP's GELU input and output (8·sbh/t), and the softmax
probabilities a·s²·b/t (none with flash attention, which keeps a float32 log-sum-exp per row). With
full remat a layer keeps only its input (sbh), and one layer at a time is rebuilt during the backward
pass. Beyond the layers: the final LayerNorm's input and output, and the output layer: zerolm's
chunked loss keeps the float32 gradient of the embedding (V·h) and two float32 chunks of logits
(chunk·V); unchunked, the float32 logits and their gradient (2·b·s·V).

**Step time**: compute = (6·N + 12·L·h·s) FLOPs per token (zerolm.mfu; 8·N + 16·L·h·s with full
remat) over the device's peak times `--efficiency`. Communication follows seed note 002's ring model:
a ring reduce-scatter or all-gather of S bytes over n devices takes base + (n−1)·hop latency +
(n−1)/n·S/bandwidth (an all-reduce twice the steps), hops between nodes at the inter-node latency
and the whole ring at the slowest link's bandwidth; the tree all-reduce (NCCL's double binary tree)
takes base + 2·⌈log2 n⌉·hop + 2·S/bandwidth. zerolm's step reduce-scatters the gradients and
all-gathers the parameters once per step, after the accumulation loop (not overlapped). With
overlap, the last micro-batch's backward pass would reduce bucket by bucket (the note's bucketed
reduction): t_fwd + t_bwd(first bucket) + max(t_bwd(rest), t_comm(all buckets but the last)) +
t_comm(last bucket). The recommended bucket is the note's rule: the smallest bucket for which the
rest of the backward pass covers the communication, else the fastest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from zerolm.hardware import Device
from zerolm.mfu import flops_per_token

STAGES = (0, 1, 2, 3)
GPU_MEMORY_FRACTION = 0.9  # of a device without a compiler-stated limit (Device.usable), unless told otherwise


@dataclasses.dataclass(frozen=True)
class Precision:
    param: int  # bytes per parameter of the params the step computes with
    grad: int  # ... of the gradients (zerolm: its float32 accumulator)
    master: int  # ... of an fp32 master copy kept with the optimizer (mixed precision)
    moments: int  # ... of Adam's m and v


PRECISIONS = {"mixed": Precision(2, 2, 4, 8), "fp32": Precision(4, 4, 0, 8)}
# Elements of the compute dtype per token and model width (Planner.step_activation_bytes): what a block
# keeps for its backward pass without remat, and what one block's rebuild and backward pass hold under
# full remat. Read from the TPU compiler's figures for zerolm's step (125m–1_3b, v3 and v5p, micro-batch
# 1–8; BENCHMARKS.md): the buffer assignment of the 125m block shows the kept set (LayerNorms' float32
# statistics, q/k/v, the MLP's 4h pre-activation and the tanh-GELU's 4h-wide intermediates).
KEPT_PER_LAYER = 60
REBUILT_LAYER = 56


class PlanError(ValueError):
    """A bad plan request; the message is the one line a user sees."""


@dataclasses.dataclass(frozen=True)
class Model:
    """What the planner needs of a model: its size and shape."""

    params: int  # N, all parameters
    tp_split: int  # of which tensor parallelism splits (the blocks' matrices and their biases)
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab: int  # padded
    act_bytes: int = 2  # bytes per compute-dtype element
    loss_chunk: int = 2048
    remat: str = "none"
    source: str = ""
    param_bytes: int = 4  # of the working parameters (zero.precision: fp32 4, mixed 2)
    acc_bytes: int = 4  # of the gradient accumulator (zero.accumulate_dtype)
    attention: str = "auto"  # model.attention (auto: the device's choice, as zerolm.model.for_device)
    attention_block: int = 512  # model.attention_block

    @property
    def flops_params(self) -> int:
        """N without the position embedding (zerolm.mfu's convention)."""
        return self.params - self.seq_len * self.d_model


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int


class AnalyticStates:
    """Model-state bytes from the parameter count: the ZeRO paper's formulas (tp splits `tp_split`)."""

    def __init__(self, model: Model, dp: int, tp: int):
        self.full = model.params - model.tp_split + -(-model.tp_split // tp)  # per device, whole over dp
        self.sharded = -(-model.params // (dp * tp))

    def __call__(self, stage: int, p: Precision) -> StateBytes:
        params = self.sharded if stage >= 3 else self.full
        grads = self.sharded if stage >= 2 else self.full
        opt = self.sharded if stage >= 1 else self.full
        return StateBytes(p.param * params, p.grad * grads, (p.master + p.moments) * opt)


class ExactStates:
    """Model-state bytes of zerolm's own layouts (`zerolm.sharding.Table` on an abstract mesh)."""

    def __init__(self, table):
        import jax
        import numpy as np
        import optax

        from zerolm.sharding import abstract_views, shard_bytes, with_shardings

        def cast(tree, dtype):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding), tree)

        params = with_shardings(table.abstract_params, table.params)
        views = with_shardings(abstract_views(table.layouts, table.abstract_params), table.views)
        self._full = {np.dtype(d).itemsize: shard_bytes(cast(params, d)) for d in (np.float32, jax.numpy.bfloat16)}
        self._sharded = {np.dtype(d).itemsize: shard_bytes(cast(views, d)) for d in (np.float32, jax.numpy.bfloat16)}
        opt_whole = jax.eval_shape(table.tx.init, table.abstract_params)
        opt_whole = with_shardings(opt_whole, optax.tree_map_params(
            table.tx, lambda _, s: s, opt_whole, table.params, transform_non_params=lambda _: table.replicated))
        opt_sharded = with_shardings(jax.eval_shape(table.tx.init, abstract_views(table.layouts, table.abstract_params)),
                                     table.opt)
        self._adam = {False: shard_bytes(opt_whole), True: shard_bytes(opt_sharded)}

    def __call__(self, stage: int, p: Precision) -> StateBytes:
        def of(sharded: bool, nbytes: int) -> int:
            return (self._sharded if sharded else self._full)[nbytes] if nbytes else 0
        return StateBytes(of(stage >= 3, p.param), of(stage >= 2, p.grad),
                          of(stage >= 1, p.master) + self._adam[stage >= 1])


def activation_bytes(m: Model, micro: int, tp: int, remat: str, flash: bool) -> int:
    """Bytes one device keeps for the backward pass of one micro-batch (see the module docstring)."""
    s, b, h, a, e = m.seq_len, micro, m.d_model, m.n_head, m.act_bytes
    sbh = s * b * h
    scores = 4 * a * s * b // tp if flash else a * s * s * b * e // tp
    layer = 4 * sbh * e + 12 * sbh * e // tp + scores
    layers = m.n_layer * layer if remat == "none" else m.n_layer * sbh * e + layer
    tokens = b * s
    if m.loss_chunk and m.loss_chunk < tokens:
        loss = m.vocab * h * 4 + 2 * m.loss_chunk * m.vocab * 4
    else:
        loss = 2 * tokens * m.vocab * 4
    return layers + 2 * sbh * e + loss


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    global_batch: int  # sequences per optimizer step

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp


# ---------------------------------------------------------------------------------------------------
# Communication: seed note 002's ring model, and the tree all-reduce.

def _span(device: Device, n: int, tp: int) -> tuple[int, float, float]:
    """(nodes a dp ring of n ranks spans, its bandwidth, its hop latency between nodes)."""
    nodes = -(-n * tp // device.per_node)
    return nodes, (device.inter_bw if nodes > 1 else device.intra_bw), device.inter_latency


def ring_time(device: Device, op: str, nbytes: float, n: int, tp: int = 1) -> float:
    """A ring reduce-scatter / all-gather (n−1 steps) or all-reduce (2(n−1)) of `nbytes` per device."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    passes = 2 if op == "all-reduce" else 1
    nodes, bw, inter_lat = _span(device, n, tp)
    inter_hops = nodes if nodes > 1 else 0
    hops = passes * (inter_hops * inter_lat + (n - 1 - inter_hops) * device.intra_latency)
    return device.base_latency + hops + passes * (n - 1) / n * nbytes / bw


def tree_time(device: Device, nbytes: float, n: int, tp: int = 1) -> float:
    """A pipelined (double binary) tree all-reduce: log-depth latency, 2·S/bandwidth transport."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes, bw, inter_lat = _span(device, n, tp)
    return device.base_latency + 2 * math.ceil(math.log2(n)) * (inter_lat if nodes > 1 else device.intra_latency) \
        + 2 * nbytes / bw


@dataclasses.dataclass(frozen=True)
class StepTime:
    micro_batch: int
    accum_steps: int
    compute_s: float
    tp_comm_s: float
    grad_comm_s: float  # the reduction after the loop (ring reduce-scatter; all-reduce for stage 0)
    param_gather_s: float  # the update's all-gather (stages 1, 2)
    grad_allreduce_ring_s: float
    grad_allreduce_tree_s: float
    bucket_bytes: int
    buckets: int
    overlapped_s: float  # the step with the bucketed reduction overlapping the last backward pass
    efficiency: float  # assumed share of peak while computing
    model_flops: float  # per device per step, zerolm.mfu's count: no recomputation (what training logs)
    peak_flops: float  # of one device

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.grad_comm_s + self.param_gather_s

    def mfu(self, overlap: bool = False) -> float:
        """zerolm.mfu's MFU, as training would log it at this step time: the model's FLOPs without the
        recomputation of remat (which the compute time does include) over the device's peak."""
        return self.model_flops / (self.peak_flops * (self.overlapped_s if overlap else self.step_s))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "step_s": self.step_s, "mfu": self.mfu(), "mfu_overlapped": self.mfu(True)}


class Planner:
    """One plan: a model on a layout of devices. `states(dp, tp)` gives the model-state bytes of a layout
    (ExactStates from a config, AnalyticStates from a parameter count)."""

    def __init__(self, model: Model, states, device: Device, layout: Layout, precision: str, micro_batch: int = 1,
                 *, efficiency: float = 0.5, memory_fraction: float | None = None):
        self.model, self.device, self.layout, self.micro_batch = model, device, layout, micro_batch
        self._factory, self.states = states, states(layout.dp, layout.tp)
        self.precision_name, self.precision = precision, PRECISIONS[precision]
        self.efficiency, self.memory_fraction = efficiency, memory_fraction

    @property
    def usable(self) -> float:
        """Bytes a device may hold: memory × memory_fraction if given; else what the TPU compiler allows
        (the TPU presets), or 90% of a GPU's memory."""
        if self.memory_fraction is None and self.device.usable is not None:
            return self.device.usable
        return self.device.memory * (self.memory_fraction or GPU_MEMORY_FRACTION)

    def memory(self, stage: int, micro: int) -> dict[str, Any]:
        st = self.states(stage, self.precision)
        remat = "full" if self.model.remat == "full" else "none"
        acts = {r: activation_bytes(self.model, micro, self.layout.tp, r, self.flash) for r in ("none", "full")}
        total = st.params + st.grads + st.optimizer + acts[remat]
        return {"params_bytes": st.params, "grads_bytes": st.grads, "optimizer_bytes": st.optimizer,
                "activation_bytes": acts[remat], "activation_bytes_no_remat": acts["none"],
                "activation_bytes_full_remat": acts["full"], "total_bytes": total, "fits": total <= self.usable}

    @property
    def flash(self) -> bool:
        """Whether the attention zerolm runs here never holds the T×T scores (cuDNN, Pallas, blockwise)."""
        return self.attention != "xla"

    @property
    def attention(self) -> str:
        """The attention zerolm runs on this device preset (zerolm.model.resolve_auto, the rule training
        applies to its devices), or the config's."""
        from zerolm.model import resolve_auto

        platform = "gpu" if self.device.name in ("a100", "h100", "h200") else "tpu" if self.device.name.startswith("v") \
            else "cpu"
        m = self.model
        return resolve_auto("bfloat16" if m.act_bytes == 2 else "float32", m.attention, platform, self.device.name,
                            m.seq_len, m.attention_block)[1]

    def step_peak(self, micro: int) -> dict[str, Any]:
        """zerolm's own ZeRO-1 step (stage 1, at the config's precision), per device, by the rule `zerolm
        compile` applies to the compiler's figures: each program's arguments + outputs + temporaries −
        aliased, plus what lives outside it; the step's peak is the largest.

        grad: the working params (arguments); the gradient in the optimizer layout (output); the
        accumulator (none with one micro-step per step), the micro-step's gradient beside it, the activations (`step_activation_bytes`) and
        the loss's float32 buffers (temporaries); the optimizer state (outside). update: the reduced
        gradient and the optimizer state (aliased: donated) in, the new params out, a working copy of them
        while they are gathered and cast, and the old params (outside). fp32 also reshards the params
        into the optimizer layout: a 1/dp slice."""
        m, p = self.model, self.model.param_bytes
        st = self.states
        params4 = st(0, PRECISIONS["fp32"]).params  # 4 bytes per parameter, whole over dp
        params = params4 * p // 4
        view = st(3, Precision(p, 0, 0, 0)).params  # one dp block of the params, padded
        opt = st(1, PRECISIONS["mixed" if p == 2 else "fp32"]).optimizer  # master weights included in mixed
        # One micro-step per step: XLA folds the accumulator away (the gradient is the sum).
        acc = 0 if self.layout.per_rank // micro == 1 else params4 * m.acc_bytes // 4
        acts = self.step_activation_bytes(micro)
        programs = {"grad": params + view + acc + params + acts + opt,
                    "update": view + opt + params + params + params + (0 if p == 2 else view)}
        if p == 4:
            programs["reshard"] = params + view + opt + view
        program = max(programs, key=programs.get)
        return {"program": program, "total_bytes": programs[program], "programs": programs,
                "activation_bytes": acts, "fits": programs[program] <= self.usable}

    def step_activation_bytes(self, micro: int) -> int:
        """What the gradient program allocates for one micro-batch besides the model states, as counted in
        the TPU compiler's buffer assignment of zerolm's step (125m, v3; docs/performance-notes.md):

        - per layer, kept for the backward pass without remat, KEPT_PER_LAYER·s·b·h elements of the
          compute dtype: the LayerNorms' float32 statistics and normalized inputs, q, k, v, the attention
          output, the MLP's input, its 4h-wide pre-activation and the tanh-GELU's 4h-wide intermediates;
          XLA's attention adds its T×T probabilities and float32 scores, Pallas's its softmax statistics
          (2·a·s·b·128 float32: the kernel pads a row's max and sum to the TPU's 128 lanes), and once
          a relayouted copy of the stacked c_attn kernel (L·3h²);
        - with full remat, each layer's input, plus REBUILT_LAYER·s·b·h for the one layer being rebuilt
          and run backward;
        - the loss: the output layer's float32 gradient as it is summed and the embedding's (2·V·h·4),
          and a chunk's float32 logits with their gradient in the compute dtype (the micro-batch's, if
          smaller; without chunking, loss_chunk 0, autodiff keeps three float32 copies)."""
        m, b, t = self.model, micro, self.layout.tp
        s, h, a, e, L = m.seq_len, m.d_model, m.n_head, m.act_bytes, m.n_layer
        sbh = s * b * h
        from zerolm.attention import PALLAS_LANES

        attention = self.attention
        # XLA's: the T×T probabilities and float32 scores. Pallas's kernel keeps its softmax statistics
        # (running max and sum) as two float32 rows of 128 lanes per query; the blockwise one a float32 each.
        lane_row = a * s * b * PALLAS_LANES * 4 // t
        scores = a * s * s * b * (e + 4) // t if attention == "xla" else 2 * lane_row if attention == "pallas" else 0
        # Around the Pallas kernels XLA adds, once, a copy of the stacked c_attn kernel in the layout the
        # kernels' (B, H, T, K) operands want, hoisted out of the loops (the buffer assignment of 1_3b on
        # v5p-64: docs/performance-notes.md).
        pallas_once = L * h * 3 * h * e // t if attention == "pallas" else 0
        if m.remat == "none":
            layers = L * (KEPT_PER_LAYER * sbh * e // t + scores) + pallas_once
        else:
            layers = L * sbh * e + REBUILT_LAYER * sbh * e // t + scores + pallas_once
        tokens = b * s
        logits = min(tokens, m.loss_chunk) * m.vocab * (4 + e) if m.loss_chunk else 3 * tokens * m.vocab * 4
        return layers + 2 * m.vocab * h * 4 + logits

    def micro_batches(self) -> list[int]:
        per_rank = self.layout.per_rank
        return [b for b in range(1, per_rank + 1) if per_rank % b == 0]

    def largest_micro(self, stage: int) -> int | None:
        fitting = [b for b in self.micro_batches() if self.memory(stage, b)["fits"]]
        return max(fitting) if fitting else None

    def step(self, micro: int, stage: int = 1) -> StepTime:
        m, d, lay, p = self.model, self.device, self.layout, self.precision
        accum = lay.per_rank // micro
        remat = self.model.remat == "full"
        # zerolm.mfu's count; full remat runs the forward pass again: 8·N + 16·L·d·T = 4/3 of it.
        model_flops_token = flops_per_token(m.flops_params, m.n_layer, m.d_model, m.seq_len)
        tokens_device = lay.global_batch * m.seq_len / lay.devices
        compute = model_flops_token * (4 / 3 if remat else 1) * tokens_device / (d.flops * self.efficiency)
        # Megatron's tensor parallelism: 2 all-reduces of the activations forward and 2 backward per layer
        # (one more forward with full remat), every micro-step.
        act = micro * m.seq_len * m.d_model * m.act_bytes
        tp_comm = accum * m.n_layer * (6 if remat else 4) * ring_time(d, "all-reduce", act, lay.tp)
        full = self.states(0, p)  # whole over dp: what a rank reduces and gathers
        grads, params = full.grads, full.params
        if stage == 0:
            grad_comm, gather = ring_time(d, "all-reduce", grads, lay.dp, lay.tp), 0.0
        else:
            grad_comm = ring_time(d, "reduce-scatter", grads, lay.dp, lay.tp)
            gather = ring_time(d, "all-gather", params, lay.dp, lay.tp) if stage < 3 else 0.0
        bwd = compute / accum * (3 / 4 if remat else 2 / 3)
        bucket, k, overlapped = self._bucket(grads, bwd, compute + tp_comm + gather, stage)
        return StepTime(micro, accum, compute, tp_comm, grad_comm, gather,
                        ring_time(d, "all-reduce", grads, lay.dp, lay.tp), tree_time(d, grads, lay.dp, lay.tp),
                        bucket, k, overlapped, self.efficiency, model_flops_token * tokens_device, d.flops)

    def _bucket(self, grads: int, bwd: float, rest: float, stage: int) -> tuple[int, int, float]:
        """The note's bucketed reduction of the last micro-batch's backward pass: (bucket, count, step)."""
        op = "all-reduce" if stage == 0 else "reduce-scatter"
        comm = functools.partial(ring_time, self.device, op, n=self.layout.dp, tp=self.layout.tp)
        options = []
        size = 2**20
        while True:
            k = -(-grads // size)
            first = (k - 1) * comm(size)
            last = comm(grads - (k - 1) * size)
            step = rest - bwd + bwd / k + max(bwd * (k - 1) / k, first) + last
            options.append((size, k, step, bwd * (k - 1) / k >= first))
            if size >= grads:
                break
            size *= 2
        covered = [o for o in options if o[3] and o[1] > 1]
        size, k, step, _ = covered[0] if covered else min(options, key=lambda o: o[2])
        return size, k, step

    def with_layout(self, layout: Layout) -> Planner:
        return Planner(self.model, self._factory, self.device, layout, self.precision_name, efficiency=self.efficiency,
                       memory_fraction=self.memory_fraction)

    def scaling(self, stage: int = 1) -> list[dict]:
        """Step time and MFU as dp doubles (tp fixed), up to one sequence per rank."""
        rows = []
        dp = 1
        while dp <= self.layout.global_batch:
            if self.layout.global_batch % dp == 0:
                planner = self.with_layout(Layout(dp, self.layout.tp, self.layout.global_batch))
                micro = planner.largest_micro(stage)
                row: dict[str, Any] = {"dp": dp, "devices": dp * self.layout.tp, "micro_batch": micro}
                if micro is not None:
                    t = planner.step(micro, stage)
                    tokens = self.layout.global_batch * self.model.seq_len
                    row.update(accum_steps=t.accum_steps, compute_s=t.compute_s, comm_s=t.step_s - t.compute_s,
                               step_s=t.step_s, overlapped_s=t.overlapped_s, tokens_per_s=tokens / t.step_s,
                               mfu=t.mfu(), grad_allreduce_ring_s=t.grad_allreduce_ring_s,
                               grad_allreduce_tree_s=t.grad_allreduce_tree_s)
                rows.append(row)
            dp *= 2
        return rows

    def report(self, stage: int = 1) -> dict:
        micro = self.micro_batch
        stages = {str(s): {**self.memory(s, micro), "largest_micro_batch": self.largest_micro(s)} for s in STAGES}
        for s, row in stages.items():
            b = row["largest_micro_batch"]
            row["accum_steps"] = self.layout.per_rank // b if b else None
        best = self.largest_micro(stage)
        step = self.step(best or micro, stage)
        peak = self.step_peak(micro)
        fitting = [b for b in self.micro_batches() if self.step_peak(b)["fits"]]
        zerolm_step = {**peak, "largest_micro_batch": max(fitting) if fitting else None}
        return {"model": dataclasses.asdict(self.model), "device": dataclasses.asdict(self.device),
                "zerolm_step": zerolm_step, "attention": self.attention,
                "layout": {"dp": self.layout.dp, "tp": self.layout.tp, "devices": self.layout.devices,
                           "global_batch": self.layout.global_batch},
                "precision": self.precision_name, "efficiency": self.efficiency,
                "memory_fraction": self.memory_fraction, "usable_bytes": int(self.usable),
                "flash_attention": self.flash, "micro_batch": micro, "stages": stages,
                "step": {"stage": stage, "fits": best is not None, **step.as_dict()},
                "scaling": self.scaling(stage)}


def predicted_traffic(table, grad_reduce: str, accum: int, activation: int = 0, n_layer: int = 0,
                      remat: bool = False, param_bytes: int = 4, scatter: str = "collective",
                      inner: int | None = None) -> list[dict]:
    """zerolm's step on `table`'s mesh as the planner counts it: rows of (program, op, axes, span,
    in_loop, bytes per device summed over the instructions, bytes per step). `span`: what one replica
    group spans, as `zerolm.hlo.axes_label` reads it (`dp`, or a share such as `dp(8/32)`), `axes` its
    mesh axes; both None: over dp, whichever other axes the partitioner adds (it splits the update's
    all-gathers between dp and dp+tp freely).

    grad: the one reduction after the loop, in the parameters' dtype (`param_bytes`: 4, or 2 in mixed
    precision): a reduce-scatter into the optimizer layout (1/dp of each device's gradient block), or,
    with `scatter` "two_stage", one over dp // inner positions of dp (span `dp(outer/dp)`), giving
    `inner` such blocks, then one over `inner` (`dp(inner/dp)`; one row when the two are of a size);
    with "ring", dp − 1 collective-permutes of such a block; or an all-reduce of the whole block;
    and the loss's 4-byte all-reduce; with tp, Megatron's all-reduces of the `activation` bytes of a
    micro-batch, 2 forward and 2 backward per layer (3 forward with full remat), every micro-step.
    update: the all-gather of the new parameters out of the optimizer layout."""
    import jax

    from zerolm import hlo
    from zerolm.mesh import DP, TP
    from zerolm.sharding import is_layout

    tp_local, _, _ = table.reduction(grad_reduce)
    dp, tp = table.dp, table.tp
    grads = scattered = gathered = 0
    for lay, local in zip(jax.tree.leaves(table.layouts, is_leaf=is_layout), jax.tree.leaves(tp_local)):
        split = tp if lay.tp_axis is not None else 1
        grads += lay.size * param_bytes // split
        scattered += math.prod(lay.view_shape) * param_bytes // dp // (tp if local else 1)
        gathered += (math.prod(lay.view_shape) if lay.axis is None else lay.size // split) * param_bytes

    def row(program, op, span, nbytes, in_loop=False, runs=1):
        return {"program": program, "op": op, "axes": None if span is None else list(hlo.axis_names(span)),
                "span": span, "in_loop": in_loop, "bytes": nbytes,
                "bytes_per_step": nbytes * runs}

    if grad_reduce == "all_reduce":
        rows = [row("grad", "all-reduce", [DP], grads + 4)]
    elif scatter == "ring":
        rows = [row("grad", "collective-permute", [DP], scattered * (dp - 1)), row("grad", "all-reduce", [DP], 4)]
    elif scatter == "two_stage":
        stages: dict[str, int] = {}  # by the HLO's label; stages of one size (outer = inner) share a row
        for n, nbytes in ((dp // inner, scattered * inner), (inner, scattered)):
            if n > 1:
                label = hlo.axis_share(DP, n, dp)
                stages[label] = stages.get(label, 0) + nbytes
        rows = [row("grad", "reduce-scatter", [label], nbytes) for label, nbytes in stages.items()]
        rows.append(row("grad", "all-reduce", [DP], 4))
    else:
        rows = [row("grad", "reduce-scatter", [DP], scattered), row("grad", "all-reduce", [DP], 4)]
    if tp > 1 and activation:
        per_layer = 6 if remat else 4
        rows.append(row("grad", "all-reduce", [TP], per_layer * activation, True, accum * n_layer))
    rows.append(row("update", "all-gather", None if tp > 1 else [DP], gathered))
    return rows


def predicted_naive_traffic(abstract_params, accum: int) -> list[dict]:
    """The naive single jit (zerolm.zero.naive_data_parallel_step): XLA all-reduces every micro-step's
    gradient inside the accumulation loop: at least the gradient's bytes per micro-step (XLA may reduce
    a leaf's parts separately, e.g. the tied embedding's input and output gradients)."""
    import jax

    from zerolm.mesh import DP

    grads = sum(a.size * 4 for a in jax.tree.leaves(abstract_params))
    return [{"program": "step", "op": "all-reduce", "axes": [DP], "span": [DP], "in_loop": True, "bytes": grads,
             "bytes_per_step": grads * accum, "at_least": True}]


# ---------------------------------------------------------------------------------------------------
# Building a plan: from a config (exact layouts) or from a parameter count.

# GPT-3's shapes (Brown et al. 2020, Table 2.1): params -> (layers, d_model, heads), for --params alone.
GPT3 = ((125e6, 12, 768, 12), (350e6, 24, 1024, 16), (760e6, 24, 1536, 16), (1.3e9, 24, 2048, 32),
        (2.7e9, 32, 2560, 32), (6.7e9, 32, 4096, 32), (13e9, 40, 5140, 40), (175e9, 96, 12288, 96))


def model_from_params(n: int, layers: int | None, width: int | None, heads: int | None, seq_len: int,
                      vocab: int, remat: str) -> Model:
    if n <= 0:
        raise PlanError(f"--params: {n} is not a positive parameter count")
    padded = -(-vocab // 128) * 128
    if layers is None and width is None:
        _, layers, width, default_heads = min(GPT3, key=lambda r: abs(math.log(r[0] / n)))
        heads = heads or default_heads
    elif width is None:  # N ≈ 12·L·d² + (V + s)·d: solve for d
        a, b = 12 * layers, padded + seq_len
        width = max(64, round((-b + math.sqrt(b * b + 4 * a * n)) / (2 * a) / 64) * 64)
    elif layers is None:
        layers = max(1, round((n - (padded + seq_len) * width) / (12 * width * width)))
    heads = heads or max(1, width // 128)
    for flag, value in (("--layers", layers), ("--width", width), ("--heads", heads), ("--seq-len", seq_len)):
        if value <= 0:
            raise PlanError(f"{flag}: {value} is not positive")
    embeddings = (padded + seq_len) * width
    if embeddings >= n:
        raise PlanError(f"--params: {n:,} cannot hold a {layers} × {width} model: its embeddings alone are "
                        f"{embeddings:,} parameters ({padded:,} vocabulary + {seq_len:,} positions × {width}); give a "
                        "larger N, or a smaller --width / --vocab")
    # Tensor parallelism splits the blocks, not the embeddings (zerolm.sharding.RULES); LayerNorms ignored.
    return Model(n, n - embeddings, layers, width, heads, seq_len, padded, remat=remat,
                 source=f"--params {n:,} (shape {layers} layers × {width}, {heads} heads)")


def from_config(cfg, dp: int, tp: int) -> tuple[Model, Any]:
    """(Model, a factory (dp, tp) -> exact model-state bytes of zerolm's layouts on that mesh)."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from zerolm import model as gpt_model
    from zerolm.mesh import DP, TP
    from zerolm.sharding import Table, param_spec
    from zerolm.zero import make_optimizer

    gpt = gpt_model.GPT(cfg.model)
    abstract = jax.eval_shape(functools.partial(gpt_model.init_params, gpt), jax.random.key(0))
    axes = gpt_model.logical_axes(gpt)
    tx, _ = make_optimizer(cfg.train)

    def states(dp_: int, tp_: int) -> ExactStates:
        mesh = AbstractMesh((dp_, tp_), (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto))
        return ExactStates(Table(mesh, abstract, axes, tx))

    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    split = sum(a.size for a, logical in zip(jax.tree.leaves(abstract), jax.tree.leaves(axes, is_leaf=is_spec))
                if TP in param_spec(logical))
    model = Model(gpt_model.count_params(abstract), split, cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head,
                  cfg.model.seq_len, cfg.model.padded_vocab_size, 4 if cfg.model.dtype == "float32" else 2,
                  cfg.model.loss_chunk, "full" if cfg.model.remat == "full" else "none", source=f"config {cfg.name}",
                  param_bytes=2 if cfg.zero.precision == "mixed" else 4,
                  acc_bytes=2 if cfg.zero.accumulate_dtype == "bfloat16" else 4, attention=cfg.model.attention,
                  attention_block=cfg.model.attention_block)
    return model, states


def planned_vocab(cfg) -> int:
    """model.vocab_size, with `auto` resolved as training would, without preparing anything."""
    from zerolm.config import ConfigError
    from zerolm.data.shards import DataError, PreparedDataset

    if cfg.model.vocab_size != "auto":
        return cfg.model.vocab_size
    if cfg.data.dataset == "default":
        return cfg.data.default_vocab_size
    try:
        return int(PreparedDataset(cfg.data.dataset).manifest["tokenizer"]["vocab_size"])
    except DataError as e:
        raise ConfigError(f"model.vocab_size: auto needs the dataset's tokenizer ({e}); set model.vocab_size") from None


# ---------------------------------------------------------------------------------------------------
# The report and the command line.

def _gib(n: float) -> str:
    """A byte count in the unit that shows it (a tiny model's states are KiB, not "0.00 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:8.2f} {unit}"
    return f"{n:8.0f} B  "


def _ms(s: float) -> str:
    return f"{s * 1e3:9.2f} ms"


def describe(r: dict) -> list[str]:
    m, lay = r["model"], r["layout"]
    dev = r["device"]
    lines = [f"plan: {m['source']}: {m['params']:,} params, {m['n_layer']} layers × {m['d_model']}, "
             f"{m['n_head']} heads, seq_len {m['seq_len']}, vocab {m['vocab']} (padded)",
             f"on {lay['devices']} × {dev['name']} (dp={lay['dp']} tp={lay['tp']}), global batch {lay['global_batch']} "
             f"sequences, precision {r['precision']}, micro-batch {r['micro_batch']}, "
             f"{r['attention']} attention, remat {m['remat']}",
             f"fits means at most {r['usable_bytes'] / 2**30:.2f} GiB per device ("
             + (f"{r['memory_fraction']:.0%} of {dev['memory'] / 2**30:.1f} GiB)" if r["memory_fraction"] is not None
                else "what the TPU compiler allows, as `zerolm compile` checks)" if dev["usable"] is not None
                else f"{GPU_MEMORY_FRACTION:.0%} of {dev['memory'] / 2**30:.1f} GiB)"),
             ""]
    z = r["zerolm_step"]
    b = z["largest_micro_batch"]
    lines += [f"zerolm's step (ZeRO-1 at {m['param_bytes'] * 8}-bit params, {r['attention']} attention, remat "
              f"{m['remat']}), per device by `zerolm compile`'s rule (within 15% of the TPU compiler: BENCHMARKS.md):",
              "  " + "   ".join(f"{name} {_gib(v).strip()}" for name, v in z["programs"].items())
              + f"   peak {_gib(z['total_bytes']).strip()} ({z['program']}){'' if z['fits'] else ' DOES NOT FIT'}; "
              + (f"largest micro-batch that fits: {b}" if b else "no micro-batch fits"),
              "",
              "ZeRO stages (the paper's accounting; activations: the minimal set the backward pass needs, after "
              "Korthikanti et al.)",
             "per-device memory    params        grads     optimizer   activations (no remat / full remat)      total"
             "   largest micro-batch"]
    for s, row in r["stages"].items():
        b = row["largest_micro_batch"]
        fit = f"{b} (accum {row['accum_steps']})" if b else "none fits"
        lines.append(f"  ZeRO-{s}   {_gib(row['params_bytes'])} {_gib(row['grads_bytes'])} {_gib(row['optimizer_bytes'])} "
                     f"{_gib(row['activation_bytes'])} ({_gib(row['activation_bytes_no_remat']).strip()} / "
                     f"{_gib(row['activation_bytes_full_remat']).strip()}) {_gib(row['total_bytes'])}"
                     f"{'' if row['fits'] else ' DOES NOT FIT'}   {fit}")
    st = r["step"]
    lines += ["", f"step time, ZeRO-{st['stage']} (zerolm: stage 1), micro-batch {st['micro_batch']} × "
                  f"{st['accum_steps']} accumulation step(s), compute at {r['efficiency']:.0%} of "
                  f"{dev['flops'] / 1e12:.0f} TFLOP/s" + ("" if st["fits"] else " (nothing fits: shown at the "
                                                          "configured micro-batch)"),
              f"  compute {_ms(st['compute_s'])}   tp all-reduces {_ms(st['tp_comm_s'])}",
              f"  gradient reduction {_ms(st['grad_comm_s'])} (ring; as one all-reduce: ring "
              f"{_ms(st['grad_allreduce_ring_s']).strip()}, tree {_ms(st['grad_allreduce_tree_s']).strip()})   "
              f"param all-gather {_ms(st['param_gather_s'])}",
              f"  step {_ms(st['step_s'])} (MFU {st['mfu']:.1%}), reduction after the loop as zerolm does",
              f"  step {_ms(st['overlapped_s'])} (MFU {st['mfu_overlapped']:.1%}) if the last backward pass "
              f"overlapped a bucketed reduction: bucket {st['bucket_bytes'] / 2**20:.0f} MiB "
              f"({st['buckets']} buckets, seed note 002's rule)",
              "", "scaling (dp doubles, tp fixed; largest micro-batch that fits):",
              "     dp devices  micro accum      compute         comm         step   overlapped   tokens/s    MFU"]
    for row in r["scaling"]:
        if row["micro_batch"] is None:
            lines.append(f"  {row['dp']:5d} {row['devices']:7d}  does not fit")
            continue
        lines.append(f"  {row['dp']:5d} {row['devices']:7d} {row['micro_batch']:6d} {row['accum_steps']:5d} "
                     f"{_ms(row['compute_s'])} {_ms(row['comm_s'])} {_ms(row['step_s'])} {_ms(row['overlapped_s'])} "
                     f"{row['tokens_per_s']:10.0f} {row['mfu']:6.1%}")
    lines += ["", f"device: {Device(**dev).describe()}"]
    return lines
