"""`zerolm import-hf DIR --out CHECKPOINT`: a local transformers model directory (GPT-2, MPT, the Llama layout or
GPT-NeoX's; safetensors) as a zerolm checkpoint that `zerolm train --set train.init_from=CHECKPOINT` continues
from (zerolm.checkpoint.warm_start), and that `zerolm eval`, `sample` and `export-hf` read like any checkpoint.

DIR's `config.json` says the architecture (`model_type`) and the shape: `model_settings` turns it into zerolm's
model settings (GPT-2's layout, MPT's with ALiBi, Llama's with rotary positions, RMSNorm, SwiGLU and
grouped-query attention, or GPT-NeoX's with rotary positions over whole heads and the parallel residual block or
not). Every key of the file is checked against its layout's allow-list (zerolm.hf.config_keys):
one zerolm's model would not compute the same with (another activation, rotary scaling, biases where zerolm
has none, GPT-2's per-layer score scale, MPT's clipped queries), and one the list does not know, are refused in
one line naming the key. The weights (`model.safetensors`, or
the shards `model.safetensors.index.json` lists) are read through the same name tables the export writes by
(zerolm.hf.layouts), backwards. The tokenizer (`tokenizer.json`) is copied into CHECKPOINT: the run continuing
from it prepares its data with that file (`zerolm prepare --tokenizer CHECKPOINT/tokenizer.json`), and
evaluation and sampling find it there. The checkpoint is step 0, float32 parameters, a fresh optimizer state,
the run config `--config` with the imported model's settings. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zerolm.checkpoint.trained_model import TOKENIZER_BESIDE
from zerolm.config.load import parse_override
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.core.errors import ZerolmError
from zerolm.data.tokenizer import Tokenizer, TokenizerError, from_file
from zerolm.hf import config_keys as hf_keys
from zerolm.hf.layouts import GPT2, LLAMA, MPT, NEOX, Layout, zerolm_params
from zerolm.parallel import auto

TOKENIZER = TOKENIZER_BESIDE  # the imported tokenizer, in the checkpoint's directory


class HFImportError(ZerolmError):
    """A transformers directory zerolm cannot import exactly; one line naming the file and key."""


@dataclasses.dataclass(frozen=True)
class Imported:
    where: Any  # the step directory written
    architecture: str
    settings: dict[str, Any]  # the model settings read from config.json (model.<key>: value)
    tokenizer: Tokenizer


def model_settings(hf: dict, where: str) -> tuple[Layout, dict[str, Any]]:
    """(the layout, zerolm's model settings) of a transformers config.json; HFImportError, naming the key, for a
    key zerolm's model would not compute the same with, or one it does not know (zerolm.hf.config_keys)."""
    kind = hf.get("model_type")
    if kind not in hf_keys.TABLES:
        raise HFImportError(f"{where}: model_type: {kind!r}: zerolm imports gpt2, gpt_neox, llama and mpt")
    if refused := hf_keys.first_refused(hf, hf_keys.TABLES[kind]):
        key, value, what = refused
        shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:117] + "..."
        raise HFImportError(f"{where}: {key}: {shown}: " + (f"zerolm's {kind} layout computes {what}" if what else
                            f"a key zerolm's {kind} import does not know, so it cannot tell whether its model "
                            "would compute what transformers' does"))
    try:
        return _SETTINGS[kind](hf)
    except KeyError as e:
        raise HFImportError(f"{where}: no {e.args[0]} (zerolm takes the model's shape from config.json)") from None


SEQUENTIAL = {"parallel_residual": False, "shared_norm": False}  # GPT-2's, MPT's and Llama's block


def _gpt2(hf: dict) -> tuple[Layout, dict[str, Any]]:
    return GPT2, {"vocab_size": hf["vocab_size"], "n_layer": hf["n_layer"], "d_model": hf["n_embd"],
                  "n_head": hf["n_head"], "seq_len": hf["n_positions"], "position": "learned", "bias": True,
                  "norm": "layernorm", "norm_eps": hf.get("layer_norm_epsilon", 1e-5), "mlp": "gelu",
                  "activation": "gelu_tanh", "n_kv_head": "auto", "tie_embeddings": True, **SEQUENTIAL}


def _mpt(hf: dict) -> tuple[Layout, dict[str, Any]]:
    return MPT, {"vocab_size": hf["vocab_size"], "n_layer": hf["n_layers"], "d_model": hf["d_model"],
                 "n_head": hf["n_heads"], "seq_len": hf["max_seq_len"], "position": "alibi", "bias": False,
                 "norm": "layernorm", "norm_eps": hf.get("layer_norm_epsilon", 1e-5), "mlp": "gelu",
                 "activation": "gelu", "n_kv_head": "auto", "tie_embeddings": True, **SEQUENTIAL}


