"""A step's time read off its compiled programs: the matmul FLOPs at the chip's peak, plus the collectives
the compiler's schedule leaves exposed at the interconnect's bandwidth.

For each compiled program of the step (grad, reshard, update; zerolm.compile.aot):

- **FLOPs**: every `dot` (2 · result elements · contracted elements) and `convolution` (2 · result elements
  · kernel elements per output feature) of the optimized HLO, fused or not, times the runs of the
  computation that holds it: the trip counts of the while loops around it (zerolm.compile.hlo.runs: the layer scan,
  the accumulation loop, the blockwise attention's query blocks), and for the blockwise attention's key-block
  loop, whose bound is its query block's index + 1, the mean of its trip counts ((N + 1) / 2 of N blocks:
  zerolm.compile.hlo.TRIANGULAR_LOOP; `triangular_loops` says how many). A loop of unknown trip count is counted once
  (`unknown_loops`). cuDNN's flash attention (a custom call) is
  counted by its shapes: forward QKᵀ and A·V, 4·B·H·Tq·Tk·dh; backward those recomputed and the three
  gradients' matmuls, 10·B·H·Tq·Tk·dh; half of each under a causal mask (the kernel skips the masked tiles).
  A Pallas kernel (the TPU's flash attention) is counted by the cost estimate it carries where it has one (the
  forward kernel's: its full Tq × Tk, the causal skip not subtracted), else, for JAX's flash attention's backward
  kernels, by its shapes as that estimate counts: dK and dV's kernel 8·B·H·Tq·Tk·dh (QKᵀ and dO·Vᵀ again, dV, dK),
  dQ's 6 (QKᵀ and dO·Vᵀ again, dQ); `estimated_kernels` says how many runs were counted either way. Other custom
  calls (a Pallas kernel without either, a cuBLAS call with no dot dimensions stated) are not counted:
  `uncounted_kernels` says how many run, and their FLOPs are missing from the figure.
- **Exposed collectives**: each collective's bytes (its result, per device) times its runs; the ones the
  scheduler made asynchronous with compute placed between their start and done (zerolm.compile.collectives.read_async)
  are taken as hidden behind that compute; the rest, synchronous ones in full, are exposed and cost a ring's
  time over their replica group at the device's link bandwidth (zerolm.plan.timing.ring_time: latency
  plus (n−1)/n of the buffer per pass, two passes for an all-reduce).
- **Transfers between slices** (Cloud TPU Multislice: the host sends zerolm.compile.collectives.read_dcn reads) are
  not collectives of the program and never enter the ring times above: their bytes per device per step are counted
  apart (`Comms.dcn_bytes`), and zerolm.plan.timing.dcn_time charges them at the data-center network's rate
  (zerolm.core.hardware's per-host figures, a device's share), none hidden: the cross-slice all-reduce sits
  between the gradient and the update.

Modeled step time = Σ programs (FLOPs / peak + exposed collectives' time + transfers between slices' time).
Assumptions, so what it is: a lower bound that ranks plans rather than a prediction. Every matmul runs at the
chip's dense bf16 peak (float32 matmuls too); everything else (elementwise work, normalisation, the optimizer,
memory traffic, kernel launches) is free; a hidden collective is entirely hidden, an exposed one overlaps
nothing. Its error against steps measured on an H100 is stated in docs/planning.md (benchmarks/compiler/step_time.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, NamedTuple

from zerolm.compile import collectives as compiled_collectives
from zerolm.compile import hlo
from zerolm.core.hardware import Device
from zerolm.plan.timing import dcn_time, ring_time

if TYPE_CHECKING:
    from zerolm.parallel.build import BuiltStep

_DIMS = re.compile(r"\[([\d,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS_ALL = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_INTERMEDIATE = re.compile(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]')
_CAUSAL = re.compile(r'"mask_type":\s*"CAUSAL')
_FMHA_FORWARD, _FMHA_BACKWARD = 4, 10  # matmul FLOPs of cuDNN's attention per B·H·Tq·Tk·dh (see above)
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]')
# Custom calls that run matmuls: a cuBLAS GEMM (counted from its dot dimensions), the TPU's Pallas (Mosaic)
# kernels and Triton's (not counted: their FLOPs are not written in the HLO).
_MATMUL_KERNELS = ("cublas", "gemm", "matmul", "tpu_custom_call", "triton", "cudnn$conv")


def _dims(type_text: str) -> list[int]:
    m = _DIMS.search(type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(ins: hlo.Instruction, types: dict[str, str]) -> int:
    lhs = _dims(_type_of(ins.operands[0], types))
    dims = _CONTRACTING.search(ins.attributes)
    contracted = math.prod(lhs[int(i)] for i in dims.group(1).split(",") if i) if dims else 1
    return 2 * math.prod(_dims(ins.result)) * contracted


def _window(attributes: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([\d_x]+)", attributes)
    return [int(v) for v in m.group(1).split("x")] if m else [default] * n


def _convolution_flops(ins: hlo.Instruction, types: dict[str, str]) -> int:
    """2 · multiply-adds that touch real input: output batch × output features × the kernel's input
    features × per spatial dimension the (output, kernel) position pairs that land on an input element, not
    on padding or a dilation hole (the TPU compiler writes batched matmuls as convolutions whose windows,
    strides and dilations line up one kernel position per output)."""
    labels = _DIM_LABELS_ALL.search(ins.attributes)
    if labels is None:
        return 0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs, out = _dims(_type_of(ins.operands[0], types)), _dims(_type_of(ins.operands[1], types)), _dims(ins.result)
    spatial = sorted(c for c in lhs_l if c.isdigit())
    n = len(spatial)
    size = _window(ins.attributes, "size", n, 1)
    stride, lhs_dilate = _window(ins.attributes, "stride", n, 1), _window(ins.attributes, "lhs_dilate", n, 1)
    rhs_dilate = _window(ins.attributes, "rhs_dilate", n, 1)
    pads = re.search(r"\bpad=([\d_x\-]+)", ins.attributes)
    low = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * n
    macs = out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
    for d, c in enumerate(spatial):
        extent = (lhs[lhs_l.index(c)] - 1) * lhs_dilate[d] + 1
        pairs = 0
        for o in range(out[out_l.index(c)]):
            for k in range(size[d]):
                p = o * stride[d] + k * rhs_dilate[d] - low[d]
                pairs += 0 <= p < extent and p % lhs_dilate[d] == 0
        macs *= pairs
    return 2 * macs


def _gemm_flops(ins: hlo.Instruction, types: dict[str, str]) -> int:
    """A cuBLAS GEMM custom call: its result (the first of its tuple) times the contracted elements."""
    lhs = _dims(_type_of(ins.operands[0], types))
    dims = _GEMM_CONTRACTING.search(ins.attributes)
    contracted = math.prod(lhs[int(i.strip().strip('"'))] for i in dims.group(1).split(",") if i.strip()) if dims else 1
    return 2 * math.prod(_dims(ins.result)) * contracted


def _fmha_flops(ins: hlo.Instruction, target: str) -> int:
    scores = _INTERMEDIATE.search(ins.attributes)
    if scores is None:
        return 0
    b, h, tq, tk = (int(d.strip().strip('"')) for d in scores.group(1).split(","))
    head_dim = _dims(ins.result)[-1]
    per = _FMHA_BACKWARD if "Backward" in target else _FMHA_FORWARD
    return per * b * h * tq * tk * head_dim // (2 if _CAUSAL.search(ins.attributes) else 1)


_COST_FLOPS = re.compile(r'"cost_estimate":\{[^}]*?"flops":"?(\d+)')
_FLASH_BACKWARD = {"flash_mha_bwd_dkv": 8, "flash_mha_bwd_dq": 6}  # matmul FLOPs per B·H·Tq·Tk·dh (see above)


def _pallas_flops(ins: hlo.Instruction, types: dict[str, str]) -> int | None:
    """A Pallas kernel's FLOPs: its cost estimate, or a flash attention backward kernel's by its shapes; None if
    neither (see the module docstring)."""
    if estimate := _COST_FLOPS.search(ins.attributes):
        return int(estimate.group(1))
    per = next((n for prefix, n in _FLASH_BACKWARD.items() if ins.name.startswith(prefix)), None)
    if per is None or len(ins.operands) < 2:
        return None
    b, h, tq, dh = _dims(_type_of(ins.operands[0], types))  # q (B, H, Tq, dh), k (B, H, Tk, dh)
    return per * b * h * tq * _dims(_type_of(ins.operands[1], types))[2] * dh


def _type_of(operand: str, types: dict[str, str]) -> str:
    """An operand's type: written beside it, or (the GPU compiler writes names only) its instruction's."""
    head = operand.split("%", 1)[0]
    return head if "[" in head else types.get(operand.rsplit(" ", 1)[-1].lstrip("%"), "")


@dataclasses.dataclass(frozen=True)
class Flops:
    total: int  # per device per execution of the program, loop-aware
    kernels: int  # of which kernels' (cuDNN's attention, counted from its shapes; Pallas kernels)
    uncounted_kernels: int  # executions of custom calls whose FLOPs are not counted (Pallas, ...)
    unknown_loops: int  # computations with matmuls inside a loop of unknown trip count (counted once)
    triangular_loops: int = 0  # loops counted at the mean of their trip counts (zerolm.compile.hlo.TRIANGULAR_LOOP)
    estimated_kernels: int = 0  # executions of Pallas kernels counted by their cost estimate or the flash formula


class Counted(NamedTuple):
    """One instruction's matmul FLOPs and how they were counted."""

    flops: int
    how: str  # "dot" (dots and convolutions, cuBLAS calls), "kernel" (cuDNN's attention by its shapes), "estimate"
    # (a Pallas kernel by its cost estimate or the flash formula), "uncounted" (a matmul kernel whose FLOPs are not
    # written), "" (no matmul)


