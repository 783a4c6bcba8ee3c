#!/usr/bin/env bash
# One GPU measuring session, in parts that each fit one 10-minute call (BENCHMARKS.md: "H100/H200").
#
#   bash benchmarks/measure/gpu_session.sh PART [OUT_DIR]
#
# PART: a = 125m (profile, cold/warm compilation cache, ZeRO-1 vs naive) and PyTorch 125m at micro-batch
#           16 and 32;
#       b = 1_3b (no remat at 8 and 16, full remat at 8; ZeRO-1 vs naive) and PyTorch 1_3b at 8;
#       c = 350m and 760m (no remat at two micro-batches), then XLA GPU flags one at a time on 125m;
#       lease = one call for a 15-minute lease (a machine's start and one 10-minute call): 125m as in a, PyTorch
#           125m at 16, then 1_3b without remat at 16 and 8 (no structure timing, no profile) and PyTorch 1_3b at
#           8, each part under its own time limit so that the results of the first survive a slow second;
#       serve = one call for a 15-minute lease: `zerolm serve` under load (benchmarks/measure/serve.py, the tiny model,
#           10 s a point), then 125m at none/16 and none/32 and 1_3b at none/8 (no structure timing, no
#           profile), each under its own limit, with the card's temperature and throttle counters before and
#           after;
#       side = one call for a 15-minute lease, done in under 9 minutes: zerolm against PyTorch on the same
#           card (benchmarks/measure/side_by_side.py): 125m and 1_3b, each zerolm, PyTorch, zerolm, PyTorch at the same
#           global batch (125m: micro-batch 32 × 2 accumulation steps on both sides; 1_3b: 16 × 2; no remat),
#           11 steps timed after 4, PyTorch under torch.compile's default mode; each run under its own limit
#           and all in a 480 s budget (the whole stopped at 510 s); the card's clocks, temperature, power and
#           throttle counters around each run; zerolm ÷ PyTorch per pair. Through the device tool:
#           `bash benchmarks/measure/gpu_session.sh side`, timeout_s 600, carrying .whl. DRY_RUN=1 runs it on a CPU
#           machine (the tiny config at tiny shapes, both sides, no nvidia-smi needed), in under a minute.
# The candidates are what fits an 80 GB H100 by XLA's GPU compiler (compiled on the CPU machine for an
# H100, 2026-11-25, with the unrolled layer loop and the block that keeps only matmul and attention outputs:
# 125m none/32 and 1_3b none/16 fit 59.3 GiB; `zerolm compile --target h100` says so before any GPU time).
# Results go to OUT_DIR (default: $OUT, else runs/gpu): JSON lines, markdown tables, the profile
# summary, nvidia-smi's reports and the whole log. Python packages the machine lacks are installed from
# .whl/ when present (benchmarks/measure/gpu_env.sh).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
part=${1:?usage: [DRY_RUN=1] gpu_session.sh a|b|c|lease|serve|side [OUT_DIR]}
out=${2:-${OUT:-runs/gpu}}
mkdir -p "$out"
exec > >(tee -a "$out/log-$part.txt") 2>&1

if [ -n "${DRY_RUN:-}" ]; then  # this machine's Python and packages, on its CPU
  [ "$part" = side ] || { echo "DRY_RUN: only the side part has a dry run"; exit 2; }
  export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
else
  source benchmarks/measure/gpu_env.sh
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
else
  echo "no nvidia-smi"
fi
python3 -c 'import jax, flax, optax, orbax.checkpoint as o, torch; print("jax", jax.__version__, "flax", flax.__version__,
  "optax", optax.__version__, "orbax", o.__version__, "torch", torch.__version__, jax.devices())'
work=/dev/shm/zerolm-mfu
[ -d /dev/shm ] || work=/tmp/zerolm-mfu
mkdir -p "$work"

