"""Every `auto` a config can hold, made concrete here, in one place, for where the step runs: the planner, the
compiler, the step builder, a run and a model read from a checkpoint all ask this module, so what one plans is what
another runs.

| key | auto means | decided by |
|---|---|---|
| `mesh.dp` | every device tp does not use | at load, where the device count is known (config.tree) |
| `model.vocab_size`, `model.eot_id` | the dataset tokenizer's | `vocabulary`, with the data's facts (data.dataset) |
| `model.n_kv_head`, `model.mlp_hidden` | n_head; 4·d (gelu), Llama's 8/3·d up to a multiple of 256 (swiglu) | `model_settings` |
| `model.dtype` | bfloat16 on GPU and TPU, float32 on CPU | `dtype` |
| `model.attention` | cuDNN's (GPU), Pallas's (TPU v4+), blockwise (TPU v2/v3), XLA's (CPU); exceptions there | `attention` |
| `model.scan_layers` | unrolled on a GPU without remat, else a scan; a scan at ZeRO stages 2 and 3 | `scan_layers` |
| `model.remat` | the least recomputation whose compiled step fits; `none` outside the step | `remat_candidates` |
| `zero.scatter` | psum_scatter, or two stages / a ring where the TPU compiler would all-reduce | `scatter` |
| `zero.tpu_async_collectives` | on at ZeRO-3 on a TPU | core.tpu_flags (libtpu reads it before JAX starts) |

The remat candidates are tried in turn by compiling (zerolm.parallel.build.build_and_compile). The model
(zerolm.model.decoder.GPT) takes only configs resolved here, so nothing traced reads a global device.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

import jax
from jax.sharding import Mesh

from zerolm.config.model import ModelConfig, ResolvedModelConfig, mlp_width
from zerolm.config.section import ConfigError
from zerolm.core.hardware import chips_per_host, tpu_generation
from zerolm.model.attention import PALLAS_LANES, block_size, pallas_available, pallas_fits
from zerolm.parallel.mesh import TP
from zerolm.parallel.scatter import two_stage_inner

_GPU = ("gpu", "cuda", "rocm")

# model.remat: auto tries these in turn and takes the first whose compiled step fits the device: the least
# recomputed first (none rebuilds only LayerNorms and GELUs; dots_attention also XLA's attention scores;
# dots runs the attention forward again; attention every weight matmul; full the whole block).
REMAT_ORDER = ("none", "dots_attention", "dots", "attention", "full")

Scatter = Literal["auto", "collective", "ring", "two_stage"]


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

    @classmethod
    def of_mesh(cls, mesh: Mesh, stage: int) -> Where:
        return cls.of(mesh.devices.flat[0], mesh.shape.get(TP, 1), stage)

    @property
    def gpu(self) -> bool:
        return self.platform.lower() in _GPU


def dtype(requested: str, where: Where) -> str:
    """model.dtype: auto is bfloat16 on GPU and TPU, float32 on CPU."""
    if requested != "auto":
        return requested
    return "bfloat16" if where.gpu or where.platform.lower() == "tpu" else "float32"


class AttentionAsked(Protocol):
    """What `attention` reads of a model: its `model:` section (a ModelConfig), or the planner's Model."""

    @property
    def attention(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def attention_block(self) -> int: ...
    @property
    def position(self) -> str: ...
    @property
    def attention_dropout(self) -> float: ...


def attention(model: AttentionAsked, where: Where) -> str:
    """model.attention: auto is cuDNN's flash attention on a GPU with 16-bit compute; Pallas's flash attention on
    TPU v4 and later where this JAX has its kernel and the sequence cuts into blocks of whole 128-lane multiples,
    the blockwise attention elsewhere on a TPU (neither holds T×T scores; zerolm.model.attention); XLA's on CPU.
    With ALiBi, the blockwise attention where Pallas's would be chosen (its kernel takes a bias only as a dense
    array per example); with attention dropout, neither fused kernel (XLA's on a GPU, blockwise on a TPU); with
    tp > 1, XLA's where cuDNN's would be chosen (JAX cannot partition cuDNN's call under the step's partly manual
    shard_map)."""
    if model.attention != "auto":
        return model.attention
    if where.gpu:
        fused = dtype(model.dtype, where) in ("bfloat16", "float16")
        return "cudnn" if fused and not model.attention_dropout and where.tp == 1 else "xla"
    if where.platform.lower() == "tpu":
        pallas = ((tpu_generation(where.device_kind) or 0) >= 4 and pallas_available()
                  and pallas_fits(model.seq_len, model.attention_block))
        return "pallas" if pallas and model.position != "alibi" and not model.attention_dropout else "blockwise"
    return "xla"


def scan_layers(requested: bool | str, where: Where, remat: str = "none") -> bool:
    """model.scan_layers: at ZeRO stages 2 and 3, auto is a scan, whatever the device: their point is a layer's
    collectives where the layer runs, and unrolled, the GPU compiler combines the layers' reduce-scatters into one
    after the whole backward pass (125m on eight H100s at stage 3: one reduce-scatter in the micro-step instead of
    one per layer). Otherwise unrolled on a GPU without remat, where the compiled step of a scan keeps stacked
    buffers of the layers' activations, zero-filled every micro-step, and moves more bytes (1_3b on an H100 at
    micro-batch 8: 1.24× the bytes of the unrolled step); a scan with a remat policy that recomputes (unrolled, XLA
    may undo the recomputation: 760m on eight H100s at one micro-step, full remat, 73.5 GiB unrolled against 12.7
    in a scan), on a TPU (unrolling 1_3b cost 6× the compile time and 5 GiB more) and on a CPU.
    docs/performance-notes.md has the figures. An explicit true or false stays."""
    if requested != "auto":
        return bool(requested)
    if where.stage > 1:
        return True
    return not where.gpu or remat not in ("none", "auto")


def unrunnable_attention(model: ModelConfig, where: Where) -> str | None:
    """Why `model`'s attention cannot run `where` (a one-line error naming the key), or None."""
    if model.attention == "pallas" and not pallas_fits(model.seq_len, model.attention_block):
        return (f"model.attention: pallas cuts the sequence into blocks of a multiple of {PALLAS_LANES} positions; "
                f"seq_len {model.seq_len} and attention_block {model.attention_block} give "
                f"{block_size(model.seq_len, model.attention_block)}")
    if model.attention == "pallas" and (where.platform != "tpu" or (tpu_generation(where.device_kind) or 0) < 4):
        return (f"model.attention: pallas runs on TPU v4 and later, not on {where.device_kind} ({where.platform}); "
                "use auto or blockwise")
    if model.attention == "cudnn" and not where.gpu:
        return f"model.attention: cudnn runs on NVIDIA GPUs, not on {where.device_kind} ({where.platform}); use auto"
    if model.attention == "cudnn" and where.tp > 1:
        return ("model.attention: cudnn does not compile with mesh.tp > 1 in zerolm's step (JAX cannot partition "
                "cuDNN's attention call there); use mesh.tp=1, or model.attention=xla")
    return None


def model_settings(model: ModelConfig, where: Where) -> ResolvedModelConfig:
    """`model` with every `auto` made concrete for `where`, its vocabulary already the data's (`vocabulary`): n_kv_head,
    mlp_hidden, dtype, attention, scan_layers, and remat (where no compile chooses it: the first of REMAT_ORDER, the
    least recomputed; a step compiled with remat auto tries them in turn, `remat_candidates`). ConfigError for an
    attention it cannot run there, or a document mask without the data's end-of-text id."""
    if (why := unrunnable_attention(model, where)) is not None:
        raise ConfigError(why)
    if model.vocab_size == "auto":
        raise ValueError("model.vocab_size is still auto: the data's tokenizer resolves it first (`vocabulary`)")
    if model.document_mask and model.eot_id == "auto":
        raise ConfigError("model.eot_id: auto, and model.document_mask needs the end-of-text id: the dataset's "
                          "tokenizer gives it where a run reads its data; set it to compile or plan without data")
    return ResolvedModelConfig.model_validate({**model.model_dump(), **{
        "n_kv_head": model.n_head if model.n_kv_head == "auto" else model.n_kv_head,
        "mlp_hidden": mlp_width(model.mlp, model.d_model, model.mlp_hidden),
        "dtype": dtype(model.dtype, where), "attention": attention(model, where),
        "scan_layers": scan_layers(model.scan_layers, where, model.remat),
        "remat": remat_candidates(model.remat)[0]}})


def for_device(model: ModelConfig, device: jax.Device | None = None) -> ResolvedModelConfig:
    """`model_settings` for one device (default: this process's first), no tensor parallelism, stage 1: a model
    outside the step (evaluation, sampling, serving, tests), which takes no gradient, so every remat policy
    computes the same."""
    return model_settings(model, Where.of(device))


def for_shapes(model: ModelConfig) -> ResolvedModelConfig:
    """`model` resolved as on a CPU: for its parameters' shapes and names, which no device changes."""
    return model_settings(model, Where("cpu"))


def remat_candidates(remat: str) -> tuple[str, ...]:
    """The policies a step compiles in turn (model.remat auto: REMAT_ORDER), or the one asked for."""
    return REMAT_ORDER if remat == "auto" else (remat,)


def vocabulary(model: ModelConfig, vocab_size: int, eot_id: int, tokenizer: str) -> ModelConfig:
    """model.vocab_size and model.eot_id from the data's tokenizer (`auto`: its own), or checked against it (a
    vocabulary it does not fit, an end-of-text it does not have: ConfigError naming the key)."""
    if model.vocab_size != "auto" and model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size: {model.vocab_size} is smaller than the dataset's tokenizer "
                          f"({tokenizer}, {vocab_size} tokens)")
    if model.eot_id not in ("auto", eot_id):
        raise ConfigError(f"model.eot_id: {model.eot_id} is not the end-of-text token of the dataset's tokenizer "
                          f"({tokenizer}: {eot_id}); leave it auto")
    return model.model_copy(update={"vocab_size": vocab_size if model.vocab_size == "auto" else model.vocab_size,
                                    "eot_id": eot_id})


def scatter(requested: Scatter, mesh: Mesh) -> Scatter:
    """zero.scatter, how the one reduce-scatter over dp runs on `mesh` (zerolm.parallel.scatter): auto follows what the
    TPU compiler makes of a psum_scatter over the whole dp axis (docs/performance-notes.md): an all-reduce of the
    whole on v2/v3, and on v4 and later once the slice is beyond one host (more than 4 chips; 8 of the "lite" kinds,
    v5e/v6e). There it takes two stages, which the compiler keeps as reduce-scatters
    (zerolm.parallel.scatter.two_stage_reduce_scatter); the ring where dp is prime on v2/v3. The collective
    everywhere else (CPU, GPU, one v4+ host)."""
    if requested != "auto":
        return requested
    kind = mesh.devices.flat[0].device_kind
    generation = tpu_generation(kind)
    if generation is None:
        return "collective"
    old = generation in (2, 3)
    if not old and mesh.devices.size <= chips_per_host(kind):
        return "collective"
    if two_stage_inner(mesh) > 1:
        return "two_stage"
    return "ring" if old else "collective"
