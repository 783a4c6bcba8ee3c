"""zerolm against PyTorch on one GPU, in turn (zerolm, PyTorch, zerolm, PyTorch), the card watched throughout.

Per config the two alternate, so that a card that slows down as it heats costs both sides alike; the card's
clocks, temperature and throttle counters are read around every run, and zerolm ÷ PyTorch printed per pair.

    python3 -m benchmarks.measure.side_by_side --out runs/gpu          # one GPU, under 9 minutes (gpu_session.sh side)
    python -m benchmarks.measure.side_by_side --dry-run --out /tmp/side  # CPU: the tiny config, both sides really run

Both sides train the same GPT shape (configs/CONFIG.yaml at `--seq-len` 2048 and GPT-2's vocabulary) on the
same global batch per optimizer step (`--global-batch`: micro-batch × accumulation steps, each side at its
own micro-batch), so their tokens/s compare:
- zerolm: `zerolm train` in a subprocess, as benchmarks/measure/train_mfu.py runs it (one device, the ZeRO-1 step,
  no remat, bfloat16, cuDNN flash attention, the default dataset, a final checkpoint);
- PyTorch: benchmarks/measure/torch_gpt.py as its users run it: torch.compile (default mode; `--torch-modes` adds
  others, each its own pairs), bfloat16 autocast, fused AdamW, flash SDPA.
Step time: the median of each side's steps after `--warmup` (of `--steps`), each step ended by a device sync.
MFU, one formula for both: tokens/s × zerolm.model.flops.flops_per_token (6·N + 12·L·d·T, N counted on
zerolm's model by zerolm.model.decoder.count_params(matmul_only); PyTorch's GPT has the same N) ÷ the card's
dense bf16 peak (zerolm.observe.mfu: 989 TFLOP/s for an H100 or H200). Peak memory: what each allocator
reports (XLA's peak bytes in use; torch.cuda.max_memory_allocated).

Time: each run stops at its own limit (`--limit`), and the whole at `--budget` seconds: a run gets the smaller
of its limit and the budget left, and none starts with under 20 s left, so one slow side cannot eat the
runs after it. The card (`nvidia-smi`): name, driver, SM and memory clocks, temperature, power and the active
clock event (throttle) reasons with their counters (`-q -d PERFORMANCE`) before and after each run, and every
5 s during it (the SM clock under load is read from the samples at 50% utilisation or more). Without
nvidia-smi (the dry run) that is said, and the runs go on.

Into `--out`: side.jsonl (a line per run), side.md (the tables between the markers `--write BENCHMARKS.md`
puts them between), side-smi.txt (nvidia-smi's reports). `--from side.jsonl` makes the tables again from
lines fetched back, without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block
from benchmarks.measure import train_mfu  # the zerolm side's run (`zerolm train` as train_mfu.py runs it)
from zerolm.model import decoder
from zerolm.model.flops import flops_per_token
from zerolm.observe.mfu import peak_for

SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "utilization.gpu")
SAMPLE_EVERY_S = 5.0
LEAST_S = 20.0  # a run is not started with less of the budget left

# Both sides at the same micro-batch, as the H100 rows (BENCHMARKS.md) had them at none/16 and none/8, scaled to
# 141 GB: each fits an H200 without remat (zerolm by the compiler, `zerolm compile --target h200
# --largest-micro-batch`: 125m up to 128, 1_3b up to 32 at 87.7 GiB; PyTorch by its H100 peaks, 29.0 GiB at
# 125m/32 and 51.1 GiB at 1_3b/8, so about 83 GiB at 1_3b/16 and too much at 32), and from 16 to 32 the H100's
# 125m gained 3% on each side: at 32k-65k tokens a micro-step the matmuls already fill the card.
GPU = dict(configs=["125m", "1_3b"], zerolm_micro={"125m": 32, "1_3b": 16}, torch_micro={"125m": 32, "1_3b": 16},
           global_batch={"125m": 64, "1_3b": 32}, limit={"125m": 120.0, "1_3b": 210.0}, seq_len=2048,
           vocab_size=50257, steps=15, warmup=4, budget=480.0)
DRY = dict(configs=["tiny"], zerolm_micro={"tiny": 2}, torch_micro={"tiny": 2}, global_batch={"tiny": 4},
           limit={"tiny": 120.0}, seq_len=64, vocab_size=2048, steps=4, warmup=1, budget=300.0)


# --- the card ---------------------------------------------------------------------------------------------

def smi(*args: str) -> str | None:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def sample() -> dict | None:
    """One reading of the card's clocks (MHz), temperature (°C), power (W) and utilisation (%); None without one."""
    out = smi(f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits")
    if not out or not out.strip():
        return None
    row = {}
    for field, value in zip(SMI_FIELDS, out.splitlines()[0].split(", "), strict=False):
        with contextlib.suppress(ValueError):
            value = float(value)
        row[field] = value
    return row


def performance(text: str) -> tuple[list[str], dict[str, float]]:
    """The clock event (throttle) reasons active now and the reasons' counters in seconds since the driver
    loaded, from `nvidia-smi -q -d PERFORMANCE` ("Clocks Event Reasons", "Clocks Throttle Reasons" before)."""
    active, counters = [], {}
    for line in text.splitlines():
        key, _, value = line.partition(" : ")
        key, value = key.strip(), value.strip()
        if m := re.fullmatch(r"([\d,]+)\s*(?:us|µs)", value):
            counters[key] = int(m.group(1).replace(",", "")) / 1e6
        elif value == "Active":
            active.append(key)
    return active, counters


class Card:
    """nvidia-smi's readings, each full report also kept in a text file."""

    def __init__(self, log: Path):
        self.log = log
        self.present = shutil.which("nvidia-smi") is not None

    def snapshot(self, label: str) -> dict | None:
        row, text = sample(), smi("-q", "-d", "PERFORMANCE")
        if row is None:
            return None
        active, counters = performance(text or "")
        with self.log.open("a") as f:
            f.write(f"--- {label} {datetime.datetime.now().isoformat(timespec='seconds')}\n{text}\n")
        return {**row, "active": active, "counters_s": counters}


def during(samples: list[dict]) -> dict | None:
    """The card while a run trained: its samples at 50% utilisation or more."""
    busy = [s for s in samples if isinstance(s.get("utilization.gpu"), float) and s["utilization.gpu"] >= 50]
    if not busy:
        return None
    clocks = [s["clocks.sm"] for s in busy if isinstance(s.get("clocks.sm"), float)]
    return {"samples": len(busy), "sm_mhz_median": statistics.median(clocks) if clocks else None,
            "sm_mhz_min": min(clocks, default=None),
            "temp_c_max": max((s["temperature.gpu"] for s in busy if isinstance(s.get("temperature.gpu"), float)), default=None),
            "power_w_max": max((s["power.draw"] for s in busy if isinstance(s.get("power.draw"), float)), default=None)}


def throttled(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Seconds each throttle counter rose by between two snapshots (the nonzero ones)."""
    if not before or not after:
        return None
    rises = {k: after["counters_s"][k] - v for k, v in before["counters_s"].items() if k in after["counters_s"]}
    return {k: round(v, 3) for k, v in rises.items() if v > 0}


# --- running one side -------------------------------------------------------------------------------------

class Runner:
    """Runs a command in its own process group under a time limit, sampling the card every few seconds; kills
    the group at the limit (torch.compile's workers too), or when this process is told to stop."""

    def __init__(self, card: Card):
        self.card, self.current = card, None
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum, frame):
        self.kill()
        raise SystemExit(f"stopped by signal {signum}")

    def kill(self):
        if self.current is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.current.pid, signal.SIGKILL)

    def __call__(self, cmd: list[str], env: dict[str, str], limit: float) -> tuple[subprocess.CompletedProcess, list[dict]]:
        samples, start = [], time.monotonic()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            self.current = proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=REPO,
                                                   process_group=0)
            stopped = False
            while True:
                left = limit - (time.monotonic() - start)
                if left <= 0:
                    self.kill()
                    proc.wait()
                    stopped = True
                    break
                try:
                    proc.wait(timeout=min(SAMPLE_EVERY_S, left))
                    break
                except subprocess.TimeoutExpired:
                    if self.card.present and (s := sample()) is not None:
                        samples.append(s)
            self.kill()  # whatever the run left behind in its group
            self.current = None
            out.seek(0)
            err.seek(0)
            stderr = err.read() + (f"\nstopped at its {limit:.0f} s limit" if stopped else "")
            return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), stderr), samples


