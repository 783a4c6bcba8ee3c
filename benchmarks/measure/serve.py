"""`zerolm serve` under load: tokens per second and the time to the first token, at 1, 8 and 32 clients.

    JAX_PLATFORMS=cpu python -m benchmarks.measure.serve [--write BENCHMARKS.md] [--seconds 20]
    JAX_PLATFORMS=cuda python -m benchmarks.measure.serve --machine h100 --block serve-h100 [--write BENCHMARKS.md]

configs/tiny.yaml as it ships (4 layers, 128 wide, seq_len 128) trained 20 steps (`--train-steps`) on the embedded corpus,
served on one device. Each client is a thread that sends one streamed completion after another (a 6-token
prompt, 96 new tokens, temperature 1, its own seed) for `--seconds`; tokens per second
are the completion tokens every client received over the wall time, the time to the first token is each
request's wait for its first streamed text (median and 90th percentile). The same clients, one request after
another with a batch of one row (`--max-rows 1`), are the baseline: what batching adds.

Short answers: 16 clients each ask for one completion of 16 (then 128) tokens at once, and the same 16
requests are sent one after another (whole answers, each client on its own open connection); the wall time of
each, the median of 5 tries. What serving them together gains where a request is mostly its prompt's prefill.
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

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block

NEW_TOKENS = 96
SHORT_CLIENTS = 16
SHORT_TOKENS = (16, 128)


def train(work: Path, steps: int) -> Path:
    sets = [f"train.steps={steps}", "train.eval_every=1000", "sample.tokens=0",
            f"checkpoint.dir={work / 'ckpt'}", f"logging.dir={work / 'log'}", "logging.wandb=disabled"]
    subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(REPO / "configs/tiny.yaml"),
                    *[a for s in sets for a in ("--set", s)]], check=True, cwd=REPO, capture_output=True)
    return work / "ckpt"


def serve(checkpoint: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "serve", "--checkpoint", str(checkpoint),
                             "--port", "0", *flags], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = proc.stdout.readline()
    match = re.search(r"\(OpenAI API: (\S+);", line)
    assert match, line
    return proc, match.group(1)


def client(api: str, seed: int, until: float, stream: bool) -> tuple[int, list[float]]:
    """Completions one after another until `until`: the tokens received, and each streamed request's wait for
    its first text."""
    tokens, waits = 0, []
    with httpx.Client(timeout=120) as http:
        while time.perf_counter() < until:
            body = {"prompt": "And God said unto Moses", "max_tokens": NEW_TOKENS, "temperature": 1.0,
                    "seed": seed, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
            sent, first = time.perf_counter(), None
            if not stream:
                tokens += http.post(f"{api}/completions", json=body).json()["usage"]["completion_tokens"]
                seed += 1000
                continue
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


def load(api: str, clients: int, seconds: float, stream: bool = True) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda i: client(api, i, start + seconds, stream), range(clients)))
    wall = time.perf_counter() - start
    waits = np.array([w for _, ws in done for w in ws] or [float("nan")])
    return {"clients": clients, "tokens_per_s": sum(t for t, _ in done) / wall,
            "ttft_median_ms": 1e3 * float(np.nanmedian(waits)) if stream else None,
            "ttft_p90_ms": 1e3 * float(np.nanpercentile(waits, 90)) if stream else None}


def short_answers(api: str, tokens: int, tries: int = 5) -> dict:
    """SHORT_CLIENTS completions of `tokens` tokens: all at once, and one after another (seconds, median)."""
    clients = [httpx.Client(timeout=120) for _ in range(SHORT_CLIENTS)]

    def ask(i: int) -> None:
        body = {"prompt": "And God said unto Moses", "max_tokens": tokens, "temperature": 1.0, "seed": i}
        clients[i].post(f"{api}/completions", json=body).raise_for_status()
    together, one_by_one = [], []
    with concurrent.futures.ThreadPoolExecutor(SHORT_CLIENTS) as pool:
        list(pool.map(ask, range(SHORT_CLIENTS)))  # the connections opened, before timing
        for _ in range(tries):
            start = time.perf_counter()
            for i in range(SHORT_CLIENTS):
                ask(i)
            one_by_one.append(time.perf_counter() - start)
            start = time.perf_counter()
            list(pool.map(ask, range(SHORT_CLIENTS)))
            together.append(time.perf_counter() - start)
    for c in clients:
        c.close()
    return {"tokens": tokens, "together_s": float(np.median(together)), "one_by_one_s": float(np.median(one_by_one))}


def step_alone(checkpoint: Path, steps: int) -> dict[int, float]:
    """Tokens/s of the decoding program alone at each row count (every row drawing at temperature 1): what no
    server of this model on this machine can pass."""
    code = f"""
