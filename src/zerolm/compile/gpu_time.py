"""A step's time on an NVIDIA GPU predicted from its deviceless compile, kernel by kernel (`zerolm compile --target
h100|h200`): what zerolm judges a change by where no GPU is at hand.

Every kernel the compiled programs run (zerolm.compile.bytes_moved's census: a fusion, a cuBLAS or cuDNN call, a
copy, a collective; each counted as often as its loops run it) is given a class as a GPU profile names its kernels:
`matmul` (cuBLAS GEMMs: XLA's custom fusions around a dot, or a GEMM call), `attention` (cuDNN's flash attention),
`reduction` (XLA's reduction fusions, `kInput`: the LayerNorms' statistics, the loss's log-sum-exp, bias and norm
gradients, the gradient's accumulation), `elementwise` (loop fusions, `kLoop`), `copy` (copies, transposes, slices
and dynamic-update-slices outside a fusion) and `collective`. Its time is the roofline's:

    max(FLOPs / (peak · its class's matmul efficiency), bytes / (memory bandwidth · memory efficiency)) + launch

with the kernel's matmul FLOPs as zerolm.compile.step_time counts them and its bytes as the census does (operands
and results, slices read and written in place counted as the slices). What each class reaches is a card's
(`Card.reached`), calibrated on a step measured on it (`CALIBRATION`): each class's share of the measured step's
kernel time, as its profile divided it, over the class's FLOPs (matmul, attention) or bytes (the rest) in the
same step compiled here. A kernel's launch and the gap after it are in its class's rate, not apart. A step is the
sum over its kernels (one GPU runs one kernel at a time); its collectives are charged as zerolm.compile.step_time
charges them, at the links' rate, where the schedule leaves them exposed (on one card there are none).

What it is: a model calibrated on one configuration (125m) and checked on another (1_3b), which ranks changes by
the kernels they remove or shrink. A class reaching more than its datasheet rate is possible: the census counts
each operand whole where the L2 cache serves re-reads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from zerolm.compile import bytes_moved, hlo, step_time
from zerolm.compile.step_time import instruction_flops
from zerolm.core.hardware import Device, GpuType, chip

CLASSES = ("matmul", "attention", "reduction", "elementwise", "copy", "collective")
_KIND = re.compile(r"\bkind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_COPIES = ("copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "scatter",
           "gather")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program: its census kind, class, runs per execution, and per run its matmul FLOPs
    and bytes."""

    kind: str
    klass: str
    runs: float
    flops: int
    bytes: int


COMPUTE = ("matmul", "attention")  # timed by their FLOPs (or their bytes, where those take longer)


@dataclasses.dataclass(frozen=True)
class Card:
    """A GPU as the kernel model sees it: its datasheet's dense bf16 peak and memory bandwidth, and what each class
    of kernels reaches of them (`reached`: of the peak for matmul and attention, of the bandwidth for the rest),
    calibrated on a step measured on a card of its kind (`calibrate`)."""

    name: str
    peak_flops: float  # FLOP/s, dense bf16
    memory_bw: float  # bytes/s, HBM
    reached: dict[str, float]  # class -> share of the peak (COMPUTE) or of the bandwidth (the others)
    source: str


def classify(ins: hlo.Instruction, comps: dict[str, list[hlo.Instruction]]) -> str:
    """A kernel's class (`CLASSES`), as a profile would name it."""
    op = ins.opcode.removesuffix("-start")
    if op in hlo.COLLECTIVE_OPS:
        return "collective"
    if ins.opcode == "custom-call":
        target = _TARGET.search(ins.attributes)
        name = target.group(1) if target else ""
        return "attention" if "fmha" in name else "matmul" if "gemm" in name or "cublas" in name else "elementwise"
    if ins.opcode == "fusion":
        kind = _KIND.search(ins.attributes)
        fused = comps.get(dict(ins.called()).get("calls", ""), [])
        if any(f.opcode in ("dot", "convolution") for f in fused):
            return "matmul"
        if kind and kind.group(1) == "kInput" or any(f.opcode == "reduce" for f in fused):
            return "reduction"
        root = next((f for f in fused if f.root), None)
        if root is not None and root.opcode in _COPIES and all(f.opcode in (*_COPIES, "parameter", "bitcast",
                                                                              "constant", "tuple") for f in fused):
            return "copy"
        return "elementwise"
    if ins.opcode in ("dot", "convolution"):
        return "matmul"
    if ins.opcode == "reduce":
        return "reduction"
    return "copy" if ins.opcode in _COPIES else "elementwise"


