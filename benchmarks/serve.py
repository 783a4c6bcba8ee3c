"""`zerolm serve` under load: tokens per second and the time to the first token, at 1, 8 and 32 clients.

    JAX_PLATFORMS=cpu python benchmarks/serve.py [--write BENCHMARKS.md] [--seconds 20]

configs/tiny.yaml (4 layers, 128 wide, ALiBi, seq_len 128, served at --context 512) trained 20 steps on the
embedded corpus, served on one device. Each client is a thread that sends one streamed completion after
another (a 6-token prompt, 128 new tokens, temperature 1, its own seed) for `--seconds`; tokens per second
are the completion tokens every client received over the wall time, the time to the first token is each
request's wait for its first streamed text (median and 90th percentile). The same clients, one request after
another with a batch of one row (`--max-rows 1`), are the baseline: what batching adds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from markdown_block import write_block  # noqa: E402

BEGIN, END = "<!-- serve:begin -->", "<!-- serve:end -->"
NEW_TOKENS = 128


def train(work: Path) -> Path:
    sets = ["model.position=alibi", "train.steps=20", "train.eval_every=1000", "sample.tokens=0",
            f"checkpoint.dir={work / 'ckpt'}", f"logging.dir={work / 'log'}", "logging.wandb=disabled"]
    subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(REPO / "configs/tiny.yaml"),
                    *[a for s in sets for a in ("--set", s)]], check=True, cwd=REPO, capture_output=True)
    return work / "ckpt"


def serve(checkpoint: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "serve", "--checkpoint", str(checkpoint),
                             "--port", "0", "--context", "512", *flags], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = proc.stdout.readline()
    match = re.search(r"\(OpenAI API: (\S+);", line)
    assert match, line
    return proc, match.group(1)


def client(api: str, seed: int, until: float) -> tuple[int, list[float]]:
    """Completions one after another until `until`: the tokens received, each request's first-token wait."""
    tokens, waits = 0, []
    with httpx.Client(timeout=120) as http:
        while time.perf_counter() < until:
            body = {"prompt": "And God said unto Moses", "max_tokens": NEW_TOKENS, "temperature": 1.0,
                    "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
            sent, first = time.perf_counter(), None
            with http.stream("POST", f"{api}/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if first is None and event["choices"] and event["choices"][0]["text"]:
                        first = time.perf_counter() - sent
                    if event.get("usage"):
                        tokens += event["usage"]["completion_tokens"]
            waits.append(first if first is not None else float("nan"))
            seed += 1000
    return tokens, waits


def load(api: str, clients: int, seconds: float) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda i: client(api, i, start + seconds), range(clients)))
    wall = time.perf_counter() - start
    waits = np.array([w for _, ws in done for w in ws])
    return {"clients": clients, "tokens_per_s": sum(t for t, _ in done) / wall, "requests": len(waits),
            "ttft_median_ms": 1e3 * float(np.nanmedian(waits)), "ttft_p90_ms": 1e3 * float(np.nanpercentile(waits, 90))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        checkpoint = train(Path(work))
        for flags, label in [((), "batched (rows 1, 8, 32)"), (("--max-rows", "1"), "one row (--max-rows 1)")]:
            proc, api = serve(checkpoint, *flags)
            try:
                load(api, 1, 3)  # the first prompt bucket and steps compiled
                for clients in (1, 8, 32):
                    rows.append({"server": label, **load(api, clients, args.seconds)})
                    print(json.dumps(rows[-1]), file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait()
    one = next(r["tokens_per_s"] for r in rows if r["clients"] == 1)
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on dev-cpu ({os.cpu_count()} cores, shared with other work while "
             f"it ran), `JAX_PLATFORMS=cpu python benchmarks/serve.py --seconds {args.seconds:g} --write BENCHMARKS.md`:",
             "", "| server | clients | completion tokens/s | × one client | requests | first token, median | p90 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['clients']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one:.1f} | "
                     f"{r['requests']} | {r['ttft_median_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms |")
    print("\n".join(lines))
    if args.write:
        write_block(args.write, BEGIN, END, lines)


if __name__ == "__main__":
    main()
