"""The planner: one model on a parallel layout of one device preset. Its memory per device at each ZeRO
stage, zerolm's own step peak (the rule `zerolm compile` applies to the compiler's figures), the largest
micro-batch that fits, the step time and a scaling table."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerolm.core.hardware import Device, gpu_memory_fraction
from zerolm.model.flops import flops_per_token
from zerolm.parallel.auto import Where
from zerolm.parallel.auto import attention as auto_attention
from zerolm.plan.activations import activation_bytes, step_activation_bytes
from zerolm.plan.describe import PlanReport
from zerolm.plan.spec import PRECISIONS, STAGES, BytesPerParam, Model, Parallelism
from zerolm.plan.timing import StepTime, bucketed, dcn_time, ring_time, tree_time
from zerolm.plan.traffic import tp_all_reduces

# A micro-batch fits when its planned peak, this much larger, fits the device: the planner's step peak
# is a model of the compiler's, which under-counts the compiled peak by up to 15.8% of the planned one
# (compiled/planned up to 1.158: 1_3b on v4-32 at micro-batch 16, full remat; every compile in
# BENCHMARKS.md, benchmarks/compiler/plan_vs_compile.py, which says if this margin is ever smaller). So the
# advice is never more than the compiler fits, and sometimes less: `zerolm compile --largest-micro-batch`
# compiles up from it (zerolm.compile.micro_batch_search), and the launch gate compiles the run's own.
SAFETY_MARGIN = 0.16


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """How a Planner plans its model and layout."""

    precision: str  # fp32 | mixed (spec.PRECISIONS)
    micro_batch: int = 1  # the one the report is for
    efficiency: float = 0.5  # the share of the device's peak FLOP/s the step's compute reaches
    memory_fraction: float | None = None  # the share of a device's memory a run may hold (None: Planner.usable)
    stage: int = 1  # the config's zero.stage: what the step time and the advice are for by default
    # train.context_stages: (steps, seq_len, rows per sample) of each staged context (zerolm.data.context)
    contexts: tuple[tuple[str, int, int], ...] = ()


class Planner:
    """One plan: a model on a layout of devices. `states(dp, tp)` gives the model-state bytes of a layout
    (ExactStates from a config, AnalyticStates from a parameter count)."""

    def __init__(self, model: Model, states, device: Device, layout: Parallelism, settings: PlanSettings):
        self.model, self.device, self.layout, self.settings = model, device, layout, settings
        self.micro_batch, self.stage = settings.micro_batch, settings.stage
        self._factory, self.states = states, states(layout.dp, layout.tp)
        self.precision_name, self.precision = settings.precision, PRECISIONS[settings.precision]
        self.efficiency, self.memory_fraction = settings.efficiency, settings.memory_fraction

    @property
    def usable(self) -> float:
        """Bytes a device may hold: memory × memory_fraction if given; else what the TPU compiler allows
        (the TPU presets), or the share of a GPU's memory JAX's allocator takes (hardware.gpu_memory_fraction:
        what `zerolm compile` checks too)."""
        if self.memory_fraction is None and self.device.usable is not None:
            return self.device.usable
        return self.device.memory * (self.memory_fraction or gpu_memory_fraction())

    def memory(self, stage: int, micro: int) -> dict[str, Any]:
        st = self.states(stage, self.precision)
        remat = "full" if self.model.remat == "full" else "none"
        acts = {r: activation_bytes(self.model, micro, self.layout.tp, r, self.flash) for r in ("none", "full")}
        total = st.params + st.grads + st.optimizer + acts[remat]
        # Stages 1-3 are zerolm's: they fit where zerolm's own step does (`step_peak`), which counts more
        # than the paper's minimal activations.
        fits = self.fits(total) and (stage == 0 or self.step_peak(micro, stage)["fits"])
        return {"params_bytes": st.params, "grads_bytes": st.grads, "optimizer_bytes": st.optimizer,
                "activation_bytes": acts[remat], "activation_bytes_no_remat": acts["none"],
                "activation_bytes_full_remat": acts["full"], "total_bytes": total, "fits": fits}

    def fits(self, total_bytes: float) -> bool:
        """Whether a planned peak fits the device with the planner's SAFETY_MARGIN."""
        return total_bytes * (1 + SAFETY_MARGIN) <= self.usable

    @property
    def flash(self) -> bool:
        """Whether the attention zerolm runs here never holds the T×T scores (cuDNN, Pallas, blockwise)."""
        return self.attention != "xla"

    @property
    def where(self) -> Where:
        """The device preset, the layout's tp and the config's ZeRO stage, as zerolm.parallel.auto reads them."""
        return Where(self.device.platform, self.device.name, self.layout.tp, self.stage)

    @property
    def attention(self) -> str:
        """The attention zerolm runs on this device preset and layout: the rule a run applies to its devices
        (zerolm.parallel.auto.attention), or the config's."""
        return auto_attention(self.model, self.where)

    def step_peak(self, micro: int, stage: int = 1) -> dict[str, Any]:
        """zerolm's own step at ZeRO `stage` (at the config's precision), per device, by the rule `zerolm
        compile` applies to the compiler's figures: each program's arguments + outputs + temporaries −
        aliased, plus what lives outside it; the step's peak is the largest.

        grad: the working params (arguments: whole at stages 1 and 2, one dp block at 3); the gradient in
        the optimizer layout (output); the activations (`step_activation_bytes`) and the loss's float32
        buffers, and the optimizer state (outside). Stage 1 adds the accumulator (none with one micro-step
        per step) and the micro-step's whole gradient beside it. Stages 2 and 3 accumulate the layers'
        gradient in dp blocks and the embeddings' whole (reduced after the loop), and hold the embeddings'
        gradient and two layers' as they are made; stage 3 also the gathered embeddings and two gathered
        layers (the one running and, where the collectives overlap, the next). update: the reduced
        gradient, the optimizer state and the old params in (donated: aliased with the new), the new params
        out and a working copy of them while they are gathered and cast (stage 3: its block, nothing
        gathered). fp32 also reshards the params
        into the optimizer layout: a 1/dp slice."""
        m, p = self.model, self.model.param_bytes
        st = self.states
        params4 = st(0, PRECISIONS["fp32"]).params  # 4 bytes per parameter, whole over dp
        params = params4 * p // 4
        view = st(3, BytesPerParam(p, 0, 0, 0)).params  # one dp block of the params, padded
        opt = st(1, PRECISIONS["mixed" if p == 2 else "fp32"]).optimizer  # master weights included in mixed
        acts = self.step_activation_bytes(micro)
        embed = (m.vocab + m.seq_len) * m.d_model  # parameters outside the layers (the last LayerNorm aside)
        layer = (m.params - embed) // m.n_layer // self.layout.tp
        if stage == 1:
            # One micro-step per step: XLA folds the accumulator away (the gradient is the sum).
            acc = 0 if self.layout.per_rank // micro == 1 else params4 * m.acc_bytes // 4
            grad = params + view + acc + params + acts + opt
        else:
            acc = view * m.acc_bytes // p + embed * m.acc_bytes
            made = embed * p + 2 * layer * p
            gathered = 0 if stage == 2 else embed * p + 2 * layer * p
            grad = (params if stage == 2 else view) + view + acc + made + gathered + acts + opt
        new = view if stage == 3 else params
        programs = {"grad": grad, "update": view + opt + new + new + (0 if p == 2 else view)}
        if p == 4:
            programs["reshard"] = (params if stage < 3 else view) + view + opt + view
        program = max(programs, key=lambda name: programs[name])
        return {"program": program, "total_bytes": programs[program], "programs": programs,
                "activation_bytes": acts, "fits": self.fits(programs[program])}

    def step_activation_bytes(self, micro: int) -> int:
        return step_activation_bytes(self.model, micro, self.attention, self.layout.per_rank // micro, self.where)

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
        # zerolm.observe.mfu's count; full remat runs the forward pass again: 8·N + 16·L·d·T = 4/3 of it.
        model_flops_token = flops_per_token(m.flops_params, m.n_layer, m.d_model, m.seq_len)
        tokens_device = lay.global_batch * m.seq_len / lay.devices
        compute = model_flops_token * (4 / 3 if remat else 1) * tokens_device / (d.flops * self.efficiency)
        # Megatron's tensor parallelism: all-reduces of the activations, 2 forward and 2 backward per layer (one
        # forward again with full remat; the parallel residual's fewer), every micro-step.

        per_layer = tp_all_reduces(m.parallel_residual, m.shared_norm, m.residual_dropout).per_layer(remat)
        act = micro * m.seq_len * m.d_model * m.act_bytes
        tp_comm = accum * m.n_layer * per_layer * ring_time(d, "all-reduce", act, lay.tp)
        full = self.states(0, p)  # whole over dp: what a rank reduces and gathers
        grads, params = full.grads, full.params
        if stage == 0:
            grad_comm, gather = ring_time(d, "all-reduce", grads, lay.dp, lay.tp), 0.0
        else:
            # Stages 2 and 3 reduce-scatter every micro-step; stage 3 gathers each layer twice per micro-step
            # (forward, and again for the backward pass) instead of once in the update.
            grad_comm = (accum if stage > 1 else 1) * ring_time(d, "reduce-scatter", grads, lay.dp, lay.tp)
            gather = ring_time(d, "all-gather", params, lay.dp, lay.tp) * (2 * accum if stage == 3 else 1)
        if stage < 2:
            bwd = compute / accum * (3 / 4 if remat else 2 / 3)
            bucket, k, overlapped = bucketed(d, "all-reduce" if stage == 0 else "reduce-scatter", grads, bwd,
                                             compute + tp_comm + gather, lay)
        else:  # a layer at a time, if beside the layers' compute (libtpu overlaps part of it, with its async
            # collective fusion flags only: BENCHMARKS.md, "ZeRO stages on the TPU compiler")
            bucket, k = grads // m.n_layer, m.n_layer * accum
            in_loop = grad_comm + (gather if stage == 3 else 0.0)
            overlapped = max(compute + tp_comm, in_loop) + (0.0 if stage == 3 else gather)
        # Across slices, once per step: each device's block of the gradient (stage 0: its whole gradient).
        across = 0 if lay.slices == 1 else round(grads / (1 if stage == 0 else lay.dp))
        dcn = dcn_time(d, across)
        return StepTime(micro, accum, compute, tp_comm, grad_comm, gather,
                        ring_time(d, "all-reduce", grads, lay.dp, lay.tp), tree_time(d, grads, lay.dp, lay.tp),
                        bucket, k, overlapped + dcn, self.efficiency, model_flops_token * tokens_device, d.flops,
                        dcn, across)

    def with_layout(self, layout: Parallelism) -> Planner:
        return Planner(self.model, self._factory, self.device, layout, self.settings)

    def scaling(self, stage: int = 1) -> list[dict]:
        """Step time and MFU as dp doubles (tp fixed), up to one sequence per rank."""
        rows = []
        dp = 1
        while dp * self.layout.slices <= self.layout.global_batch:
            if self.layout.global_batch % (dp * self.layout.slices) == 0:
                planner = self.with_layout(Parallelism(dp, self.layout.tp, self.layout.global_batch,
                                                       self.layout.slices))
                micro = planner.largest_micro(stage)
                row: dict[str, Any] = {"dp": dp, "devices": dp * self.layout.tp * self.layout.slices,
                                       "micro_batch": micro}
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

    def at_context(self, seq_len: int) -> Planner:
        """This plan with the model at a staged context's seq_len (its step's memory: zerolm.data.context)."""
        return Planner(dataclasses.replace(self.model, seq_len=seq_len), self._factory, self.device, self.layout,
                       dataclasses.replace(self.settings, contexts=()))

    def report(self, stage: int | None = None) -> PlanReport:
        """The plan; `stage` (default: the config's) for zerolm's step, its step time and the scaling table."""
        stage = self.stage if stage is None else stage
        micro = self.micro_batch
        stages = {str(s): {**self.memory(s, micro), "largest_micro_batch": self.largest_micro(s)} for s in STAGES}
        for row in stages.values():
            b = row["largest_micro_batch"]
            row["accum_steps"] = self.layout.per_rank // b if b else None
        best = self.largest_micro(stage)
        step = self.step(best or micro, stage)
        zerolm_stage = stage if stage > 0 else 1  # stage 0 is the paper's, not a step zerolm runs
        peak = self.step_peak(micro, zerolm_stage)
        fitting = [b for b in self.micro_batches() if self.step_peak(b, zerolm_stage)["fits"]]
        zerolm_step = {**peak, "stage": zerolm_stage, "largest_micro_batch": max(fitting) if fitting else None}
        contexts = [{"steps": steps, "seq_len": seq_len, "micro_rows": micro * rows,
                     **self.at_context(seq_len).step_peak(micro * rows, zerolm_stage)}
                    for steps, seq_len, rows in self.settings.contexts]
        return PlanReport(contexts=contexts,
            model=dataclasses.asdict(self.model), device=dataclasses.asdict(self.device), zerolm_step=zerolm_step,
            attention=self.attention,
            layout={"dp": self.layout.dp, "tp": self.layout.tp, "slices": self.layout.slices,
                    "devices": self.layout.devices, "global_batch": self.layout.global_batch},
            precision=self.precision_name, efficiency=self.efficiency, memory_fraction=self.memory_fraction,
            usable_bytes=int(self.usable), safety_margin=SAFETY_MARGIN, flash_attention=self.flash, micro_batch=micro,
            stages=stages,
            step={"stage": stage, "fits": best is not None, **step.as_dict()}, scaling=self.scaling(stage))
