"""MFU on one device through the normal training path: micro-batch, remat policy, step time, memory.

    python -m benchmarks.measure.train_mfu --configs 125m [--steps 30] [--write BENCHMARKS.md]     # a GPU
    JAX_PLATFORMS=cpu python -m benchmarks.measure.train_mfu --configs tiny --seq-len 128 --micro-batches 4 8 \\
        --remat none full --steps 12                                                       # CPU smoke run

For each config, on one device (dp = 1), sequence length 2048, GPT-2's vocabulary (50257) and the
config's compute dtype (bfloat16 on a GPU):
1. Search: the gradient program of each (remat policy, micro-batch) is compiled, not run. It fits when
   its compiled memory plus the optimizer state stays under 90% of the device's memory. Per policy,
   the largest micro-batch that fits is kept.
2. Normal path: each kept candidate trains `--steps` steps as `zerolm train` in a subprocess: the ZeRO-1
   step, the real loop, loader (the default dataset), metrics and a final checkpoint. Its step time is
   the median of the per-step times it logs after `--warmup` steps; each ends with a device sync (the
   loop reads that step's loss). Peak device memory is what the backend reports (GPU) in the metrics.
   `--candidates REMAT:MICRO ...` skips the search and trains just those (in that order).
3. Structure cost: for the winner, the ZeRO-1 step (three programs) and the naive single-jit step,
   timed in this process on the same synthetic batches (median of `--steps`, synced every step).
4. Checks: each run dumps its optimized gradient program (`--xla_dump_to`), and the table counts its
   cuDNN flash-attention calls (`__cudnn$fmha` custom calls); `--repeat-best` trains the winner again
   on the now warm persistent compilation cache: the whole run's wall time cold and warm (start-up,
   compiling, the steps and the final checkpoint; the difference is what the cache saves).

MFU = (6·N + 12·L·d·T) · tokens/s / peak (src/zerolm/observe/mfu.py states the convention and the peaks).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The search compiles in this process while the candidates run in subprocesses: hold no device memory here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


import jax
import numpy as np

from benchmarks.lib import REPO
from benchmarks.lib.steps import to_accum_layout
from zerolm.config.load import load_config
from zerolm.core.hardware import memory_limit
from zerolm.model import decoder as gpt_model
from zerolm.model import losses
from zerolm.model.flops import flops_per_token
from zerolm.observe.mfu import mfu, peak_for
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.naive_step import naive_data_parallel_step

POLICIES = ("none", "dots_attention", "dots", "attention", "full")  # from the most memory to the least


def memory_of(compiled) -> int:
    ma = compiled.memory_analysis()
    return 0 if ma is None else (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                                 - ma.alias_size_in_bytes)


def overrides(args, micro: int, remat: str) -> list[str]:
    return [f"model.seq_len={args.seq_len}", f"model.vocab_size={args.vocab_size}", f"model.remat={remat}",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * args.accum}", "mesh.dp=1",
            # One device: the ZeRO-1 step, whatever stage the config ships for a slice (a stage-2 config's
            # per-layer reduce-scatters have nothing to split at dp 1, and keep its layers in a scan).
            "zero.stage=1", *args.set]


def load(args, config: str, micro: int, remat: str):
    cfg = load_config(REPO / "configs" / f"{config}.yaml", overrides(args, micro, remat), device_count=1)
    model, zero, _ = build_step(cfg, make_mesh(1, 1, jax.devices()[:1]))
    return cfg, model, zero.abstract_params, zero


def search(args, config: str) -> list[dict]:
    """Per remat policy, the largest micro-batch whose gradient program fits (compiled, not run)."""
    limit = memory_limit(jax.local_devices()[0])
    kept = []
    for remat in args.remat:
        best = None
        for micro in sorted(args.micro_batches):
            cfg, model, abstract, zero = load(args, config, micro, remat)
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=zero.table.replicated), abstract)
            batch = jax.ShapeDtypeStruct((args.accum, micro, args.seq_len + 1), np.int32, sharding=zero.table.batch_sharding)
            t = time.perf_counter()
            compiled = zero.programs.grad.lower(params, batch).compile()
            compile_s = time.perf_counter() - t
            opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
                jax.eval_shape(zero.tx.init, abstract)))
            need = memory_of(compiled) + opt_bytes
            fits = limit is None or need < 0.9 * limit
            print(f"  {config} remat={remat} micro={micro}: {need / 2**30:.2f} GiB "
                  f"{'fits' if fits else 'does not fit'} (grad compiled in {compile_s:.1f} s)", flush=True)
            if not fits:
                break
            best = dict(config=config, remat=remat, micro=micro, need_gib=need / 2**30, compile_s=compile_s)
        if best is not None:
            kept.append(best)
    return kept


def parse_candidate(text: str) -> tuple[str, int]:
    remat, _, micro = text.partition(":")
    if remat not in POLICIES or not micro.isdigit() or int(micro) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected REMAT:MICRO, REMAT one of {', '.join(POLICIES)}")
    return remat, int(micro)


def run_command(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)


def train_through_zerolm(args, cand: dict, workdir: Path, tag: str = "", run=run_command) -> dict:
    """`zerolm train` in a subprocess, started by `run(cmd, env)` (default: run to its end; a caller may time-limit
    or watch it); step times and memory from its metrics.jsonl, cuDNN attention calls from its dumped gradient
    program."""
    run_dir = workdir / f"{cand['config']}-{cand['remat']}-{cand['micro']}{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a --workdir used before must not resume (and re-read) its old run
    sets = [*overrides(args, cand["micro"], cand["remat"]), f"train.steps={args.steps}",
            f"train.compilation_cache={workdir / 'xla-cache'}", "logging.wandb=disabled",
            f"train.schedule_steps={max(args.steps, 100)}", "train.warmup_steps=10", f"logging.dir={run_dir / 'log'}",
            f"checkpoint.dir={run_dir / 'ckpt'}", f"checkpoint.every={args.steps}", "train.eval_sequences=0",
            "sample.tokens=0", *([f"logging.profile={args.profile}"] if args.profile else [])]
    dump = run_dir / "hlo"
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                        "--xla_dump_hlo_module_re=.*grad_step.*".strip()}
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    t = time.perf_counter()
    proc = run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(REPO / "configs" / f"{cand['config']}.yaml"),
                *[a for s in sets for a in ("--set", s)]], env)
    wall = time.perf_counter() - t
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:  # the run's last lines go to the log that comes back (the run dir may not)
        print("\n".join(proc.stderr.strip().splitlines()[-40:]), file=sys.stderr, flush=True)
        return {**cand, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    records = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    timed = [r["step_time_s"] for r in steps[args.warmup:]]
    step_s = float(np.median(timed))
    peak = max((r.get("device_peak_bytes", 0) for r in steps), default=0)
    optimized = sorted(dump.glob("*after_optimizations.txt")) if dump.exists() else []
    fmha = max((f.read_text().count("__cudnn$fmha") for f in optimized), default=None)
    return {**cand, "step_s": step_s, "first_step_s": steps[0]["step_time_s"], "wall_s": wall, "cudnn_fmha": fmha,
            "peak_gib": peak / 2**30 if peak else None, "timed_steps": len(timed),
            "profile": str(run_dir / "log" / "profile") if args.profile else None}


def structure_cost(args, cand: dict) -> dict:
    """The ZeRO-1 step vs the naive single-jit step, same micro-batch, policy and synthetic batches."""
    cfg, model, abstract, zero = load(args, cand["config"], cand["micro"], cand["remat"])
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch_size, args.seq_len + 1)).astype(np.int32)
            for _ in range(2)]
    batches = [jax.device_put(to_accum_layout(r, 1, cfg.accum_steps, cfg.train.micro_batch_size), zero.table.batch_sharding)
               for r in rows]
    init_fn = functools.partial(gpt_model.init_params, model)

    def median_step(step, state) -> float:
        times = []
        for i in range(args.warmup + args.steps):
            t = time.perf_counter()
            state, metrics = step(state, batches[i % 2])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        return float(np.median(times[args.warmup:]))

    zero_s = median_step(zero.step, zero.init(init_fn, jax.random.key(0)))
    naive = naive_data_parallel_step(zero.mesh, zero_loss := functools.partial(losses.lm_loss, model), zero.tx)
    params = jax.jit(init_fn, out_shardings=zero.table.replicated)(jax.random.key(0))

    def naive_step(state, batch):
        p, o, m = naive(*state, batch)
        return (p, o), m

    naive_s = median_step(naive_step, (params, jax.jit(zero.tx.init)(params)))
    del zero_loss
    return {"zero_step_s": zero_s, "naive_step_s": naive_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["125m", "350m", "760m", "1_3b"])
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=50257, help="GPT-2's, as the published figures use")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--remat", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--accum", type=int, default=2, help="accumulation steps per optimizer step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per timed run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median (default: %(default)s)")
    p.add_argument("--profile", default=None, metavar="A-B", help="profile these steps of each run")
    p.add_argument("--write", type=Path, default=None, help="put the table into this markdown file")
    p.add_argument("--candidates", type=parse_candidate, nargs="+", default=None, metavar="REMAT:MICRO",
                   help="train these instead of searching, e.g. none:16 dots_attention:32")
    p.add_argument("--no-structure", action="store_true", help="skip the ZeRO-1 vs naive single-jit timing")
    p.add_argument("--repeat-best", action="store_true",
                   help="train the winner again on the warm compilation cache (time to first step, cold and warm)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the runs (logs, profiles, HLO dumps, checkpoints) here (default: a temp dir, removed)")
    p.add_argument("--json", type=Path, default=None, help="also write every result as JSON lines here")
    args = p.parse_args()

    device = jax.devices()[0]
    peak = peak_for(device.device_kind)
    rows = []
    keep = contextlib.nullcontext(str(args.workdir)) if args.workdir else None
    with keep or tempfile.TemporaryDirectory(prefix="zerolm-mfu-") as work:
        for config in args.configs:
            if args.candidates:
                cands = [dict(config=config, remat=r, micro=m, need_gib=None, compile_s=None) for r, m in args.candidates]
            else:
                print(f"{config}: searching micro-batch × remat on {device.device_kind}", flush=True)
                cands = search(args, config)
            results = []
            for cand in cands:
                results.append(train_through_zerolm(args, cand, Path(work)))
                print(json.dumps(results[-1], default=str), flush=True)
            ok = [r for r in results if "error" not in r]
            for r in results:
                if "error" in r:
                    print(f"  {config} remat={r['remat']} micro={r['micro']}: failed: {r['error']}", flush=True)
            if not ok:
                continue
            best = min(ok, key=lambda r: r["step_s"] / r["micro"])
            cfg, model, abstract, _ = load(args, config, best["micro"], best["remat"])
            fpt = flops_per_token(gpt_model.count_params(abstract, matmul_only=True), cfg.model.n_layer,
                                  cfg.model.d_model, cfg.model.seq_len)
            tokens = cfg.train.global_batch_size * cfg.model.seq_len
            if args.repeat_best:
                warm = train_through_zerolm(args, best, Path(work), tag="-warm")
                best.update(warm_first_step_s=warm.get("first_step_s"), warm_wall_s=warm.get("wall_s"))
            if not args.no_structure:
                best.update(structure_cost(args, best))
            best.update(fpt=fpt, tokens_per_s=tokens / best["step_s"],
                        dtype=model.cfg.dtype,
                        attention=model.cfg.attention,
                        others=", ".join(f"{r['remat']}/{r['micro']}: {r['micro'] * args.accum * args.seq_len / r['step_s']:,.0f}"
                                         for r in ok if r is not best))
            best["mfu"] = mfu(best["tokens_per_s"], fpt, device.device_kind)
            rows.append(best)
            print(json.dumps(best, default=str), flush=True)
            if args.json:
                with args.json.open("a") as f:
                    for r in results:
                        f.write(json.dumps({**r, "best": r is best, "device": device.device_kind,
                                            "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")},
                                           default=str) + "\n")

    date = datetime.date.today().isoformat()
    head = (f"{device.device_kind}, jax {jax.__version__}, {date}; seq_len {args.seq_len}, vocab {args.vocab_size}, "
            f"dp 1, {args.accum} accumulation steps; median of {args.steps - args.warmup} steps after {args.warmup}. "
            f"Peak: {peak.source if peak else 'unknown for this device: no MFU'}.")
    lines = [head, "", "| config | remat | micro-batch | dtype / attention (cuDNN fmha calls) | step (s) | tokens/s | MFU | "
             "MFU naive single-jit | ZeRO-1 / naive step | peak memory (GiB) | run wall time, cold / warm compilation cache (s) | "
             "other candidates (tokens/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pct = lambda v: "—" if v is None else f"{v:.1%}"
        if "naive_step_s" in r:
            naive_mfu = pct(mfu(r["tokens_per_s"] * r["zero_step_s"] / r["naive_step_s"], r["fpt"], device.device_kind))
            ratio = f"{r['zero_step_s'] / r['naive_step_s']:.3f}"
        else:
            naive_mfu = ratio = "—"
        peak_mem = (f"{r['peak_gib']:.1f}" if r["peak_gib"] else
                    f"{r['need_gib']:.1f} (compiled)" if r["need_gib"] else "—")
        first = f"{r['wall_s']:.0f}" + (f" / {r['warm_wall_s']:.0f}" if r.get("warm_wall_s") else "")
        lines.append(f"| {r['config']} | {r['remat']} | {r['micro']} | {r['dtype']} / {r['attention']} ({r['cudnn_fmha']}) "
                     f"| {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {pct(r['mfu'])} | {naive_mfu} "
                     f"| {ratio} | {peak_mem} | {first} | {r['others'] or '—'} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.write:
        slug = re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")
        begin, end = f"<!-- train_mfu:{slug}:begin -->", f"<!-- train_mfu:{slug}:end -->"
        command = "python -m benchmarks.measure.train_mfu " + " ".join(sys.argv[1:])
        block = f"{begin}\n```\n{command}\n```\n{table}\n{end}"
        text = args.write.read_text() if args.write.exists() else ""
        if begin in text:
            text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
        args.write.write_text(text)


if __name__ == "__main__":
    main()