def instruction_flops(ins: hlo.Instruction, types: dict[str, str]) -> Counted:
    """The matmul FLOPs of one instruction per execution (see the module docstring); `types` its computation's
    results by name (the GPU compiler writes operands by name only)."""
    if ins.opcode == "dot":
        return Counted(_dot_flops(ins, types), "dot")
    if ins.opcode == "convolution":
        return Counted(_convolution_flops(ins, types), "dot")
    if ins.opcode != "custom-call":
        return Counted(0, "")
    target = (_TARGET.search(ins.attributes) or _TARGET.search(" ".join(ins.operands)))
    kind = target.group(1) if target else "?"
    if "fmha" in kind:
        return Counted(_fmha_flops(ins, kind), "kernel")
    if ("cublas" in kind or "gemm" in kind) and _GEMM_CONTRACTING.search(ins.attributes):
        return Counted(_gemm_flops(ins, types), "dot")
    if kind == "tpu_custom_call" and (pallas := _pallas_flops(ins, types)) is not None:
        return Counted(pallas, "estimate")
    return Counted(0, "uncounted" if any(k in kind for k in _MATMUL_KERNELS) else "")


def flops(hlo_text: str) -> Flops:
    """The matmul FLOPs one execution of a compiled program runs per device (see the module docstring)."""
    program = hlo.program(hlo_text)
    total = kernels = 0.0
    uncounted = unknown = estimated = 0
    for name, instructions in program.computations.items():
        types = {ins.name: ins.result for ins in instructions}
        times = program.runs.get(name, 1)
        found = 0
        for ins in instructions:
            counted = instruction_flops(ins, types)
            found += counted.flops
            if counted.how in ("kernel", "estimate"):
                kernels += counted.flops * (times or 1)
            estimated += round(times or 1) if counted.how == "estimate" else 0
            uncounted += round(times or 1) if counted.how == "uncounted" else 0
        if found and times is None:
            unknown += 1
        total += found * (times or 1)
    return Flops(round(total), round(kernels), uncounted, unknown, program.triangular_loops, estimated)


