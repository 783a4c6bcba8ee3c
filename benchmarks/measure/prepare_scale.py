"""`zerolm prepare` at corpus size: peak memory against the corpus' size, and speed against the tokenizer.

    python -m benchmarks.measure.prepare_scale --sizes-gb 1 4 [--dir /tmp/prepare_scale] [--workers N] [--write BENCHMARKS.md]

1. Generates a corpus of each size (once, kept in --dir): jsonl.zst files of 128 MiB (uncompressed)
   each, documents of Zipf-distributed words (a 30,000-word vocabulary, 50 to 2,000 words each),
   seeded, so every run sees the same text.
2. Memory: `zerolm prepare` of each corpus as a user runs it (the default BPE, trained on its bounded
   sample; --workers all cores), in a subprocess whose process tree's resident memory (the parent
   and its workers, summed) is sampled every 0.1 s: the peak, per corpus.
3. Parts (--parts N): the smallest corpus converted to parquet (once; row groups of 1,024 documents),
   prepared by one process and by N processes at once (`--part I/N`, --workers 1 each: the "hosts"),
   both in units of 64 MiB, with the tokenizer step 2 trained: wall time each, and whether the two
   datasets are the same, file by file.
4. Speed, on the smallest corpus with the tokenizer that step 2 trained on it (so no BPE training is
   timed): prepare's tokens per second, end to end (read, decompress, parse, tokenize, pack, write),
   against the tokenizer's own batch encoding (`Tokenizer.encode_batch`, the Rust library's threads on
   every core) of the same documents, already in memory, in batches of 1,024: the limit. Both in this
   one run, on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block
from benchmarks.lib.processes import peak_rss

FILE_BYTES = 128 << 20
BEGIN, END = "<!-- prepare_scale:begin -->", "<!-- prepare_scale:end -->"


def generate(directory: Path, size_gb: float) -> Path:
    """jsonl.zst files holding `size_gb` GiB of jsonl (uncompressed), made once."""
    done = directory / "done"
    if done.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = np.array(["".join(rng.choice(letters, int(n))) for n in rng.integers(1, 12, 30_000)])
    total, index = int(size_gb * 2**30), 0
    while total > 0:
        lines, size = [], 0
        while size < min(FILE_BYTES, total):
            n = int(rng.integers(50, 2000))
            words = vocab[np.minimum(rng.zipf(1.2, n), len(vocab)) - 1]
            line = json.dumps({"text": " ".join(words)}) + "\n"
            lines.append(line)
            size += len(line)
        (directory / f"part-{index:05d}.jsonl.zst").write_bytes(
            zstandard.ZstdCompressor(level=3, threads=-1).compress("".join(lines).encode()))
        total -= size
        index += 1
    done.write_text("")
    return directory


def prepare_cmd(corpus: Path, out: Path, workers: int, tokenizer: str = "default") -> list[str]:
    return [sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{corpus}/*.jsonl.zst", "--out",
            str(out), "--seq-len", "2048", "--vocab-size", "8192", "--workers", str(workers), "--tokenizer", tokenizer,
            "--overwrite"]


def to_parquet(corpus: Path, directory: Path) -> Path:
    """The corpus's documents as parquet files (one per jsonl.zst file), made once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zerolm.data import sources

    if (directory / "done").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(corpus.glob("*.jsonl.zst")):
        docs = list(sources.iter_documents(f"jsonl:{path}"))
        pq.write_table(pa.table({"text": docs}), directory / path.name.replace(".jsonl.zst", ".parquet"),
                       row_group_size=1024)
    (directory / "done").write_text("")
    return directory


def files_sha256(directory: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "unit.json",
                                                                                   "settings.json")}


