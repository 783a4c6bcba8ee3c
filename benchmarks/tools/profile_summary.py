"""Where the device time of a jax.profiler trace goes: the GPU kernels' time by kind and by name.

    python -m benchmarks.tools.profile_summary RUN_DIR/profile [--top 25]

Reads the newest `*.trace.json.gz` under the directory (what `zerolm train --profile A-B` writes),
keeps the complete events ("ph": "X") of the device's streams (processes named /device:GPU:...),
and sums their durations: by kind (matmul, attention, fused elementwise, reductions/collectives,
copies, other; from the kernel names) and the `--top` kernels by name. Shares are of the summed
kernel time; the first line gives the traced wall time and how busy the device was over it.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

KINDS = (("attention", re.compile(r"fmha|flash|cudnn|attention|sdpa", re.I)),
         ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|matmul|\bdot|triton_gemm|nvjet|wgmma|sm90", re.I)),
         ("collective/reduction", re.compile(r"nccl|all_reduce|reduce_scatter|all_gather|reduce|scatter", re.I)),
         ("copy/transpose", re.compile(r"copy|memcpy|memset|transpose|dynamic.update.slice|concatenate", re.I)),
         ("fused elementwise", re.compile(r"fusion|loop_|input_|elementwise", re.I)))


def kind_of(name: str) -> str:
    return next((kind for kind, rx in KINDS if rx.search(name)), "other")


def summarize(directory: Path, top: int) -> str:
    traces = sorted(directory.rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not traces:
        raise SystemExit(f"error: no *.trace.json.gz under {directory}")
    trace = json.loads(gzip.decompress(traces[-1].read_bytes()))
    events = trace.get("traceEvents", [])
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:GPU" in name or "/device:TPU" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]
    if not kernels:
        raise SystemExit(f"error: {traces[-1]} has no device kernel events (processes: {sorted(names.values())})")
    total = sum(e["dur"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    by_kind, by_name = collections.Counter(), collections.Counter()
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
    lines = [f"{traces[-1].name}: {len(kernels)} kernels, {total / 1e3:.1f} ms of kernel time over a "
             f"{span / 1e3:.1f} ms span (device busy {total / span:.0%}, streams overlapping counted twice)"]
    lines += [f"  {kind:22s} {dur / 1e3:10.1f} ms {dur / total:6.1%}" for kind, dur in by_kind.most_common()]
    lines.append(f"  top {top} kernels:")
    lines += [f"  {dur / 1e3:10.1f} ms {dur / total:6.1%}  {name[:110]}" for name, dur in by_name.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summarize(args.directory, args.top))


if __name__ == "__main__":
    main()
