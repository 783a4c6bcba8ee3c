"""`zerolm contamination` at corpus size: tokens per second per core, and peak memory, against the corpus' size.

    python -m benchmarks.measure.contamination --sizes-mb 32 128 512 [--dir /tmp/contamination_bench] [--workers N]
                                       [--write BENCHMARKS.md]

1. Generates a corpus of each size (once, kept in --dir): jsonl files of documents of 50 to 2,000 words
   drawn (Zipf, seeded) from the embedded corpus' vocabulary, most frequent first, so that the shipped
   tasks' words are common in it and most windows of words are hashed and looked up (a corpus of other
   words would be rejected word by word, faster), and prepares each (seq_len 2048, the default BPE).
2. Scans each as a user runs it: `zerolm contamination --dataset D --tasks zerolm_cloze,zerolm_choice,
   zerolm_text --workers N`, in a subprocess whose process tree's resident memory (the parent and its
   workers, summed) is sampled every 0.1 s. Tokens: the training split's, as the result counts them;
   tokens per second per core: over the wall time of the whole command (its start, the tasks loaded, the
   workers started included) divided by the workers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.lib.markdown import write_block
from benchmarks.lib.processes import peak_rss

BEGIN, END = "<!-- contamination:begin -->", "<!-- contamination:end -->"
TASKS = "zerolm_cloze,zerolm_choice,zerolm_text"
FILE_BYTES = 64 << 20


def generate(directory: Path, size_mb: int) -> Path:
    """jsonl files holding `size_mb` MiB, made once."""
    done = directory / "done"
    if done.exists():
        return directory
    from zerolm.data.corpus import default_documents

    directory.mkdir(parents=True, exist_ok=True)
    counts = collections.Counter(w for doc in default_documents() for w in doc.split())
    vocab = np.array([w for w, _ in counts.most_common()])
    rng = np.random.default_rng(0)
    total, index = size_mb << 20, 0
    while total > 0:
        lines, size = [], 0
        while size < min(FILE_BYTES, total):
            words = vocab[np.minimum(rng.zipf(1.2, int(rng.integers(50, 2000))), len(vocab)) - 1]
            line = json.dumps({"text": " ".join(words)}) + "\n"
            lines.append(line)
            size += len(line)
        (directory / f"part-{index:05d}.jsonl").write_text("".join(lines))
        total -= size
        index += 1
    done.write_text("")
    return directory


def prepared(corpus: Path, out: Path) -> Path:
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{corpus}/*.jsonl",
                        "--out", str(out), "--seq-len", "2048", "--vocab-size", "8192"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def scan(dataset: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "zerolm.cli", "contamination", "--dataset", str(dataset), "--tasks", TASKS,
           "--workers", str(workers), "--json"]
    peak, seconds, out = peak_rss(cmd)
    result = json.loads(out)
    tokens = result["training"]["tokens"]
    return {"tokens": tokens, "seconds": seconds, "per_core": tokens / seconds / workers, "peak": peak,
            "dirty": {name: t["dirty"] for name, t in result["tasks"].items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--dir", type=Path, default=Path("/tmp/contamination_bench"))
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--write", type=Path, default=None, help="put the table into this markdown file")
    args = p.parse_args()
    rows = []
    for size in args.sizes_mb:
        dataset = prepared(generate(args.dir / f"corpus-{size}mb", size), args.dir / f"prepared-{size}mb")
        r = scan(dataset, args.workers)
        print(json.dumps({"size_mb": size, **r}), flush=True)
        rows.append(f"| {size} MiB | {r['tokens']:,} | {args.workers} | {r['seconds']:.1f} s | {r['per_core']:,.0f} | "
                    f"{r['peak'] / 2**20:,.0f} MiB |")
    lines = ["| corpus (jsonl) | training tokens | workers | wall | tokens/s per core | peak RSS, process tree |",
             "|---:|---:|---:|---:|---:|---:|", *rows]
    print("\n".join(lines))
    if args.write:
        write_block(args.write, BEGIN, END, lines)


if __name__ == "__main__":
    main()
