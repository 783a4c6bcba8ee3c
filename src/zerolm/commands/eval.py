"""`zerolm eval --checkpoint DIR`: the held-out loss and perplexity of a checkpoint (zerolm.evaluate)."""

from __future__ import annotations

import argparse
import json
import sys

from zerolm.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (its newest intact step) or one step's directory")
    parser.add_argument("--data", default=None, metavar="DATASET",
                        help="a prepared dataset (directory or URL) with the model's tokenizer and seq_len "
                             "(default: the run's own dataset)")
    parser.add_argument("--split", default="val", choices=["val", "train"], help="(default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=None, metavar="N",
                        help="the split's first N sequences (default: the run's train.eval_sequences; fewer if "
                             "the split has fewer)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help="evaluate at a context of N tokens (default: the trained model.seq_len); past it only "
                             "for ALiBi models (model.position: alibi): each sequence joins consecutive samples")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    return parser


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    from zerolm import restored
    from zerolm.evaluate import evaluate_checkpoint
    from zerolm.storage import check

    if args.sequences is not None and args.sequences <= 0:
        raise UsageError(f"--sequences: {args.sequences} must be > 0")
    if args.seq_len is not None and args.seq_len <= 0:
        raise UsageError(f"--seq-len: {args.seq_len} must be > 0")
    check(args.checkpoint, "--checkpoint")
    if args.data:
        check(args.data, "--data", read_only=True)
    model_run = restored.load(args.checkpoint)
    result = evaluate_checkpoint(model_run, args.data, args.split, args.sequences, args.seq_len)
    if args.json:
        print(json.dumps(result), file=out)
    else:
        print(f"step {result['step']} of {result['checkpoint']}: {args.split} loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f} on {result['sequences']} sequences of {result['seq_len']} tokens "
              f"({result['tokens']:,} tokens) of "
              f"{result['dataset']}", file=out)
    return 0