import json, time, jax, jax.numpy as jnp
from zerolm.checkpoint.trained_model import load
from zerolm.model.generate import DRAWS, empty, step
run = load({str(checkpoint)!r}, jax.local_devices()[:1])
out = {{}}
for rows in (1, 8, 32, 1, 8, 32):
    batch = empty(run.model, rows)
    batch = batch._replace(rule=batch.rule._replace(temperature=jnp.ones(rows)))
    batch, drawn = step(run.model, run.params, batch)
    jax.block_until_ready(drawn)
    start = time.perf_counter()
    for _ in range({steps}):
        batch, drawn = step(run.model, run.params, batch)
        drawn = jax.device_get(drawn)
    out[rows] = rows * DRAWS * {steps} / (time.perf_counter() - start)
print(json.dumps(out))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO).stdout
    return {int(k): v for k, v in json.loads(out.splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--machine", default="dev-cpu", help="the machine's name in the table's first line")
    parser.add_argument("--block", default="serve", help="the BENCHMARKS.md block to rewrite: <!-- BLOCK:begin -->")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32],
                        help="client counts, 1 first: the row the others are measured against (default: 1 8 32)")
    parser.add_argument("--tries", type=int, default=5, help="tries of the short answers, their median taken (default: 5)")
    parser.add_argument("--short-tokens", type=int, nargs="+", default=list(SHORT_TOKENS),
                        help="the short answers' lengths in new tokens (default: 16 128)")
    parser.add_argument("--train-steps", type=int, default=20, help="steps the served model is trained (default: 20)")
    parser.add_argument("--decode-steps", type=int, default=100,
                        help="calls of the decoding program timed at each row count, alone (default: 100)")
    args = parser.parse_args()
    if args.clients[0] != 1:
        parser.error("--clients starts with 1: each row's '× one client' is against it")
    rows, short = [], []
    with tempfile.TemporaryDirectory() as work:
        checkpoint = train(Path(work), args.train_steps)
        alone = step_alone(checkpoint, args.decode_steps)
        for flags, label in [((), "batched (rows 1, 8, 32)"), (("--max-rows", "1"), "one row (--max-rows 1)")]:
            proc, api = serve(checkpoint, *flags)
            try:
                load(api, 1, min(3.0, args.seconds))  # the connection pool and the first requests, before timing
                for stream in (True, False):
                    for clients in args.clients:
                        rows.append({"server": label, "stream": stream, **load(api, clients, args.seconds, stream)})
                        print(json.dumps(rows[-1]), file=sys.stderr)
                if not flags:
                    for tokens in args.short_tokens:
                        short.append(short_answers(api, tokens, args.tries))
                        print(json.dumps(short[-1]), file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait()
    lines = table(rows, args, alone, short)
    print("\n".join(lines))
    if args.write:
        write_block(args.write, f"<!-- {args.block}:begin -->", f"<!-- {args.block}:end -->", lines)


def table(rows: list[dict], args: argparse.Namespace, alone: dict[int, float], short: list[dict]) -> list[str]:
    import jax

    device = jax.local_devices()[0]
    where = (f"{os.cpu_count()} cores; the clients run on the same cores" if device.platform == "cpu" else
             f"one {device.device_kind}, {os.cpu_count()} CPU cores; jax {jax.__version__}")
    flags = "" if args.machine == "dev-cpu" else f" --machine {args.machine} --block {args.block}"
    flags += "" if args.clients == [1, 8, 32] else " --clients " + " ".join(map(str, args.clients))
    flags += "" if args.tries == 5 else f" --tries {args.tries}"
    flags += "" if args.short_tokens == list(SHORT_TOKENS) else " --short-tokens " + " ".join(map(str, args.short_tokens))
    flags += "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k, d in (("train_steps", 20), ("decode_steps", 100))
                     if getattr(args, k) != d)
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {args.machine} ({where}), "
             f"`JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', device.platform)} python -m benchmarks.measure.serve --seconds {args.seconds:g}{flags} "
             "--write BENCHMARKS.md`:",
             "", "| server | answers | clients | completion tokens/s | × one client | first token, median | p90 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        one = next(o["tokens_per_s"] for o in rows if o["clients"] == 1 and o["stream"] == r["stream"]
                   and o["server"] == rows[0]["server"])
        wait = (f"{r['ttft_median_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms" if r["stream"] else "- | -")
        lines.append(f"| {r['server']} | {'streamed' if r['stream'] else 'whole'} | {r['clients']} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one:.1f} | {wait} |")
    lines += ["", "The decoding program alone (`generate.step`, every row drawing, no server), the most any server of this "
              "model on this machine could give:", "", "| rows | tokens/s | × one row |", "|---:|---:|---:|"]
    lines += [f"| {rows} | {alone[rows]:.0f} | {alone[rows] / alone[1]:.1f} |" for rows in (1, 8, 32)]
    lines += ["", f"Short answers: {SHORT_CLIENTS} clients, one completion each, at once and one after another (the "
              f"batched server; median of {args.tries} tries):", "",
              "| new tokens | at once | one after another | × |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {1e3 * r['together_s']:.0f} ms | {1e3 * r['one_by_one_s']:.0f} ms | "
              f"{r['one_by_one_s'] / r['together_s']:.1f} |" for r in short]
    return lines


if __name__ == "__main__":
    main()