def parts_run(corpus: Path, tokenizer: Path, out: Path, parts: int) -> dict:
    """One prepare and `parts` at once of the parquet corpus: (seconds each, identical)."""
    common = ["--source", f"parquet:{corpus}/*.parquet", "--seq-len", "2048", "--tokenizer", str(tokenizer),
              "--unit-mb", "64", "--overwrite"]
    base = [sys.executable, "-m", "zerolm.cli", "prepare", *common]
    start = time.perf_counter()
    subprocess.run([*base, "--out", str(out / "one"), "--workers", str(parts)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    one_s = time.perf_counter() - start
    import shutil

    shutil.rmtree(out / "parts", ignore_errors=True)
    start = time.perf_counter()
    procs = [subprocess.Popen([*base, "--out", str(out / "parts"), "--workers", "1", "--part", f"{i}/{parts}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(1, parts + 1)]
    if any(p.wait() for p in procs):
        raise SystemExit("a part failed")
    parts_s = time.perf_counter() - start
    units = json.loads((out / "one" / "manifest.json").read_text())["units"]
    same = files_sha256(out / "one") == files_sha256(out / "parts" / f"parts-of-{parts}")
    return {"units": len(units), "one_s": one_s, "parts_s": parts_s, "identical": same}


def train_briefly(dataset: Path, run: Path) -> float:
    """A one-layer model trained 4 steps on `dataset` (seq_len 2048): the last training loss."""
    import shutil

    shutil.rmtree(run, ignore_errors=True)
    sets = [f"data.dataset={dataset}", "model.seq_len=2048", "model.n_layer=1", "model.d_model=64", "model.n_head=2",
            "model.vocab_size=auto", "train.steps=4", "train.warmup_steps=1", "train.global_batch_size=4",
            "train.micro_batch_size=1", "train.eval_sequences=0", "sample.tokens=0", f"checkpoint.dir={run / 'ckpt'}",
            f"logging.dir={run / 'log'}", "logging.wandb=disabled"]
    subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
                    *[a for s in sets for a in ("--set", s)]], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    metrics = [json.loads(line) for line in (run / "log" / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in metrics if "loss" in m][-1]


def tokenizer_alone(corpus: Path, tokenizer: Path) -> tuple[int, float]:
    """(tokens, seconds) of the tokenizer's own batch encoding of the corpus' documents, in memory."""
    from zerolm.data import sources
    from zerolm.data.tokenizer import from_file

    docs = list(sources.iter_documents(f"jsonl:{corpus}/*.jsonl.zst"))
    tok = from_file(tokenizer)
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(docs), 1024):
        tokens += sum(len(ids) + 1 for ids in tok.encode_batch(docs[i:i + 1024]))  # + end-of-text, as prepare
    return tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 4])
    p.add_argument("--dir", type=Path, default=Path("/tmp/prepare_scale"))
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--parts", type=int, default=2, help="processes preparing the parquet corpus at once (0: skip)")
    p.add_argument("--only-parts", action="store_true",
                   help="step 3 alone (the corpus and tokenizer of an earlier run of steps 1-2)")
    p.add_argument("--parts-gb", type=float, help="the corpus step 3 converts and prepares (default: the smallest)")
    p.add_argument("--write", type=Path, help="put the table into this markdown file between its markers")
    args = p.parse_args()
    rows, lines = [], []
    if args.only_parts:
        size = args.parts_gb or min(args.sizes_gb)
        corpus = generate(args.dir / f"corpus-{size:g}g", size)
        tok_file = args.dir / f"prepared-{size:g}g" / "tokenizer.json"
        parted = parts_run(to_parquet(corpus, args.dir / f"parquet-{size:g}g"), tok_file, args.dir / "parts", args.parts)
        loss = train_briefly(args.dir / "parts" / "parts", args.dir / "parts-run")  # the 2-part dataset
        print(f"| the {size:g} GiB corpus as parquet, {parted['units']} units of 64 MiB | |\n|---|---:|\n"
              f"| one process (`--workers {args.parts}`), wall | {parted['one_s']:.0f} s |\n"
              f"| {args.parts} processes at once (`--part I/{args.parts} --workers 1`), wall | {parted['parts_s']:.0f} s |\n"
              f"| the same dataset, file by file | {'yes' if parted['identical'] else 'NO'} |\n"
              f"| a model trained 4 steps on the parts' dataset, last loss | {loss:.3f} |")
        return
    for size in args.sizes_gb:
        corpus = generate(args.dir / f"corpus-{size:g}g", size)
        out = args.dir / f"prepared-{size:g}g"
        peak, seconds, stdout = peak_rss(prepare_cmd(corpus, out, args.workers))
        tokens = int(re.search(r"([\d,]+) tokens of", stdout)[1].replace(",", ""))
        rows.append({"size_gb": size, "peak_rss_gib": peak / 2**30, "seconds": seconds, "tokens": tokens})
        print(json.dumps(rows[-1]), flush=True)
    smallest = args.dir / f"corpus-{min(args.sizes_gb):g}g"
    tok_file = args.dir / f"prepared-{min(args.sizes_gb):g}g" / "tokenizer.json"
    _, seconds, stdout = peak_rss(prepare_cmd(smallest, args.dir / "speed", args.workers, str(tok_file)))
    prepared_tokens = int(re.search(r"([\d,]+) tokens of", stdout)[1].replace(",", ""))
    alone_tokens, alone_s = tokenizer_alone(smallest, tok_file)
    parted = None
    if args.parts:
        parquet = to_parquet(smallest, args.dir / f"parquet-{min(args.sizes_gb):g}g")
        parted = parts_run(parquet, tok_file, args.dir / "parts", args.parts)
        print(json.dumps(parted), flush=True)
    ratio = (prepared_tokens / seconds) / (alone_tokens / alone_s)
    print(json.dumps({"prepare_tokens_per_s": prepared_tokens / seconds, "tokenizer_tokens_per_s": alone_tokens / alone_s,
                      "ratio": ratio}), flush=True)
    lines = ["| corpus (jsonl.zst, uncompressed) | tokens | prepare, wall (BPE training included) | peak RSS, process tree |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['size_gb']:g} GiB | {r['tokens']:,} | {r['seconds']:.0f} s | {r['peak_rss_gib']:.2f} GiB |" for r in rows]
    lines += ["", f"Peak RSS, largest over smallest corpus: {max(r['peak_rss_gib'] for r in rows) / rows[0]['peak_rss_gib']:.2f}.",
              "", "| the same documents (the smallest corpus), given tokenizer | tokens per second |", "|---|---:|",
              f"| `zerolm prepare --workers {args.workers}` (read, decompress, parse, tokenize, pack, write) | "
              f"{prepared_tokens / seconds:,.0f} |",
              f"| the tokenizer's `encode_batch` alone, documents in memory | {alone_tokens / alone_s:,.0f} |",
              f"| **ratio** | **{ratio:.2f}** |"]
    if parted:
        lines += ["", f"| the smallest corpus as parquet, {parted['units']} units of 64 MiB | wall |", "|---|---:|",
                  f"| one process (`--workers {args.parts}`) | {parted['one_s']:.0f} s |",
                  f"| {args.parts} processes at once (`--part I/{args.parts} --workers 1`) | {parted['parts_s']:.0f} s |",
                  f"| the same dataset, file by file | {'yes' if parted['identical'] else 'NO'} |"]
    print("\n".join(lines))
    if args.write:
        write_block(args.write, BEGIN, END, lines)


if __name__ == "__main__":
    main()