@dataclasses.dataclass(frozen=True)
class Comms:
    bytes: int  # every collective's result bytes per device, times its runs
    exposed_bytes: int  # those not hidden behind compute the schedule puts between start and done
    exposed_s: float  # the exposed ones at the device's link bandwidth (ring_time over each replica group)
    dcn_bytes: int = 0  # sent to other slices per device (collectives.read_dcn, times its runs): none of the above


_RING_OPS = {"all-reduce": "all-reduce", "reduce-scatter": "reduce-scatter", "all-gather": "all-gather"}


def _collective_s(device: Device, c: compiled_collectives.Collective, devices: int) -> float:
    n = len(c.groups[0]) if c.groups else devices
    if c.op == "reduce-scatter":  # its result is one device's share of the buffer the ring moves
        return ring_time(device, "reduce-scatter", c.bytes * n, n)
    if c.op == "collective-permute":
        return device.base_latency + c.bytes / device.intra_bw if n > 1 else 0.0
    return ring_time(device, _RING_OPS.get(c.op, "all-gather"), c.bytes, n)


def comms(hlo_text: str, device: Device, devices: int) -> Comms:
    """The program's collectives, and what of them the schedule leaves exposed (see the module docstring)."""
    hidden: dict[tuple[str, int], int] = {}  # (computation, bytes) -> asynchronous collectives with compute between
    for a in compiled_collectives.read_async(hlo_text):
        if a.overlaps:  # a fusion's collectives sit in its own computation (collectives.read), not the caller's
            key = (a.called or a.computation, a.bytes)
            hidden[key] = hidden.get(key, 0) + 1
    total = exposed = 0.0
    seconds = 0.0
    for c in compiled_collectives.read(hlo_text):
        times = c.runs or 1
        total += c.bytes * times
        key = (c.computation, c.bytes)
        if hidden.get(key):
            hidden[key] -= 1
            continue
        exposed += c.bytes * times
        seconds += _collective_s(device, c, devices) * times
    dcn = sum(t.bytes * (t.runs or 1) for t in compiled_collectives.read_dcn(hlo_text))
    return Comms(round(total), round(exposed), seconds, round(dcn))


