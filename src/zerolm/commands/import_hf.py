"""`zerolm import-hf DIR --out CHECKPOINT`: a local transformers model directory (GPT-2, MPT, Llama layout;
safetensors) as a zerolm checkpoint that `zerolm train --set train.init_from=CHECKPOINT` continues from
(zerolm.import_hf)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("directory", metavar="DIR",
                        help="a local transformers model directory: config.json, model.safetensors (or its shards "
                             "and index), tokenizer.json")
    parser.add_argument("--out", required=True, metavar="CHECKPOINT",
                        help="the checkpoint directory to write (local or gs://)")
    parser.add_argument("--config", default="configs/defaults.yaml", metavar="YAML",
                        help="the run config the model goes into; its model's shape and layout are the import's "
                             "(default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; repeatable")
    parser.add_argument("--overwrite", action="store_true", help="move an existing CHECKPOINT aside and write anew")
    return parser


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    from zerolm import platforms

    platforms.no_device_needed()  # on the host's CPU: it must not take a GPU or TPU that a run is using

    from pathlib import Path

    from zerolm.config import load_config
    from zerolm.errors import UsageError
    from zerolm.import_hf import TOKENIZER, import_hf
    from zerolm.storage import check

    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"DIR: {directory} is not a directory (a transformers model directory, local)")
    check(args.out, "--out")
    cfg = load_config(args.config, args.set)
    done = import_hf(directory, cfg, args.out, args.overwrite, say=lambda line: print(line, file=out, flush=True))
    print(f"imported {done.architecture} from {directory} to {done.where} (step 0, float32, a fresh optimizer state); "
          f"its tokenizer: {done.where.parent / TOKENIZER}", file=out)
    sets = "".join(f" --set model.{k}={v}" for k, v in done.settings.items())
    print(f"prepare data with its tokenizer: zerolm prepare --source ... --tokenizer {done.where.parent / TOKENIZER} "
          f"--seq-len {cfg.model.seq_len} --out DATA", file=out)
    print(f"continue it: zerolm train --config {args.config}{''.join(f' --set {s}' for s in args.set)}{sets} "
          f"--set data.dataset=DATA --set train.init_from={args.out}", file=out)
    return 0
