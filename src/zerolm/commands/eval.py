"""`zerolm eval --checkpoint DIR`: the held-out loss and perplexity of a checkpoint (zerolm.eval.heldout); with
`--tasks a,b`, downstream tasks through lm-evaluation-harness instead (zerolm.eval.downstream), their table printed
and their results written beside the checkpoint as lm-eval-step<N>.json (a later evaluation of the same step
as lm-eval-step<N>-2.json, -3, ...: none replaces another)."""

from __future__ import annotations

import argparse
import json
import sys

from zerolm.core.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (its newest intact step) or one step's directory")
    parser.add_argument("--data", default=None, metavar="DATASET",
                        help="a prepared dataset (directory or URL) with the model's tokenizer and seq_len "
                             "(default: the run's own dataset)")
    parser.add_argument("--split", default="val", choices=["val", "train"], help="(default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=None, metavar="N",
                        help="the split's first N sequences (default: the run's train.eval_sequences, or "
                             "configs/defaults.yaml's if the run's is 0; fewer if the split has fewer)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help="evaluate at a context of N tokens (default: the trained model.seq_len); past it only "
                             "for ALiBi and rotary positions (model.position alibi or rope; a learned position table "
                             "ends there): each sequence joins consecutive samples")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence (with "
                        "--tasks: instead of the table)")
    tasks = parser.add_argument_group("downstream tasks (lm-evaluation-harness: pip install 'zerolm[eval]')")
    tasks.add_argument("--tasks", default=None, metavar="A,B",
                       help="the harness's tasks instead of the held-out loss: zerolm's own (zerolm_cloze, zerolm_choice, "
                            "zerolm_text), the harness's (lambada_openai, piqa, hellaswag, wikitext, ...), or yours")
    tasks.add_argument("--include-path", default=None, metavar="DIR", help="a directory of your own task definitions "
                       "(the harness's --include_path)")
    tasks.add_argument("--limit", type=int, default=None, metavar="N", help="each task's first N documents")
    tasks.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help="requests per batch, rounded up to a multiple of the devices (default: 8)")
    tasks.add_argument("--download", action="store_true",
                       help="let the harness download task data (a machine with internet); otherwise it runs offline")
    return parser


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout  # (read when it runs: a caller may have replaced sys.stdout since the import)
    from zerolm.checkpoint import trained_model as restored
    from zerolm.core.storage import check
    from zerolm.eval.heldout import evaluate_checkpoint

    if args.tasks is not None:
        return run_tasks(args, out)
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


def run_tasks(args: argparse.Namespace, out=sys.stdout) -> int:
    """The harness's tasks on the checkpoint: the table printed (--json: one object of the numbers), the
    results JSON written beside it."""
    from zerolm.core.storage import check
    from zerolm.data import contamination
    from zerolm.eval import downstream

    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value <= 0:
            raise UsageError(f"{flag}: {value} must be > 0")
    check(args.checkpoint, "--checkpoint")
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    # before the model: an unknown task or missing data in seconds
    manager = downstream.prepare(names, args.include_path, args.download)

    from zerolm.eval.harness import ZerolmLM, load_checkpoint

    loaded = load_checkpoint(args.checkpoint)
    dirty = {name: t for name, t in contamination.dirty_fractions(loaded.data).items() if name in names}
    results = downstream.evaluate(ZerolmLM(loaded=loaded, batch_size=args.batch_size), names, manager, args.limit,
                                  log_samples=bool(dirty))
    clean = contamination.clean_scores(results.pop("samples", {}), dirty)
    measured = {name: {**{k: v for k, v in t.items() if k != "dirty_documents"}, "clean": clean.get(name, {})}
                for name, t in dirty.items()}
    if measured:
        results["contamination"] = measured
    where = write_results(results, loaded.checkpoints, loaded.step)
    if args.json:
        print(json.dumps({"checkpoint": loaded.checkpoints, "step": loaded.step, "results": str(where),
                          **downstream.metrics(results), **({"contamination": measured} if measured else {})}),
              file=out)
    else:
        print(downstream.table(results), file=out)
        if measured:
            print("contamination (zerolm contamination, against the run's training data):", file=out)
            print("\n".join(contamination.describe_dirty(dirty, clean)), file=out)
        print(f"results: {where}", file=out)
    return 0


def write_results(results: dict, checkpoints: str, step: int):
    """The harness's results as JSON in the checkpoint's directory (local or gs://): lm-eval-step<N>.json, or
    if an earlier evaluation of the step wrote that, the first of lm-eval-step<N>-2.json, -3, ... that none
    did (each created only if absent, so two evaluations at once take two names)."""
    import itertools

    import jax

    from zerolm.core.storage import create_once, path

    data = json.dumps(results, indent=2, default=str) + "\n"
    for name in itertools.chain([f"lm-eval-step{step}.json"], (f"lm-eval-step{step}-{n}.json" for n in itertools.count(2))):
        target = path(checkpoints) / name
        if jax.process_index() != 0 or create_once(target, data) == data.encode():
            return target
    raise AssertionError("unreachable: the names never end")
