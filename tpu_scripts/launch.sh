#!/usr/bin/env bash
# Start a training run on every worker of a slice, detached: each worker runs
# `zerolm train --distributed` (JAX finds the slice's coordinator itself) and logs to a file.
# Checkpoints belong on gs:// so that every worker, and a relaunched slice, sees them; the run
# resumes from the latest one (--resume auto).
#
# Before it spends anything on the slice, it compiles the step for the slice's accelerator type here
# (`zerolm compile`, the TPU compiler run ahead of time, no TPU needed) and refuses a setting that does
# not fit, with the compiler's line (peak vs usable memory per device) and its exit code (4).
#
#   tpu_scripts/launch.sh --name NAME --config configs/1_3b.yaml --checkpoint-dir gs://BUCKET/RUN [--set K=V ...]
#
#   --name NAME              the TPU VM (required)
#   --zone ZONE              default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT        default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --config FILE            model config, relative to the repository (default: configs/125m.yaml)
#   --checkpoint-dir URL     checkpoint.dir, a gs:// path (required)
#   --set SECTION.KEY=VALUE  a config override; repeatable
#   --run-name NAME          names the log file ~/zerolm-NAME.log on each worker (default: the config's stem)
#   --dir DIR                the repository on each worker (default: zerolm)
#   --accelerator-type TYPE  the slice's type for the compile check, e.g. v3-32 (default: read from the
#                            slice with gcloud describe; required with --dry-run)
#   --skip-compile-check     launch without compiling first (default: compile, and refuse what does not fit)
#   ZEROLM=CMD (environment) the local zerolm that compiles (default: zerolm, i.e. the active venv's)
#   WANDB_API_KEY (environment) forwarded to the workers' training processes when set (shown as *** by
#                            --dry-run); without it, logging.wandb=online logs offline, and the run says how
#                            to upload it later (wandb sync)
#   --dry-run                print the gcloud commands instead of running them
#   -h, --help               this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

CONFIG="configs/125m.yaml"
CHECKPOINT_DIR=""
RUN_NAME=""
DIR="zerolm"
ACCELERATOR_TYPE=""
COMPILE_CHECK=1
SETS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) need "$@"; CONFIG="$2"; shift 2 ;;
    --checkpoint-dir) need "$@"; CHECKPOINT_DIR="$2"; shift 2 ;;
    --set) need "$@"; SETS+=(--set "$2"); shift 2 ;;
    --run-name) need "$@"; RUN_NAME="$2"; shift 2 ;;
    --dir) need "$@"; DIR="$2"; shift 2 ;;
    --accelerator-type) need "$@"; ACCELERATOR_TYPE="$2"; shift 2 ;;
    --skip-compile-check) COMPILE_CHECK=0; shift ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
[[ "$CHECKPOINT_DIR" == gs://* ]] || die "--checkpoint-dir must be a gs:// path that every worker can reach (got '${CHECKPOINT_DIR}')"
RUN_NAME="${RUN_NAME:-$(basename "$CONFIG" .yaml)}"

if [[ "$COMPILE_CHECK" == 1 ]]; then
  if [[ -z "$ACCELERATOR_TYPE" ]]; then
    [[ "$DRY_RUN" != 1 ]] || die "--dry-run needs --accelerator-type TYPE for the compile check (or --skip-compile-check)"
    location
    ACCELERATOR_TYPE="$(gcloud compute tpus tpu-vm describe "$NAME" "${LOCATION[@]}" --format='value(acceleratorType)')"
    [[ -n "$ACCELERATOR_TYPE" ]] || die "cannot read the accelerator type of $NAME; pass --accelerator-type TYPE"
  fi
  read -r -a zerolm <<< "${ZEROLM:-zerolm}"
  status=0
  "${zerolm[@]}" compile --config "$CONFIG" --target "$ACCELERATOR_TYPE" "${SETS[@]}" >&2 || status=$?
  if [[ "$status" != 0 ]]; then
    echo "error: launch.sh: not launched: the step does not compile and fit on $ACCELERATOR_TYPE (zerolm compile exit $status, above); change the config, or pass --skip-compile-check" >&2
    exit "$status"
  fi
fi

train=(.venv/bin/zerolm train --distributed --config "$CONFIG" --set "checkpoint.dir=$CHECKPOINT_DIR" "${SETS[@]}")
log="\$HOME/zerolm-$(printf '%q' "$RUN_NAME").log"
credentials=""
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    credentials="WANDB_API_KEY=*** "
  else
    credentials="WANDB_API_KEY=$(printf '%q' "$WANDB_API_KEY") "
  fi
fi
remote="cd $(printf '%q' "$DIR") && ${credentials}nohup setsid $(printf '%q ' "${train[@]}")> $log 2>&1 < /dev/null &"
on_workers all "$remote"
if [[ "$DRY_RUN" != 1 ]]; then
  echo "started on every worker of $NAME; follow it with: tpu_scripts/logs.sh --name $NAME --zone $ZONE --run-name $RUN_NAME"
fi
