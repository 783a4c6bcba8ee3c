"""`zerolm import-hf DIR --out CHECKPOINT`: a local transformers model directory (GPT-2, MPT, Llama layout,
GPT-NeoX; safetensors) as a zerolm checkpoint that `zerolm train --set train.init_from=CHECKPOINT` continues from
(zerolm.hf.importer)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("directory", metavar="DIR",
                        help="a local transformers model directory: config.json, model.safetensors (or its shards "
                             "and index), tokenizer.json")
    parser.add_argument("--out", required=True, metavar="CHECKPOINT",
                        help="the checkpoint directory to write (local or gs://)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="the run config the model goes into; its model's shape and layout are the import's "
                             "(default: zerolm's configs/defaults.yaml, shipped with the package)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key (not one of the model's keys the import takes); repeatable")
    parser.add_argument("--overwrite", action="store_true", help="move an existing CHECKPOINT aside and write anew")
    return parser


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout  # (read when it runs: a caller may have replaced sys.stdout since the import)
    from zerolm.core import platforms

    platforms.no_device_needed()  # on the host's CPU: it must not take a GPU or TPU that a run is using

    from pathlib import Path

    from zerolm.config.load import DEFAULTS, load_config
    from zerolm.core.errors import UsageError
    from zerolm.core.storage import check
    from zerolm.hf.importer import TOKENIZER, import_hf

    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"DIR: {directory} is not a directory (a transformers model directory, local)")
    check(args.out, "--out")
    config = args.config or str(DEFAULTS)
    cfg = load_config(config, args.set)
    done = import_hf(directory, cfg, args.out, args.overwrite, say=lambda line: print(line, file=out, flush=True),
                     sets=args.set)
    print(f"imported {done.architecture} from {directory} to {done.where} (step 0, float32, a fresh optimizer state); "
          f"its tokenizer: {done.where.parent / TOKENIZER}", file=out)
    sets = "".join(f" --set model.{k}={v if isinstance(v, str) else json.dumps(v)}"
                   for k, v in _differing(cfg.model, done).items())
    print(f"prepare data with its tokenizer: zerolm prepare --source ... --tokenizer {done.where.parent / TOKENIZER} "
          f"--seq-len {done.settings['seq_len']} --out DATA", file=out)
    print(f"continue it: zerolm train --config {config}{''.join(f' --set {shlex.quote(s)}' for s in args.set)}{sets} "
          f"--set data.dataset=DATA --set train.init_from={args.out}", file=out)
    return 0


def _differing(model, done) -> dict[str, Any]:
    """The imported model's settings that the config's model (resolved, `auto` as a run resolves it with the
    imported tokenizer) does not already have."""
    from zerolm.config.model import resolved_shape

    as_imported = resolved_shape({**model.model_dump(), **{k: done.settings[k] for k in ("mlp", "d_model", "n_head")}})
    resolved = {"mlp_hidden": as_imported["mlp_hidden"], "n_kv_head": resolved_shape(model.model_dump())["n_kv_head"],
                "eot_id": done.tokenizer.eot_id if model.eot_id == "auto" else model.eot_id,
                "vocab_size": done.tokenizer.vocab_size if model.vocab_size == "auto" else model.vocab_size}
    imported = {**done.settings, "n_kv_head": done.settings["n_kv_head"] if done.settings["n_kv_head"] != "auto"
                else done.settings["n_head"]}
    return {k: v for k, v in imported.items() if resolved.get(k, getattr(model, k)) != v}
