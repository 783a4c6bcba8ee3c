"""`zerolm grow --from CHECKPOINT --config BIGGER.yaml --out DIR`: a deeper model from a trained one, as a
checkpoint that `zerolm train --set train.init_from=DIR` starts from (zerolm.checkpoint.grow)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--from", dest="source", required=True, metavar="CHECKPOINT",
                        help="the trained model: a run's checkpoint directory (its newest intact step) or one step's "
                             "directory, local or gs://, of any mesh and ZeRO stage")
    parser.add_argument("--config", required=True, metavar="YAML",
                        help="the grown model's run config: the source's model but for model.n_layer")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; repeatable")
    parser.add_argument("--out", required=True, metavar="DIR", help="the checkpoint directory to write (local or gs://)")
    parser.add_argument("--layer-map", default=None, metavar="I,J,...",
                        help="the source layer each grown layer copies, e.g. 0,0,1,1 (default: each source layer "
                             "repeated in order, Gopher's growth, the repeats spread evenly)")
    parser.add_argument("--function-preserving", action="store_true",
                        help="zero the output projections of every inserted copy, so that the grown model computes "
                             "exactly the source's function")
    parser.add_argument("--overwrite", action="store_true", help="move an existing DIR aside and write anew")
    return parser


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout  # (read when it runs: a caller may have replaced sys.stdout since the import)
    from zerolm.core import platforms

    platforms.no_device_needed()  # on the host's CPU: it must not take a GPU or TPU that a run is using

    from zerolm.checkpoint.grow import Growth, describe_map, grow, parse_map
    from zerolm.config.load import load_config
    from zerolm.core.storage import check

    check(args.source, "--from")
    check(args.out, "--out")
    cfg = load_config(args.config, args.set)
    layer_map = parse_map(args.layer_map) if args.layer_map is not None else None
    grown = grow(Growth(args.source, cfg, args.out, layer_map, args.function_preserving, args.overwrite),
                 say=lambda line: print(line, file=out, flush=True))
    print(f"grew {grown.source} ({grown.source_layers} layers) to {grown.where} ({len(grown.layer_map)} layers) by "
          f"the layer map {describe_map(grown.layer_map, grown.source_layers)}", file=out)
    if args.function_preserving:
        print(f"function-preserving: the output projections of layers {', '.join(map(str, grown.zeroed)) or 'none'} "
              "are zero, so the grown model computes the source's function", file=out)
    if grown.tokenizer is not None:
        print(f"prepare data with its tokenizer: zerolm prepare --source ... --tokenizer {grown.tokenizer} --seq-len "
              f"{grown.cfg.model.seq_len} --out DATA", file=out)
    sets = "".join(f" --set {shlex.quote(s)}" for s in [*args.set, *_start_sets(cfg, grown)])
    print(f"start a run from it: zerolm train --config {args.config}{sets} --set train.init_from={args.out}", file=out)
    return 0


def _start_sets(cfg, grown) -> list[str]:
    """What a run from the grown checkpoint needs beyond the config and the user's --set: the source's data (the
    data section the checkpoint records, or DATA prepared with the tokenizer beside it), and the vocabulary where
    the config leaves it auto (an imported model's may be larger than its tokenizer's)."""
    if grown.tokenizer is not None:
        sets = ["data.dataset=DATA"]
    else:
        mine = cfg.data.model_dump()
        sets = [f"data.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in grown.data.items() if mine.get(k) != v]
    if cfg.model.vocab_size == "auto":
        sets.append(f"model.vocab_size={grown.cfg.model.vocab_size}")
    return sets