def run_zerolm(args, config: str, pair: int, limit: float, runner: Runner) -> dict:
    micro = args.zerolm_micro[config]
    ns = argparse.Namespace(seq_len=args.seq_len, vocab_size=args.vocab_size, accum=args.global_batch[config] // micro,
                            set=args.set, steps=args.steps, warmup=args.warmup, profile=None)
    cand = dict(config=config, remat="none", micro=micro, need_gib=None, compile_s=None)
    seen: list[dict] = []

    def run(cmd, env):
        proc, samples = runner(cmd, env, limit)
        seen.extend(samples)
        return proc

    start = time.monotonic()
    r = train_mfu.train_through_zerolm(ns, cand, args.workdir, tag=f"-{pair}", run=run)
    shutil.rmtree(args.workdir / f"{config}-none-{micro}-{pair}" / "ckpt", ignore_errors=True)  # 16 GB at 1_3b
    return {"side": "zerolm", "micro": micro, "accum": ns.accum, "compile": "XLA", "samples": seen,
            "wall_s": time.monotonic() - start,
            **{k: r.get(k) for k in ("step_s", "first_step_s", "peak_gib", "cudnn_fmha", "error")}}


def run_torch(args, config: str, pair: int, mode: str, limit: float, runner: Runner) -> dict:
    micro = args.torch_micro[config]
    accum = args.global_batch[config] // micro
    result = args.workdir / f"torch-{config}-{mode}-{pair}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.measure.torch_gpt", "--config", config, "--seq-len", str(args.seq_len),
           "--vocab-size", str(args.vocab_size), "--micro-batch", str(micro), "--accum", str(accum),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(result),
           *(["--device", "cpu", "--no-compile"] if args.dry_run else ["--compile-mode", mode])]
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.dry_run:  # one thread: on a shared CPU, two contend and a tiny step takes ten times longer
        env.setdefault("OMP_NUM_THREADS", "1")
    proc, samples = runner(cmd, env, limit)
    row = {"side": "pytorch", "micro": micro, "accum": accum, "compile": "off" if args.dry_run else mode,
           "wall_s": time.monotonic() - start, "samples": samples}
    if proc.returncode != 0 or not result.exists():
        print("\n".join(proc.stderr.strip().splitlines()[-40:]), file=sys.stderr, flush=True)
        return {**row, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    out = json.loads(result.read_text())
    return {**row, **{k: out.get(k) for k in ("step_s", "first_step_s", "peak_gib", "torch", "sdpa")}}


# --- the whole ----------------------------------------------------------------------------------------------

def flops_of(args, config: str) -> tuple[float, dict]:
    """Model FLOPs per token (zerolm.model.flops) and the shape, counted on zerolm's model on the CPU."""
    ns = argparse.Namespace(seq_len=args.seq_len, vocab_size=args.vocab_size, set=args.set, accum=1)
    cfg, model, abstract, _ = train_mfu.load(ns, config, 1, "none")
    m = cfg.model
    return (flops_per_token(decoder.count_params(abstract, matmul_only=True), m.n_layer, m.d_model, m.seq_len),
            {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head})


def measure(args, card: Card, runner: Runner, jsonl: Path, rows: list[dict], command: str) -> None:
    """Every run, in order, each appended to `rows` and written to `jsonl` as it ends."""
    start = time.monotonic()
    first = card.snapshot("start")
    device = first["name"] if first else "cpu"
    print(f"card: {json.dumps(first)}" if first else "nvidia-smi: not found or no GPU; no card readings", flush=True)
    common = {"device": device, "driver": first.get("driver_version") if first else None, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "seq_len": args.seq_len, "vocab_size": args.vocab_size,
              "steps": args.steps, "warmup": args.warmup, "command": command}
    for config in args.configs:
        fpt, shape = flops_of(args, config)
        for mode in args.torch_modes:
            for pair in range(1, args.pairs + 1):
                for side in ("zerolm", "pytorch"):
                    left = args.budget - (time.monotonic() - start)
                    limit = min(args.limit[config], left)
                    label = f"{config} pair {pair} {side}" + (f" ({mode})" if side == "pytorch" else "")
                    base = {**common, "config": config, "pair": pair, "torch_mode": mode, "fpt": fpt, **shape,
                            "global_batch": args.global_batch[config], "limit_s": round(limit, 1),
                            "started_s": round(args.budget - left, 1)}
                    if limit < LEAST_S:
                        row = {**base, "side": side, "error": f"not started: {left:.0f} s of the {args.budget:.0f} s budget left"}
                    else:
                        print(f"{label}: at {args.budget - left:.0f} s, up to {limit:.0f} s", flush=True)
                        before = card.snapshot(f"before {label}")
                        row = (run_zerolm(args, config, pair, limit, runner) if side == "zerolm"
                               else run_torch(args, config, pair, mode, limit, runner))
                        after = card.snapshot(f"after {label}")
                        busy = during(row.pop("samples"))
                        row = {**base, **row, "card_before": before, "card_after": after, "card_during": busy,
                               "throttled_s": throttled(before, after)}
                    rows.append(finish(row))
                    with jsonl.open("a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
                    print(f"{label}: {summary(row)}", flush=True)
                    if side == "pytorch":
                        print(f"{config} pair {pair}: zerolm ÷ PyTorch {ratio(rows[-2], row)}", flush=True)


def finish(row: dict) -> dict:
    """tokens/s and MFU from the step time, one formula for both sides."""
    if row.get("step_s"):
        row["tokens_per_s"] = row["global_batch"] * row["seq_len"] / row["step_s"]
        peak = peak_for(row["device"])
        row["mfu"] = row["tokens_per_s"] * row["fpt"] / peak.flops if peak else None
    return row


def summary(r: dict) -> str:
    if not r.get("step_s"):
        return f"failed: {r.get('error')}"
    return (f"{r['step_s']:.3f} s a step, {r['tokens_per_s']:,.0f} tokens/s, MFU {pct(r.get('mfu'))}, "
            f"peak {num(r.get('peak_gib'), '.1f')} GiB, {r['wall_s']:.0f} s in all")


def failed(r: dict) -> str:
    """A run's error in a table cell: its first 100 characters, no column bars."""
    text = str(r.get("error") or "no step time")
    return "failed: " + (text[:100] + "…" if len(text) > 100 else text).replace("|", "/")


def ratio(z: dict, t: dict) -> str:
    return f"{z['tokens_per_s'] / t['tokens_per_s']:.3f}" if z.get("tokens_per_s") and t.get("tokens_per_s") else "—"


def pct(v) -> str:
    return "—" if v is None else f"{v:.1%}"


def num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def tables(rows: list[dict]) -> list[str]:
    """The pairs and the card around each run, as markdown, under the command that ran them."""
    h = rows[0]
    peak = peak_for(h["device"])
    torch_version = next((r["torch"] for r in rows if r.get("torch")), "?")
    lines = [f"`{h['command']}`", "",
             f"{h['device']}" + (f", driver {h['driver']}" if h.get("driver") else "") +
             f"; jax {h['jax']}, torch {torch_version}; {h['date']}. seq_len {h['seq_len']}, vocabulary {h['vocab_size']}; "
             f"step time the median of {h['steps'] - h['warmup']} steps after {h['warmup']}; "
             + (f"MFU = (6·N + 12·L·d·T) · tokens/s ÷ {peak.flops / 1e12:.0f} TFLOP/s, one count for both sides "
                "(zerolm.model.flops)" if peak else "no MFU (no known peak for this device)") +
             "; zerolm: ZeRO-1, no remat. Runs in the order listed, each pair zerolm then PyTorch.", "",
             "| config | pair | zerolm micro × accum | zerolm step (s) | zerolm tokens/s | zerolm MFU | zerolm peak (GiB) "
             "| PyTorch compile | PyTorch micro × accum | PyTorch step (s) | PyTorch tokens/s | PyTorch MFU | PyTorch peak (GiB) "
             "| zerolm ÷ PyTorch |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for z, t in zip(rows[0::2], rows[1::2], strict=False):
        cells = []
        for r in (z, t):
            side = ([r.get("compile") or "—"] if r is t else [])
            side += [f"{r['micro']} × {r['accum']}" if r.get("micro") else "—"]
            side += ([num(r["step_s"], ".3f"), f"{r['tokens_per_s']:,.0f}", pct(r.get("mfu")), num(r.get("peak_gib"), ".1f")]
                     if r.get("step_s") else [failed(r), "—", "—", "—"])
            cells += side
        lines.append(f"| {z['config']} | {z['pair']} | " + " | ".join(cells) + f" | {ratio(z, t)} |")
    lines += ["", "The card around each run (`nvidia-smi`; under load: the samples every 5 s at 50% utilisation or more; "
              "throttled: the seconds each clock event counter rose by during the run):", "",
              "| run | attention | wall (s) | °C before → after | SM MHz under load, median (min) | max W | "
              "throttle reasons active after | throttled during (s) |",
              "|---|---|---:|---|---|---:|---|---|"]
    for r in rows:
        b, a, d = r.get("card_before"), r.get("card_after"), r.get("card_during")
        temps = f"{num(b.get('temperature.gpu'), '.0f')} → {num(a.get('temperature.gpu'), '.0f')}" if b and a else "—"
        clocks = f"{num(d['sm_mhz_median'], '.0f')} ({num(d['sm_mhz_min'], '.0f')})" if d else "—"
        active = ", ".join(x for x in (a or {}).get("active", []) if x != "Idle") or ("none" if a else "—")
        rises = r.get("throttled_s")
        rose = "—" if rises is None else ", ".join(f"{k} {v:.1f}" for k, v in rises.items()) or "none"
        attention = (f"cuDNN flash: {r['cudnn_fmha']} calls" if r.get("cudnn_fmha") is not None else
                     f"SDPA: {r['sdpa']}" if r.get("sdpa") else "—")
        lines.append(f"| {r['config']} {r['pair']} {r['side']} | {attention} | {num(r.get('wall_s'), '.0f')} | {temps} | {clocks} "
                     f"| {num(d and d['power_w_max'], '.0f')} | {active} | {rose} |")
    return lines


def parse_per_config(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        return name, float(value) if "." in value else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CONFIG=NUMBER") from None


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu")), help="(default: $OUT, else runs/gpu)")
    p.add_argument("--dry-run", action="store_true", help="the CPU: the tiny config at tiny shapes, PyTorch uncompiled")
    p.add_argument("--configs", nargs="+", help=f"(default: {' '.join(GPU['configs'])})")
    for name, what in (("zerolm-micro", "zerolm's micro-batch (remat none)"), ("torch-micro", "PyTorch's micro-batch"),
                       ("global-batch", "sequences per optimizer step, both sides"), ("limit", "seconds each run may take")):
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=parse_per_config, nargs="+", metavar="CONFIG=N",
                       help=f"{what} (default: {' '.join(f'{k}={v:g}' for k, v in GPU[key].items())})")
    p.add_argument("--pairs", type=int, default=2, help="zerolm-then-PyTorch pairs per config and mode (default: %(default)s)")
    p.add_argument("--torch-modes", nargs="+", default=["default"],
                   help="torch.compile modes, each its own pairs; max-autotune-no-cudagraphs autotunes every matmul "
                        "shape and does not fit the 9-minute run beside the default (default: %(default)s)")
    for name in ("seq_len", "vocab_size", "steps", "warmup", "budget"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float if name == "budget" else int, help=f"(default: {GPU[name]:g})")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="zerolm's side only (the shape must stay the config's)")
    p.add_argument("--workdir", type=Path, default=None, help="the runs' files (default: a temp dir, removed)")
    p.add_argument("--write", type=Path, default=None, help="also put the tables into this markdown file (BENCHMARKS.md)")
    p.add_argument("--from", dest="from_jsonl", type=Path, default=None, help="make the tables from these lines; run nothing")
    args = p.parse_args(argv)
    defaults = DRY if args.dry_run else GPU
    for key, value in defaults.items():
        given = getattr(args, key)
        if isinstance(value, dict):
            setattr(args, key, {**value, **dict(given or [])})
        elif given is None:
            setattr(args, key, value)
    for config in args.configs:
        for side in ("zerolm_micro", "torch_micro"):
            micro, total = getattr(args, side).get(config), args.global_batch.get(config)
            if not micro or not total or total % micro:
                p.error(f"{config}: needs --{side.replace('_', '-')} and --global-batch, the one dividing the other")
        args.limit.setdefault(config, max(args.limit.values()))
    return args


def main(argv=None) -> None:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    given, shown = list(sys.argv[1:] if argv is None else argv), []
    while given:  # the command as the tables show it: without the places files go
        arg = given.pop(0)
        if arg in ("--out", "--workdir", "--write", "--from"):
            given = given[1:]
        elif not arg.startswith(("--out=", "--workdir=", "--write=", "--from=")):
            shown.append(arg)
    command = " ".join(["python -m benchmarks.measure.side_by_side", *shown])
    if args.from_jsonl:
        rows = [json.loads(line) for line in args.from_jsonl.read_text().splitlines() if line.strip()]
        report(args, rows)
        return
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the zerolm runs, on the CPU
    jax.config.update("jax_platforms", "cpu")  # this process only counts FLOPs: the card stays the runs'
    jsonl = args.out / "side.jsonl"
    jsonl.unlink(missing_ok=True)
    (args.out / "side-smi.txt").unlink(missing_ok=True)
    card, rows = Card(args.out / "side-smi.txt"), []
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            args.workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zerolm-side-")))
        args.workdir.mkdir(parents=True, exist_ok=True)
        try:
            measure(args, card, Runner(card), jsonl, rows, command)
        finally:  # stopped from outside too: the tables of the runs that ended
            if rows:
                report(args, rows)


def report(args, rows: list[dict]) -> None:
    slug = re.sub(r"[^a-z0-9]+", "-", rows[0]["device"].lower()).strip("-")
    begin, end = f"<!-- side_by_side:{slug}:begin -->", f"<!-- side_by_side:{slug}:end -->"
    lines = tables(rows)
    (args.out / "side.md").write_text("\n".join([begin, *lines, end]) + "\n")
    print("\n" + "\n".join(lines), flush=True)
    if args.write:
        write_block(args.write, begin, end, lines)


if __name__ == "__main__":
    main()
