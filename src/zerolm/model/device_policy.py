"""What `auto` means on each device: the model's dtype, attention and layer loop for the device it runs on
(a TPU slice compiled for ahead of time is not this machine's backend), and which attention cannot run there.

Host code resolves a config here once (zerolm.parallel.build.build_model, zerolm.checkpoint.trained_model.load); the model
(zerolm.model.decoder.GPT) takes only resolved configs, so nothing traced reads a global device. The planner's
device presets ask the same rules (`resolve_auto`, `resolve_scan_layers`) by platform name.
"""

from __future__ import annotations

import jax

from zerolm.config.tree import ModelConfig
from zerolm.core.hardware import tpu_generation
from zerolm.model.attention import BLOCK, PALLAS_LANES, block_size, pallas_available, pallas_fits


def for_device(cfg: ModelConfig, device: jax.Device | None = None) -> ModelConfig:
    """`dtype: auto` and `attention: auto` made concrete for the device the model will run on (default:
    this process's first): a TPU slice compiled for ahead of time is not this machine's backend.

    dtype: bfloat16 on GPU and TPU, float32 on CPU. attention: cuDNN flash attention on a GPU with 16-bit
    compute; Pallas's flash attention on TPU v4 and later, the blockwise attention on TPU v2/v3 (neither
    holds T×T scores; zerolm.model.attention); XLA's on CPU. With ALiBi, the blockwise attention where Pallas's
    would be chosen (its kernel takes a bias only as a dense array per example); with attention dropout,
    neither fused kernel (XLA's on a GPU, blockwise on a TPU)."""
    device = device or jax.devices()[0]
    dtype, attention = resolve_auto(cfg.dtype, cfg.attention, device.platform, device.device_kind, cfg.seq_len,
                                    cfg.attention_block)
    if attention == "pallas" and cfg.attention == "auto" and (cfg.position == "alibi" or cfg.attention_dropout):
        attention = "blockwise"
    if attention == "cudnn" and cfg.attention == "auto" and cfg.attention_dropout:
        attention = "xla"  # cuDNN's kernel cannot draw zerolm's masks
    return cfg.model_copy(update={"dtype": dtype, "attention": attention,
                                  "scan_layers": resolve_scan_layers(cfg.scan_layers, device.platform, cfg.remat)})


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


def unrunnable_attention(cfg: ModelConfig, device: jax.Device) -> str | None:
    """Why `cfg`'s attention cannot run on `device` (a one-line error naming the key), or None."""
    if cfg.attention == "pallas" and not pallas_fits(cfg.seq_len, cfg.attention_block):
        return (f"model.attention: pallas cuts the sequence into blocks of a multiple of {PALLAS_LANES} positions; "
                f"seq_len {cfg.seq_len} and attention_block {cfg.attention_block} give "
                f"{block_size(cfg.seq_len, cfg.attention_block)}")
    if cfg.attention == "pallas" and (device.platform != "tpu" or (tpu_generation(device.device_kind) or 0) < 4):
        return (f"model.attention: pallas runs on TPU v4 and later, not on {device.device_kind} ({device.platform}); "
                "use auto or blockwise")
    if cfg.attention == "cudnn" and device.platform not in ("gpu", "cuda"):
        return f"model.attention: cudnn runs on NVIDIA GPUs, not on {device.device_kind} ({device.platform}); use auto"
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
