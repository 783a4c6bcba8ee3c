"""`zerolm contamination --dataset D --tasks A,B`: how much of each task a prepared dataset's training split
holds, by GPT-3's n-gram overlap (zerolm.data.contamination); its table printed, its JSON written beside the
dataset (--json: printed too)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from zerolm.core.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset", metavar="DATASET", help="a prepared dataset (directory or gs:// URL)")
    data.add_argument("--config", metavar="YAML", help="a run's config: its data.dataset, or each dataset of its "
                      "data.mixture")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a key of --config")
    parser.add_argument("--tasks", required=True, metavar="A,B",
                        help="the harness's tasks to look for: zerolm's own, the harness's, or yours")
    parser.add_argument("--include-path", default=None, metavar="DIR", help="a directory of your own task definitions")
    parser.add_argument("--download", action="store_true",
                        help="let the harness download task data (a machine with internet); otherwise it runs offline")
    parser.add_argument("--ngram", type=int, default=13, metavar="N", help="words per n-gram (default: %(default)s, GPT-3's)")
    parser.add_argument("--part", type=_part, metavar="I/N",
                        help="scan part I of N (one per host; every part reaches the dataset): each writes what it "
                             "found beside the dataset, and the part that finds all N there writes the result")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes that read and look through the shards (default: this machine's cores, "
                             "%(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print the result's JSON instead of the table (with --part, while other parts are still "
                             "to run: the part scanned and `parts_to_run`)")
    return parser


def _part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit()) or int(n) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 1 <= I <= N, e.g. 1/4")
    return int(i), int(n)


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    from zerolm.data import contamination
    from zerolm.eval.task_texts import task_ngrams

    if args.ngram < 1:
        raise UsageError(f"--ngram: {args.ngram} must be a positive number of words")
    if args.workers < 1:
        raise UsageError(f"--workers: {args.workers} must be at least 1")
    if args.part is not None:
        contamination.check_part(args.part)
    locations = _locations(args)
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    ngrams = task_ngrams(names, args.ngram, args.include_path, download=args.download)
    results = {}
    for location in locations:
        result, missing = contamination.measure(location, ngrams, args.part, args.workers)
        if result is None:  # this part's tally is written; others are still to come
            i, n = args.part
            results[location] = {"dataset": location, "ngram": args.ngram, "part": f"{i}/{n}", "parts_to_run": missing}
            if not args.json:
                print(f"scanned part {i}/{n} of {location}; part(s) {', '.join(map(str, missing))} still to run (the "
                      "part that finds all of them written merges them)", file=out)
            continue
        scanned = [name for name, _ in ngrams.groups]  # (a group's tasks, where a group was named)
        results[location] = {**result, "tasks": {name: result["tasks"][name] for name in scanned}}
        if not args.json:
            print("\n".join(describe(results[location])), file=out)
    if args.json:  # a dataset's result, or what its part did while other parts are still to run
        print(json.dumps(results[locations[0]] if len(locations) == 1 else
                         {"ngram": args.ngram, "datasets": results}, indent=1), file=out)
    return 0


def _locations(args: argparse.Namespace) -> list[str]:
    """The datasets to scan: --dataset, or the run's (each of its mixture's), checked there."""
    from zerolm.core.storage import check
    from zerolm.data.shards import DataError, PreparedDataset

    if args.dataset is not None:
        check(args.dataset, "--dataset", read_only=True)
        try:
            PreparedDataset(args.dataset)
        except DataError as e:
            raise UsageError(f"--dataset: {e}") from None
        return [args.dataset]
    from zerolm.config.load import load_config
    from zerolm.data.dataset import open_dataset
    from zerolm.data.mixture import Mixture

    dataset = open_dataset(load_config(args.config, args.set))
    return [d.location for d in dataset.datasets] if isinstance(dataset, Mixture) else [dataset.location]


def describe(result: dict) -> list[str]:
    """The result as a table: a row per task, then its example matches."""
    training = result["training"]
    lines = [f"{result['dataset']}: {training['documents']:,} training documents ({training['tokens']:,} tokens), "
             f"{training['dirty_documents']:,} holding a task {result['ngram']}-gram",
             "", "| task | documents | dirty | dirty fraction |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {t['documents']} | {t['dirty']} | {t['dirty_fraction']:.1%} |"
              for name, t in result["tasks"].items()]
    for name, t in result["tasks"].items():
        for example in t["examples"]:
            lines.append(f"  {name} document {example['document']}: \"{example['ngram']}\" in {example['where']}")
    where = f"{result['dataset'].rstrip('/')}/contamination/{result['ngram']}gram.json"
    return [*lines, f"result: {where}"]
