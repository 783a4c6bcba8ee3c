"""What `auto` means where the model runs: every `auto` of the `model:` section (its compute dtype, attention and
layer loop) decided here, in one place, for a device (a TPU slice compiled for ahead of time is not this
machine's backend), the mesh's tensor parallelism and the ZeRO stage; and which attention cannot run there.

`resolve` is that one decision. The step (zerolm.parallel.build.build_step), a model read from a checkpoint
(zerolm.checkpoint.trained_model) and the planner's device presets (by platform name: `Where(platform, kind)`)
all ask it; the model (zerolm.model.decoder.GPT) takes only resolved configs, so nothing traced reads a
global device. `model.remat: auto` alone is decided elsewhere, by compiling: the least recomputation whose
compiled step fits (zerolm.parallel.build.build_and_compile).
"""

from __future__ import annotations

import dataclasses

import jax

from zerolm.config.model import ModelConfig
from zerolm.config.section import ConfigError
from zerolm.core.hardware import tpu_generation
from zerolm.model.attention import BLOCK, PALLAS_LANES, block_size, pallas_available, pallas_fits


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a model runs, as far as its `auto` settings care: the JAX platform (cpu, gpu/cuda, tpu), the device
    kind (a TPU's generation; a planner preset's name will do), the mesh's tp and the ZeRO stage."""

    platform: str
    device_kind: str = ""
    tp: int = 1
    stage: int = 1

    @classmethod
    def of(cls, device: jax.Device | None = None, tp: int = 1, stage: int = 1) -> Where:
        """A device's (default: this process's first)."""
        device = device or jax.devices()[0]
        return cls(device.platform, device.device_kind, tp, stage)


def resolve(cfg: ModelConfig, where: Where) -> ModelConfig:
    """`cfg` with every `auto` but remat's made concrete for `where` (ConfigError: an attention it cannot run).

    dtype: bfloat16 on GPU and TPU, float32 on CPU. attention: cuDNN flash attention on a GPU with 16-bit
    compute; Pallas's flash attention on TPU v4 and later, the blockwise attention on TPU v2/v3 (neither
    holds T×T scores; zerolm.model.attention); XLA's on CPU. With ALiBi, the blockwise attention where Pallas's
    would be chosen (its kernel takes a bias only as a dense array per example); with attention dropout,
    neither fused kernel (XLA's on a GPU, blockwise on a TPU); with tp > 1, XLA's where cuDNN's would be
    chosen (JAX cannot partition cuDNN's call under the step's partly manual shard_map). The layer loop:
    `resolve_scan_layers`, at stages 2 and 3 a scan (`scan_layers_at_stage`)."""
    if (why := unrunnable_attention(cfg, where)) is not None:
        raise ConfigError(why)
    dtype, attention = resolve_auto(cfg.dtype, cfg.attention, where.platform, where.device_kind, cfg.seq_len,
                                    cfg.attention_block)
    if cfg.attention == "auto" and attention == "pallas" and (cfg.position == "alibi" or cfg.attention_dropout):
        attention = "blockwise"
    if cfg.attention == "auto" and attention == "cudnn" and (cfg.attention_dropout or where.tp > 1):
        attention = "xla"  # cuDNN's kernel cannot draw zerolm's masks, nor be partitioned inside the step
    scan = resolve_scan_layers(scan_layers_at_stage(cfg.scan_layers, where.stage), where.platform, cfg.remat)
    return cfg.model_copy(update={"dtype": dtype, "attention": attention, "scan_layers": scan})


def for_device(cfg: ModelConfig, device: jax.Device | None = None) -> ModelConfig:
    """`resolve` for one device (default: this process's first), no tensor parallelism, stage 1: a model
    outside the step (evaluation, sampling, tests)."""
    return resolve(cfg, Where.of(device))


