"""`zerolm grow`: a deeper model from a trained one, same width, written as a zerolm checkpoint that
`zerolm train --set train.init_from=DIR` starts from (zerolm.checkpoint.warm_start).

The layers' parameters are stacked on a leading `layers` axis (params["h"], zerolm.model.decoder), so growing is
indexing that axis with a layer map: layer j of the grown model is layer map[j] of the source. The
default map is Gopher's (Rae et al. 2021, appendix G.3.3): each source layer repeated in order, 4 -> 8
layers is 0,0,1,1,2,2,3,3; a depth that is not a multiple of the source's spreads the repeats as evenly as
possible (layer j is source layer floor(j * source / target)). `function_preserving`: every inserted copy
(each repeat after the first of a source layer) has its output projections (attn.c_proj and mlp.c_proj,
kernel and bias) zeroed, so its block adds nothing to the residual stream and the grown model computes
exactly the source model's function.

The source is read as `zerolm eval` reads one (zerolm.checkpoint.trained_model.load: any mesh and stage, local or gs://);
everything but the depth must be the same (every model setting except n_layer and those that only change
how the model computes). The checkpoint written holds step 0: the parameters, a fresh optimizer state
laid out for one device (a run on any mesh restores it), the bigger config (with the source's data
section), and the source's dataset identity and tokenizer (the file itself beside the checkpoint where the
source had it so: an import's), so `zerolm eval`, `sample` and `export-hf` read it like any checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from zerolm.checkpoint import trained_model as restored
from zerolm.checkpoint.compatible import parameter_differences
from zerolm.checkpoint.trained_model import TOKENIZER_BESIDE
from zerolm.checkpoint.warm_start import Origin, save_start
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.core.errors import ZerolmError

PROJECTIONS = (("attn", "c_proj"), ("mlp", "c_proj"))  # what a block adds to the residual stream, last


class GrowError(ZerolmError):
    """A growth that cannot be made (another width, vocabulary or position scheme, a bad layer map); one line."""


@dataclasses.dataclass(frozen=True)
class Growth:
    """What `zerolm grow` asks: the source checkpoint, the bigger config, where to write, how."""

    source: str  # a checkpoint: a run's directory (its newest intact step) or a step's, local or gs://
    cfg: Config  # the grown model's run config (its model.n_layer the new depth)
    out: str
    layer_map: Sequence[int] | None = None  # None: the default (Gopher's repeats)
    function_preserving: bool = False
    overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class Grown:
    where: Any  # the step directory written
    source: Any  # the source's step directory
    source_layers: int
    layer_map: tuple[int, ...]
    zeroed: tuple[int, ...]  # the grown layers whose output projections are zero
    cfg: Config  # the grown model's config, as written (its `auto` vocabulary resolved to the source's)
    data: dict  # the source's data section, which the checkpoint records: a run from it reads that data
    tokenizer: Any = None  # the tokenizer file written beside the checkpoint (the source had no dataset), or None


def default_map(source: int, target: int) -> list[int]:
    """Gopher's layer map: each source layer repeated in order, the repeats spread evenly over the source's
    layers where `target` is not a multiple of `source`."""
    return [j * source // target for j in range(target)]


def describe_map(layer_map: Sequence[int], source: int) -> str:
    """The map, and how often each source layer repeats when that is not the same for all (for the default map,
    why: the depth is not a multiple of the source's)."""
    counts = np.bincount(np.asarray(layer_map, dtype=np.int64), minlength=source)
    text = ",".join(map(str, layer_map))
    if len(set(counts.tolist())) > 1:
        by = {int(c): [str(i) for i in range(source) if counts[i] == c] for c in sorted(set(counts.tolist()), reverse=True)}
        copies = "; ".join(f"{c or 'no'} cop{'y' if c <= 1 else 'ies'} of layer{'s' if len(layers) > 1 else ''} "
                           f"{', '.join(layers)}" for c, layers in by.items())
        default = list(layer_map) == default_map(source, len(layer_map))
        text += (f" ({len(layer_map)} is not a multiple of {source}: the repeats spread as evenly as possible, "
                 f"{copies})" if default else f" ({copies})")
    return text


def parse_map(text: str) -> list[int]:
    """`--layer-map 0,0,1,1`: source layer numbers, comma-separated."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise GrowError(f"--layer-map: {text!r}: expected source layer numbers separated by commas, "
                        "e.g. 0,0,1,1") from None


def check_map(layer_map: Sequence[int] | None, source: int, target: int, function_preserving: bool) -> list[int]:
    """The layer map to grow by (the default where None), or GrowError saying why it cannot be."""
    if layer_map is None:
        if target < source:
            raise GrowError(f"model.n_layer: {target} is fewer than the source's {source} layers; grow makes a "
                            "model deeper (a --layer-map of that length says which layers to keep)")
        layer_map = default_map(source, target)
    layer_map = list(layer_map)
    if len(layer_map) != target:
        raise GrowError(f"--layer-map: {len(layer_map)} layers, but model.n_layer is {target}")
    if bad := [i for i in layer_map if not 0 <= i < source]:
        raise GrowError(f"--layer-map: names layer {bad[0]}; the source has layers 0-{source - 1}")
    first = list(dict.fromkeys(layer_map))  # each source layer's first copy, in the grown order
    if function_preserving and first != list(range(source)):
        missing = sorted(set(range(source)) - set(first))
        early = next((a for a in range(len(first)) if first[a] != a), 0)
        why = f"leaves out layer {missing[0]}" if missing else f"takes layer {first[early]} before layer {early}"
        raise GrowError(f"--function-preserving: the map {why}; each source layer's first copy must come in the "
                        "source's order, the repeats zeroed, for the grown model to compute the source's function")
    return layer_map


def check_models(source_model: dict, model: dict) -> None:
    """GrowError unless the two models differ only in depth (and in how they compute)."""
    differs = parameter_differences(source_model, model, besides=("n_layer",))
    if differs:
        key, saved, wanted = differs[0]
        raise GrowError(f"model.{key} is {saved!r} in the source and {wanted!r} in the config: grow changes the "
                        "depth (model.n_layer) alone")


def grown_params(params: Any, layer_map: Sequence[int], function_preserving: bool) -> tuple[Any, list[int]]:
    """The source's parameters (host arrays) with its stacked layers taken by `layer_map`, and the grown
    layers whose output projections were zeroed (`function_preserving`: every repeat after the first)."""
    index = np.asarray(layer_map)
    layers = jax.tree.map(lambda x: np.take(np.asarray(x), index, axis=0), params["h"])
    seen: set[int] = set()
    zeroed = []
    for j, i in enumerate(layer_map):
        if i in seen and function_preserving:
            zeroed.append(j)
        seen.add(i)
    for module, name in PROJECTIONS:
        for leaf in layers[module][name].values():  # the kernel, and the bias where the model has one
            leaf[zeroed] = 0
    return {**params, "h": layers}, zeroed


def grow(growth: Growth, say: Callable[[str], None] = lambda line: None) -> Grown:
    """Read the source, grow it, write the checkpoint of step 0 (GrowError if the growth is impossible)."""
    out = storage.path(growth.out)
    if out.exists() and not growth.overwrite:
        raise GrowError(f"--out: {growth.out} already exists (pass --overwrite to move it aside and write anew)")
    device = jax.local_devices()[:1]
    source = restored.load(growth.source, device)
    src_model = source.meta.model
    cfg = _resolved(growth.cfg, src_model, growth.out)
    check_models(src_model, cfg.model.model_dump())
    layer_map = check_map(growth.layer_map, src_model["n_layer"], cfg.model.n_layer, growth.function_preserving)
    params, zeroed = grown_params(jax.device_get(source.params), layer_map, growth.function_preserving)
    # A source no dataset was prepared for (an import, or a growth of one) has its tokenizer beside it: so has this.
    beside = source.tokenizer().file_bytes if source.meta.dataset_location is None else None
    where = save_start(cfg, params, out, Origin(source.meta.dataset, source.meta.dataset_location,
                                                source.config["data"], beside), say)
    return Grown(where, source.where, src_model["n_layer"], tuple(layer_map), tuple(zeroed), cfg,
                 source.config["data"], None if beside is None else where.parent / TOKENIZER_BESIDE)


def _resolved(cfg: Config, source_model: dict, out: str) -> Config:
    """The grown model's config laid out on one device (the checkpoint's layout; any run restores it), its
    `auto` vocabulary and end-of-text the source's."""
    updates: dict[str, Any] = {"mesh.dp": 1, "mesh.tp": 1, "checkpoint.dir": out}
    for key in ("vocab_size", "eot_id"):
        if getattr(cfg.model, key) == "auto":
            updates[f"model.{key}"] = source_model[key]
    if cfg.train.global_batch_size % cfg.train.micro_batch_size:
        updates["train.micro_batch_size"] = cfg.train.global_batch_size
    return cfg.with_values(updates)