@dataclasses.dataclass(frozen=True)
class StepModel:
    """A compiled step's modeled time per optimizer step, per device (see the module docstring)."""

    flops: dict[str, Flops]  # per program
    comms: dict[str, Comms]
    peak_flops: float  # of one device
    tokens_per_step: int  # all devices together
    devices: int  # of every slice
    model_flops_per_token: float  # zerolm.observe.mfu's 6·N + 12·L·d·T
    dcn_s: float = 0.0  # the transfers between slices (`dcn_s` of their bytes)

    @property
    def compute_s(self) -> float:
        return sum(f.total for f in self.flops.values()) / self.peak_flops

    @property
    def comm_s(self) -> float:
        return sum(c.exposed_s for c in self.comms.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.dcn_s

    @property
    def dcn_bytes(self) -> int:
        """Bytes each device sends to other slices per step (0 on one slice)."""
        return sum(c.dcn_bytes for c in self.comms.values())

    @property
    def flops_per_token(self) -> float:
        """The compiled matmul FLOPs per token (all devices' over the step's tokens)."""
        return sum(f.total for f in self.flops.values()) * self.devices / self.tokens_per_step

    @property
    def flops_ratio(self) -> float:
        """Compiled FLOPs per token ÷ the model's: 1 is no recomputation (with a causal kernel, below 1)."""
        return self.flops_per_token / self.model_flops_per_token

    @property
    def exposed_bytes(self) -> int:
        return sum(c.exposed_bytes for c in self.comms.values())

    @property
    def sent_bytes(self) -> int:
        """Every collective's bytes per device per step, overlapped or not (zerolm.compile.hlo's count)."""
        return sum(c.bytes for c in self.comms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float | None:
        """zerolm.observe.mfu's MFU at the modeled step time: an upper bound, as the time is a lower one. None where it
        would exceed 1, which says nothing: the model runs every matmul at peak, MFU's 6·N + 12·L·d·T counts
        the attention's whole T × T while a causal kernel computes about half of it, and kernels it cannot
        count (`uncounted_kernels`) cost it nothing."""
        value = self.model_flops_per_token * self.tokens_per_s / self.devices / self.peak_flops
        return value if value <= 1 else None

    def mfu_text(self) -> str:
        return f"{self.mfu:.1%}" if self.mfu is not None else "not modeled (its bound exceeds 100%)"

    @property
    def uncounted_kernels(self) -> int:
        return sum(f.uncounted_kernels for f in self.flops.values())

    def to_json(self) -> dict:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "step_s": self.step_s,
                "flops_per_token": self.flops_per_token, "flops_ratio": self.flops_ratio,
                "exposed_bytes": self.exposed_bytes, "sent_bytes": self.sent_bytes, "dcn_s": self.dcn_s,
                "dcn_bytes": self.dcn_bytes, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "uncounted_kernels": self.uncounted_kernels,
                "programs": {name: {**dataclasses.asdict(self.flops[name]), **dataclasses.asdict(self.comms[name])}
                             for name in self.flops}}

    def describe(self) -> str:
        missing = (f"; {self.uncounted_kernels} kernel runs (custom calls) not counted"
                   if self.uncounted_kernels else "")
        dcn = (f" + {self.dcn_s:.3f} s between slices ({self.dcn_bytes / 1e9:.3f} GB per device over the "
               "data-center network)" if self.dcn_bytes else "")
        return (f"modeled step {self.step_s:.3f} s = {self.compute_s:.3f} s of matmuls at "
                f"{self.peak_flops / 1e12:.0f} TFLOP/s + {self.comm_s:.3f} s of exposed collectives "
                f"({self.exposed_bytes / 1e9:.2f} GB per device){dcn}; {self.flops_ratio:.3f}x the model's FLOPs per "
                f"token; {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu_text()} (a lower bound on the time: "
                f"zerolm.compile.step_time says what it leaves out{missing}{self.loops_note()})")

    def loops_note(self) -> str:
        """What the FLOPs assumed of loops whose trip count the compiler does not state, and of Pallas kernels."""
        triangular = sum(f.triangular_loops for f in self.flops.values())
        unknown = sum(f.unknown_loops for f in self.flops.values())
        estimated = sum(f.estimated_kernels for f in self.flops.values())
        return ((f"; {triangular} causal key-block loops counted at their mean trip count" if triangular else "")
                + (f"; {unknown} loops of unknown trip count counted once" if unknown else "")
                + (f"; {estimated} Pallas kernel runs counted by their cost estimate or the flash attention's "
                   "formula (its full T x T)" if estimated else ""))


def model(texts: dict[str, str], device: Device, devices: int, tokens_per_step: int,
          model_flops_per_token: float, slices: int = 1) -> StepModel:
    """The step model of a compiled step's programs (`CompiledStep.texts`) on `devices` of `device` in all, in
    `slices` slices (the programs are one slice's: its collectives span at most its devices)."""
    per_program = {n: comms(t, device, devices // slices) for n, t in texts.items()}
    return StepModel({n: flops(t) for n, t in texts.items()}, per_program, device.flops, tokens_per_step, devices,
                     model_flops_per_token, dcn_time(device, sum(c.dcn_bytes for c in per_program.values())))


def of_step(built: BuiltStep, device: Device) -> StepModel:
    """The step model of a step built and compiled for a target (zerolm.parallel.build.build_and_compile) whose
    devices are `device` (a planner preset, zerolm.core.hardware.PRESETS: its peak and its links)."""
    from zerolm.model.decoder import count_params
    from zerolm.model.flops import flops_per_token

    cfg = built.cfg
    n = count_params(built.zero.abstract_params, matmul_only=True)
    per_token = flops_per_token(n, cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len)
    return model(built.compiled.texts, device, cfg.device_count, cfg.train.global_batch_size * cfg.model.seq_len,
                 per_token, cfg.mesh.slices)