def resolve_scan_layers(scan_layers: bool | str, platform: str, remat: str = "none") -> bool:
    """`model.scan_layers: auto` on `platform`, with `model.remat`: unrolled on a GPU without remat, where
    the compiled step of a scan keeps stacked buffers of the layers' activations, zero-filled every
    micro-step, and moves more bytes (1_3b on an H100 at micro-batch 8: 1.24× the bytes of the unrolled
    step); a scan with a remat policy that recomputes (unrolled, XLA may undo the recomputation: 760m on
    eight H100s at one micro-step, full remat, 73.5 GiB unrolled against 12.7 in a scan), on a TPU (unrolling
    1_3b cost 6× the compile time and 5 GiB more) and on a CPU. docs/performance-notes.md has the figures."""
    if scan_layers != "auto":
        return bool(scan_layers)
    return platform.lower() not in ("gpu", "cuda", "rocm") or remat not in ("none", "auto")


def scan_layers_at_stage(scan_layers: bool | str, stage: int) -> bool | str:
    """`model.scan_layers` at ZeRO `stage`: at stages 2 and 3, `auto` is a scan, whatever the device. Their
    point is a layer's collectives where the layer runs; unrolled, the GPU compiler combines the layers'
    reduce-scatters into one after the whole backward pass (and stage 3's gathers into a few), so every
    layer's gradient is held whole again (125m on eight H100s at stage 3: one reduce-scatter in the
    micro-step instead of one per layer). An explicit true or false stays."""
    return True if stage > 1 and scan_layers == "auto" else scan_layers


def unrunnable_attention(cfg: ModelConfig, where: Where) -> str | None:
    """Why `cfg`'s attention cannot run `where` (a one-line error naming the key), or None."""
    if cfg.attention == "pallas" and not pallas_fits(cfg.seq_len, cfg.attention_block):
        return (f"model.attention: pallas cuts the sequence into blocks of a multiple of {PALLAS_LANES} positions; "
                f"seq_len {cfg.seq_len} and attention_block {cfg.attention_block} give "
                f"{block_size(cfg.seq_len, cfg.attention_block)}")
    if cfg.attention == "pallas" and (where.platform != "tpu" or (tpu_generation(where.device_kind) or 0) < 4):
        return (f"model.attention: pallas runs on TPU v4 and later, not on {where.device_kind} ({where.platform}); "
                "use auto or blockwise")
    if cfg.attention == "cudnn" and where.platform not in ("gpu", "cuda"):
        return f"model.attention: cudnn runs on NVIDIA GPUs, not on {where.device_kind} ({where.platform}); use auto"
    if cfg.attention == "cudnn" and where.tp > 1:
        return ("model.attention: cudnn does not compile with mesh.tp > 1 in zerolm's step (JAX cannot partition "
                "cuDNN's attention call there); use mesh.tp=1, or model.attention=xla")
    return None


def resolve_auto(dtype: str, attention: str, platform: str, device_kind: str = "", seq_len: int | None = None,
                 block: int = BLOCK) -> tuple[str, str]:
    """The rule behind `for_device` (and the planner's device presets): (dtype, attention) on `platform`
    (a JAX platform name: cpu, gpu/cuda/rocm, tpu) and `device_kind` (a TPU's generation; a preset name
    will do). On TPU v4+ auto takes Pallas when this JAX has its kernel and the sequence cuts into blocks
    of whole 128-lane multiples, the blockwise attention otherwise."""
    platform = platform.lower()
    gpu = platform in ("gpu", "cuda", "rocm")
    if dtype == "auto":
        dtype = "bfloat16" if gpu or platform == "tpu" else "float32"
    if attention == "auto":
        if gpu:
            attention = "cudnn" if dtype in ("bfloat16", "float16") else "xla"
        elif platform == "tpu":
            pallas = ((tpu_generation(device_kind) or 0) >= 4 and pallas_available()
                      and (seq_len is None or pallas_fits(seq_len, block)))
            attention = "pallas" if pallas else "blockwise"
        else:
            attention = "xla"
    return dtype, attention