def _llama(hf: dict) -> tuple[Layout, dict[str, Any]]:
    heads = hf["num_attention_heads"]
    # transformers takes `rope_scaling` (older files' key) over `rope_parameters`, and its own rope_theta over
    # the top-level one
    rope = hf_keys.rope_of(hf)
    return LLAMA, {"vocab_size": hf["vocab_size"], "n_layer": hf["num_hidden_layers"], "d_model": hf["hidden_size"],
                   "n_head": heads, "seq_len": hf["max_position_embeddings"], "position": "rope",
                   "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), "bias": False,
                   "norm": "rmsnorm", "norm_eps": hf.get("rms_norm_eps", 1e-6), "mlp": "swiglu",
                   "mlp_hidden": hf["intermediate_size"], "n_kv_head": hf.get("num_key_value_heads") or heads,
                   "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), **SEQUENTIAL}


def _gpt_neox(hf: dict) -> tuple[Layout, dict[str, Any]]:
    # GPT-NeoX's LayerNorms and linears all have biases (attention_bias: true, config_keys), the norms one each
    theta = hf_keys.rope_of(hf).get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    return NEOX, {"vocab_size": hf["vocab_size"], "n_layer": hf["num_hidden_layers"], "d_model": hf["hidden_size"],
                  "n_head": hf["num_attention_heads"], "seq_len": hf["max_position_embeddings"], "position": "rope",
                  "rope_theta": float(theta), "bias": True, "norm": "layernorm", "norm_eps": hf.get("layer_norm_eps", 1e-5),
                  "mlp": "gelu", "mlp_hidden": hf["intermediate_size"],
                  "activation": "gelu" if hf.get("hidden_act", "gelu") == "gelu" else "gelu_tanh", "n_kv_head": "auto",
                  "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                  "parallel_residual": bool(hf.get("use_parallel_residual", True)), "shared_norm": False}


_SETTINGS = {"gpt2": _gpt2, "mpt": _mpt, "llama": _llama, "gpt_neox": _gpt_neox}
# Tensor names older transformers versions saved, as transformers 5 reads them (its conversion mapping).
_RENAMED = {"gpt_neox": {"embed_out.weight": "lm_head.weight"}}


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors (one file, or the shards its index lists), as float32."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        bin_only = " (it has PyTorch .bin weights: save them as safetensors with transformers' save_pretrained)" \
            if list(directory.glob("*.bin")) else ""
        raise HFImportError(f"{directory}: no model.safetensors or model.safetensors.index.json{bin_only}")
    tensors = {}
    for name in files:
        with safe_open(str(directory / name), framework="flax") as f:  # bfloat16 too (numpy has none)
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[key] = np.asarray(f.get_tensor(key), np.float32)
    return tensors


def _check_sets(sets: Sequence[str], imported: dict[str, Any], config: Path) -> None:
    """HFImportError for a `--set model.KEY=VALUE` that the import would override with another value."""
    for text in sets:
        key, value = parse_override(text)
        name = key.removeprefix("model.")
        if key.startswith("model.") and name in imported and value != imported[name]:
            grow = "; `zerolm grow` makes a deeper model from the imported one" if name == "n_layer" else ""
            raise HFImportError(f"--set {text}: the import takes model.{name} from {config} ({imported[name]!r}): "
                                f"leave it out{grow}")


def _tokenizer(directory: Path) -> Tokenizer:
    path = directory / TOKENIZER
    if not path.exists():
        raise HFImportError(f"{directory}: no {TOKENIZER} (a fast tokenizer's file; transformers writes one with "
                           "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
    try:
        return from_file(path)
    except TokenizerError as e:
        raise HFImportError(str(e)) from None


def import_hf(directory: Path, cfg: Config, out: str, overwrite: bool = False, say=lambda line: None,
              sets: Sequence[str] = ()) -> Imported:
    """Read the transformers directory, write the checkpoint of step 0 at `out` (local or gs://) with the
    tokenizer beside it; `cfg`: the run config its model goes into (its model's shape keys are the import's);
    `sets`: the `--set` overrides `cfg` was loaded with, none of which may set a model key the import takes."""
    from zerolm.checkpoint.warm_start import Origin, save_start

    target = storage.path(out)
    if target.exists() and not overwrite:
        raise HFImportError(f"--out: {out} already exists (pass --overwrite to move it aside and write anew)")
    config = directory / "config.json"
    try:
        hf = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFImportError(f"{config}: cannot read a transformers config ({e})") from None
    layout, settings = model_settings(hf, str(config))
    tokenizer = _tokenizer(directory)
    settings["eot_id"] = tokenizer.eot_id
    _check_sets(sets, {**settings, "mlp_hidden": settings.get("mlp_hidden", "auto")}, config)
    if tokenizer.vocab_size > settings["vocab_size"]:
        raise HFImportError(f"{directory / TOKENIZER}: {tokenizer.vocab_size} tokens, more than the model's "
                           f"vocab_size {settings['vocab_size']}")
    model = {**cfg.model.model_dump(), **settings, "mlp_hidden": settings.get("mlp_hidden", "auto")}
    cfg = cfg.with_values({"model": model, "checkpoint.dir": out})
    tensors = {_RENAMED.get(hf["model_type"], {}).get(k, k): v for k, v in read_tensors(directory).items()}
    params = zerolm_params(tensors, auto.for_shapes(cfg.model), layout)
    origin = Origin({"tokenizer_sha256": tokenizer.sha256, "tokenizer": tokenizer.identity,
                     "imported_from": str(directory.absolute())}, None, tokenizer=tokenizer.file_bytes)
    where = save_start(cfg, params, target, origin, say)
    return Imported(where, layout.architecture, {**settings, "mlp_hidden": model["mlp_hidden"]}, tokenizer)