mfu() {  # CONFIG TAG ARGS...: benchmarks/measure/train_mfu.py for one config
  local config=$1 tag=$2; shift 2
  python3 -m benchmarks.measure.train_mfu --configs "$config" --workdir "$work/$tag" --json "$out/mfu-$part.jsonl" \
    --write "$out/table-$part.md" "$@" || echo "train_mfu $config $tag FAILED"
}
torch_run() {  # CONFIG MICRO
  python3 -m benchmarks.measure.torch_gpt --config "$1" --micro-batch "$2" --accum 2 --steps 20 --warmup 5 \
    --json /tmp/torch.json && cat /tmp/torch.json >>"$out/torch-$part.jsonl" || echo "torch $1 FAILED"
}

case $part in
  a)
    mfu 125m 125m --candidates none:16 none:32 --steps 25 --warmup 5 --profile 21-23 --repeat-best
    for d in "$work"/125m/125m-none-*; do
      [ -d "$d/log/profile" ] && python3 -m benchmarks.tools.profile_summary "$d/log/profile" | tee -a "$out/profile-$part.txt"
    done
    torch_run 125m 16
    torch_run 125m 32
    ;;
  b)
    mfu 1_3b 1_3b --candidates none:8 none:16 full:8 --steps 20 --warmup 5 --profile 17-18
    d=$(ls -d "$work"/1_3b/1_3b-none-8 2>/dev/null)
    [ -n "$d" ] && python3 -m benchmarks.tools.profile_summary "$d/log/profile" | tee -a "$out/profile-$part.txt"
    torch_run 1_3b 8
    ;;
  c)
    mfu 350m 350m --candidates none:16 none:32 --steps 12 --warmup 4 --no-structure
    mfu 760m 760m --candidates none:8 none:16 --steps 12 --warmup 4 --no-structure
    for flag in --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true \
                --xla_gpu_enable_command_buffer= --xla_gpu_enable_while_loop_double_buffering=true; do
      XLA_FLAGS="$flag" mfu 125m "flag${flag//[^a-z]/}" --candidates none:16 --steps 15 --warmup 4 --no-structure
    done
    ;;
  lease)
    export -f mfu torch_run; export out part work
    # shellcheck disable=SC2016  # the commands expand in the child bash, which has the exported functions
    timeout 300 bash -c 'mfu 125m 125m --candidates none:16 none:32 --steps 25 --warmup 5 --profile 21-23 --repeat-best
      for d in "$work"/125m/125m-none-*; do
        [ -d "$d/log/profile" ] && python3 -m benchmarks.tools.profile_summary "$d/log/profile" | tee -a "$out/profile-$part.txt"
      done
      torch_run 125m 16' || echo "125m part stopped at its limit"
    timeout 240 bash -c 'mfu 1_3b 1_3b --candidates none:16 none:8 --steps 14 --warmup 4 --no-structure
      torch_run 1_3b 8' || echo "1_3b part stopped at its limit"
    ;;
  serve)
    export -f mfu; export out part work
    throttle() {
      { date +%T; nvidia-smi --query-gpu=temperature.gpu,clocks.sm,power.draw --format=csv,noheader
        nvidia-smi -q -d PERFORMANCE | grep -i -E 'slowdown|power cap|thermal'; } | tee -a "$out/throttle-$part.txt"
    }
    throttle
    timeout 270 python3 -m benchmarks.measure.serve --seconds 10 --machine h100 --block serve-h100 --write BENCHMARKS.md \
      || echo "serve part stopped at its limit"
    sed -n '/<!-- serve-h100:begin -->/,/<!-- serve-h100:end -->/p' BENCHMARKS.md >"$out/serve-h100.md"
    throttle
    timeout 130 bash -c 'mfu 125m 125m --candidates none:16 none:32 --steps 15 --warmup 4 --no-structure' \
      || echo "125m part stopped at its limit"
    throttle
    timeout 150 bash -c 'mfu 1_3b 1_3b --candidates none:8 --steps 10 --warmup 3 --no-structure' \
      || echo "1_3b part stopped at its limit"
    throttle
    ;;
  side)
    if [ -n "${DRY_RUN:-}" ]; then args=(--dry-run); else args=(--workdir "$work/side"); fi
    timeout 510 python3 -m benchmarks.measure.side_by_side --out "$out" "${args[@]}" || echo "side part: stopped or failed"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
echo "part $part done"
