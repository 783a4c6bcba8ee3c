"""`zerolm prepare --source SRC --out DIR`: tokenize raw text into training shards (zerolm.data.prepare)."""

from __future__ import annotations

import argparse
import os
import sys

from zerolm.core.exitcodes import EXIT_INTERRUPTED
from zerolm.data.packing import UNIT_MB
from zerolm.data.prepare import BPE_SAMPLE_MB, missing_units, prepare_part


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True,
                   help="text:GLOB, jsonl:GLOB, parquet:GLOB (local or gs://; .gz and .zst text and jsonl are "
                        "decompressed), tfds:NAME[:SPLIT] or default")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default="default",
                   help="default (BPE trained on the source), a tokenizer.json, or a tiktoken BPE file (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=2048, help="size of the default BPE (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample, plus one (default: %(default)s)")
    p.add_argument("--text-field", default="text",
                   help="JSON field, parquet column or TFDS feature holding the text (default: %(default)s)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="processes that parse and tokenize; the output is the same whatever their number "
                        "(default: this machine's cores, %(default)s)")
    p.add_argument("--bpe-sample-mb", type=int, default=BPE_SAMPLE_MB,
                   help="the default BPE trains on at most this many MiB of text, spread over the files "
                        "(default: %(default)s)")
    p.add_argument("--tfds-data-dir", default=None, help="local TFDS data_dir (read offline)")
    p.add_argument("--val-every", type=int, default=50,
                   help="every Nth document (of each unit) is validation (default: %(default)s)")
    p.add_argument("--samples-per-shard", type=int, default=4096, help="samples per tar shard (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--skip-bad", action="store_true", help="count and skip bad records instead of stopping")
    p.add_argument("--unit-mb", type=int, default=UNIT_MB,
                   help="input files are packed in units of about this many MiB as stored, each on its own (the "
                        "work --part shares out; default: %(default)s)")
    p.add_argument("--decontaminate", default=None, metavar="A,B",
                   help="leave out every training document that shares a 13-gram with these tasks' documents "
                        "(zerolm contamination's measure; validation is untouched); the manifest records them")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="a directory of your own task definitions, for --decontaminate")
    p.add_argument("--part", type=_part, metavar="I/N",
                   help="prepare part I of N (one per host) into the same --out, which every part must reach "
                        "(gs://); the part that completes the last one publishes the dataset, the same one a "
                        "single prepare makes. Run a part again after a failure: it packs only what is missing")


def _part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit()) or not 1 <= int(i) <= int(n):
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 1 <= I <= N, e.g. 1/4")
    return int(i), int(n)


def run(args: argparse.Namespace) -> int:
    decontaminate = None
    if args.include_path is not None and args.decontaminate is None:
        from zerolm.core.errors import UsageError

        raise UsageError(f"--include-path: {args.include_path}: task definitions are for --decontaminate, which is not "
                         "given")
    if args.decontaminate is not None:
        from zerolm.eval.downstream import Keys
        from zerolm.eval.task_texts import task_ngrams

        names = [name.strip() for name in args.decontaminate.split(",") if name.strip()]
        decontaminate = task_ngrams(names, 13, args.include_path, keys=Keys(tasks="--decontaminate"))
    try:
        manifest, published = prepare_part(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                seq_len=args.seq_len, text_field=args.text_field, tfds_data_dir=args.tfds_data_dir,
                                val_every=args.val_every, samples_per_shard=args.samples_per_shard,
                                overwrite=args.overwrite, skip_bad=args.skip_bad, workers=args.workers,
                                bpe_sample_mb=args.bpe_sample_mb, part=args.part,
                                unit_mb=args.unit_mb, decontaminate=decontaminate)
    except KeyboardInterrupt:
        what = "the unit it was packing was removed; run the part again to finish" if args.part else \
            "the partial output was removed"
        print(f"prepare: interrupted; {args.out} is unchanged and {what}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if manifest is None:
        i, n = args.part
        missing = missing_units(args.out, n)
        print(f"prepared part {i}/{n} of {args.out}; {len(missing)} unit(s) still to pack by other parts: "
              f"unit {', '.join(map(str, missing))} (the part that packs the last of them publishes the dataset)")
        return 0
    t, v = manifest.splits["train"], manifest.splits["val"]
    by = ""
    if args.part:
        by = (f" (part {args.part[0]}/{args.part[1]} published it)" if published else
              " (already published by an earlier run of a part: nothing changed)")
    print(f"prepared {args.out}{by}: train {t.samples} samples in {len(t.shards)} shard(s), "
          f"val {v.samples} samples; {t.tokens + v.tokens:,} tokens of {manifest.dtype}, "
          f"tokenizer {manifest.tokenizer.name} ({manifest.tokenizer.vocab_size} tokens)"
          + (f"; skipped {manifest.skipped} bad record(s), first: {manifest.skipped_first}" if manifest.skipped else "")
          + (f"; validation: {manifest.val_rule}" if not manifest.val_rule.startswith("every") else "")
          + (f"; left out {d.documents} training document(s) sharing a {d.ngram}-gram with {', '.join(d.tasks)}"
             if (d := manifest.decontamination) else ""))
    return 0
