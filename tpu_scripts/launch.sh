#!/usr/bin/env bash
# Start a training run on every worker of a slice, detached: each worker runs
# `zerolm train --distributed` (JAX finds the slice's coordinator itself) and logs to a file.
# Checkpoints belong on gs:// so that every worker, and a relaunched slice, sees them; the run
# resumes from the latest one (--resume auto).
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
#   --dry-run                print the gcloud commands instead of running them
#   -h, --help               this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

CONFIG="configs/125m.yaml"
CHECKPOINT_DIR=""
RUN_NAME=""
DIR="zerolm"
SETS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) need "$@"; CONFIG="$2"; shift 2 ;;
    --checkpoint-dir) need "$@"; CHECKPOINT_DIR="$2"; shift 2 ;;
    --set) need "$@"; SETS+=(--set "$2"); shift 2 ;;
    --run-name) need "$@"; RUN_NAME="$2"; shift 2 ;;
    --dir) need "$@"; DIR="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
[[ "$CHECKPOINT_DIR" == gs://* ]] || die "--checkpoint-dir must be a gs:// path that every worker can reach (got '${CHECKPOINT_DIR}')"
RUN_NAME="${RUN_NAME:-$(basename "$CONFIG" .yaml)}"

train=(.venv/bin/zerolm train --distributed --config "$CONFIG" --set "checkpoint.dir=$CHECKPOINT_DIR" "${SETS[@]}")
log="\$HOME/zerolm-$(printf '%q' "$RUN_NAME").log"
remote="cd $(printf '%q' "$DIR") && nohup setsid $(printf '%q ' "${train[@]}")> $log 2>&1 < /dev/null &"
on_workers all "$remote"
if [[ "$DRY_RUN" != 1 ]]; then
  echo "started on every worker of $NAME; follow it with: tpu_scripts/logs.sh --name $NAME --zone $ZONE --run-name $RUN_NAME"
fi