def kernels(hlo_text: str) -> Iterator[Kernel]:
    """Every kernel of a compiled program (what the census counts), with its class, runs, FLOPs and bytes."""
    program = hlo.program(hlo_text)
    comps = {name: bytes_moved.typed(instructions) for name, instructions in program.computations.items()}
    for name in sorted(program.executed):
        times = program.runs.get(name) or 1
        for ins in comps[name]:
            if ins.opcode in bytes_moved.BOOKKEEPING or ins.opcode == "async-start":
                continue
            called = dict(ins.called()).get("calls")
            inside = comps.get(called, []) if ins.opcode == "fusion" and called else [ins]
            types = {i.name: i.result for i in (inside if ins.opcode == "fusion" else comps[name])}
            flops = sum(instruction_flops(i, types).flops for i in inside)
            yield Kernel(bytes_moved.kind_of(ins, comps), classify(ins, comps), times, flops,
                         bytes_moved.bytes_of(ins, comps))


def kernel_s(kernel: Kernel, card: Card) -> float:
    """One run of a kernel on `card`: a matmul or attention kernel by its FLOPs at the rate its class reaches (or
    its bytes at the whole bandwidth, where those take longer), any other by its bytes at its class's rate."""
    rate = card.reached.get(kernel.klass, 1.0)
    if kernel.klass in COMPUTE:
        return max(kernel.flops / (card.peak_flops * rate), kernel.bytes / card.memory_bw)
    return kernel.bytes / (card.memory_bw * rate)


@dataclasses.dataclass(frozen=True)
class GpuStep:
    """A step's modeled time on a card, by kernel class (seconds per step, every program of the step)."""

    card: Card
    seconds: dict[str, float]  # class -> seconds
    runs: dict[str, float]  # class -> kernel runs
    flops: int  # matmul FLOPs per step (all classes)
    bytes: int  # bytes read and written per step

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        total = self.step_s or 1.0
        return {k: v / total for k, v in self.seconds.items()}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {self.seconds[k] * 1e3:.1f} ms ({share:.0%})" for k, share in self.shares().items()
                          if self.seconds[k])
        return (f"modeled on {self.card.name}, kernel by kernel: {self.step_s:.3f} s per step ({parts}); "
                f"{sum(self.runs.values()):,.0f} kernel runs, {self.bytes / 1e9:.1f} GB moved "
                f"(zerolm.compile.gpu_time: {self.card.source})")

    def to_json(self) -> dict:
        return {"card": self.card.name, "step_s": self.step_s, "seconds": self.seconds, "runs": self.runs,
                "flops": self.flops, "bytes": self.bytes}


def step(texts: dict[str, str], card: Card, link: Device | None = None, devices: int = 1) -> GpuStep:
    """The modeled step of a compiled step's programs (`CompiledStep.texts`) on `card`; its exposed collectives
    at `link`'s rates (a planner preset: zerolm.compile.step_time.comms) over `devices` GPUs."""
    seconds = dict.fromkeys(CLASSES, 0.0)
    runs = dict.fromkeys(CLASSES, 0.0)
    flops = moved = 0.0
    for text in texts.values():
        for kernel in kernels(text):
            runs[kernel.klass] += kernel.runs
            flops += kernel.runs * kernel.flops
            moved += kernel.runs * kernel.bytes
            if kernel.klass != "collective":
                seconds[kernel.klass] += kernel.runs * kernel_s(kernel, card)
        if link is not None and devices > 1:
            seconds["collective"] += step_time.comms(text, link, devices).exposed_s
    return GpuStep(card, seconds, runs, round(flops), round(moved))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A step measured on a card, and its kernel time by class as the card's profile divided it."""

    config: str  # configs/<config>.yaml
    sets: tuple[str, ...]  # the overrides it ran with
    step_s: float  # measured, per optimizer step
    shares: dict[str, float]  # class -> share of the kernel time
    source: str


# 125m at micro-batch 16, two micro-steps, no remat, ZeRO-1, on one H100 80GB HBM3: 0.167 s a step on a card that did
# not throttle (2026-11-27), its kernel time by class as the profile of 2026-11-26 divided it (BENCHMARKS.md,
# "H100, third session" and "H100 again"; docs/performance-notes.md).
CALIBRATION = Calibration(
    "125m", ("mesh.dp=1", "zero.stage=1", "model.remat=none", "train.micro_batch_size=16", "train.global_batch_size=32"),
    0.167, {"matmul": 0.423, "reduction": 0.242, "attention": 0.185, "elementwise": 0.133, "copy": 0.016},
    "H100 80GB HBM3, 125m none/16, 2026-11-26/27")


# What each class of kernels reached on CALIBRATION's H100 step, solved by `calibrate`
# (`python -m benchmarks.compiler.step_time --fit` prints them): of the peak for matmul and attention, of the
# bandwidth for the rest.
H100_REACHED = {"matmul": 0.6955, "reduction": 0.659, "attention": 0.2834, "elementwise": 1.0691, "copy": 0.0985}


def card(gpu: GpuType) -> Card:
    """An NVIDIA card as XLA's description of it states it (its memory bandwidth) and the hardware table's peak, its
    kernels reaching what the H100's reached (H100_REACHED: the one card measured; another's may reach more)."""
    kind = {"h100": "H100", "h100-pcie": "H100 PCIe", "h200": "H200", "b200": "B200"}.get(gpu.name, "A100")
    found = chip(kind)
    assert found is not None, kind
    return Card(gpu.name, found.flops, gpu.memory_bandwidth(), dict(H100_REACHED),
                f"{found.source}; {gpu.memory_bandwidth() / 1e12:.2f} TB/s (XLA's description); the kernels' rates "
                f"calibrated on {CALIBRATION.source}")


def calibrate(texts: dict[str, str], name: str, peak_flops: float, memory_bw: float,
              calibration: Calibration = CALIBRATION) -> Card:
    """The Card whose classes reach, on the compiled step `texts` of `calibration`'s configuration, the time its
    profile measured for each (solved class by class: the modeled time falls as the rate rises)."""
    found = [k for text in texts.values() for k in kernels(text) if k.klass in calibration.shares]
    reached = {}
    for klass, share in calibration.shares.items():
        mine = [k for k in found if k.klass == klass]
        reached[klass] = _rate(mine, klass, share * calibration.step_s, peak_flops, memory_bw)
    return Card(name, peak_flops, memory_bw, reached, f"calibrated on {calibration.source}")


def _rate(mine: list[Kernel], klass: str, target: float, peak_flops: float, memory_bw: float) -> float:
    """The rate at which `klass`'s kernels `mine` take `target` seconds (bisection on a log scale: the modeled time
    falls as the rate rises); ValueError where none does (a matmul class bound by its bytes, say)."""
    def modeled(rate: float) -> float:
        return sum(k.runs * kernel_s(k, Card("", peak_flops, memory_bw, {klass: rate}, "")) for k in mine)

    low, high = 1e-9, 1e3
    for _ in range(200):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if modeled(mid) > target else (low, mid)
    rate = float(f"{(low * high) ** 0.5:.4g}")
    if abs(modeled(rate) - target) > 0.01 * target:
        raise ValueError(f"{klass}: no rate models {target * 1e3:.1f} ms (at its fastest {modeled(1e3) * 1e3:.1f})")
    return rate
