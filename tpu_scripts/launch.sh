#!/usr/bin/env bash
# Start a training run on every worker of a slice, detached: each worker runs
# `zerolm train --distributed` (JAX finds the slice's coordinator itself) and logs to a file.
# Checkpoints belong on gs:// so that every worker, and a relaunched slice, sees them; the run
# resumes from the latest one (--resume auto).
#
# With --slices N > 1 (the queued resource of create.sh --slices N), one run over every worker of the N
# slices, joined over the data-center network (Multislice): each node NAME-i gets its own gcloud ssh,
# and each of its workers' training process the environment that joins the slices:
#   MEGASCALE_COORDINATOR_ADDRESS=ADDRESS:8080  slice 0's worker 0 (process 0 of the run), the same for all
#   MEGASCALE_NUM_SLICES=N
#   MEGASCALE_SLICE_ID=i                        the node NAME-i's slice
#   MEGASCALE_PORT=8080
# (a queued resource's runtime may set these too; set here, every process reads the same values), and
# the training command gets --set mesh.slices=N.
#
# Before it spends anything on the slice, it compiles the step for the slice's accelerator type here
# (`zerolm compile`, the TPU compiler run ahead of time, no TPU needed) and refuses a setting that does
# not fit, with the compiler's line (peak vs usable memory per device) and its exit code (4). With
# --slices N it compiles the step for the N slices (`zerolm compile --slices N`: each device's bytes over
# the data-center network too).
#
#   tpu_scripts/launch.sh --name NAME --config configs/1_3b.yaml --checkpoint-dir gs://BUCKET/RUN [--set K=V ...] [--slices N]
#
#   --name NAME              the TPU VM, or the queued resource of --slices N (required)
#   --zone ZONE              default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT        default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --config FILE            model config, relative to the repository (default: configs/125m.yaml)
#   --checkpoint-dir URL     checkpoint.dir, a gs:// path (required)
#   --set SECTION.KEY=VALUE  a config override; repeatable (mesh.slices comes from --slices)
#   --run-name NAME          names the log file ~/zerolm-NAME.log on each worker (default: the config's stem)
#   --dir DIR                the repository on each worker (default: zerolm)
#   --slices N               as create.sh: one run over the nodes NAME-0 ... NAME-(N-1) (default: 1, the
#                            TPU VM NAME)
#   --coordinator ADDRESS    with --slices N > 1: slice 0's worker 0 address (default: read from NAME-0
#                            with gcloud describe; required with --dry-run)
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
COORDINATOR=""
MEGASCALE_PORT=8080  # the port the TPU runtime's Multislice coordinator listens on by default
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
    --slices) need "$@"; SLICES="$2"; shift 2 ;;
    --coordinator) need "$@"; COORDINATOR="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
[[ "$CHECKPOINT_DIR" == gs://* ]] || die "--checkpoint-dir must be a gs:// path that every worker can reach (got '${CHECKPOINT_DIR}')"
for override in "${SETS[@]}"; do
  [[ "$override" != mesh.slices=* ]] || die "--set $override: pass --slices N instead (launch.sh sets mesh.slices=N for the N slices it launches on)"
done
RUN_NAME="${RUN_NAME:-$(basename "$CONFIG" .yaml)}"
nodes
if [[ "$SLICES" == 1 ]]; then
  [[ -z "$COORDINATOR" ]] || die "--coordinator is for --slices N > 1 (a slice's workers find their coordinator themselves)"
elif [[ -z "$COORDINATOR" && "$DRY_RUN" == 1 ]]; then
  die "--dry-run needs --coordinator ADDRESS with --slices $SLICES (slice 0's worker 0; read from ${NODES[0]} with gcloud describe otherwise)"
fi

if [[ "$COMPILE_CHECK" == 1 ]]; then
  if [[ -z "$ACCELERATOR_TYPE" ]]; then
    [[ "$DRY_RUN" != 1 ]] || die "--dry-run needs --accelerator-type TYPE for the compile check (or --skip-compile-check)"
    location
    ACCELERATOR_TYPE="$(gcloud compute tpus tpu-vm describe "${NODES[0]}" "${LOCATION[@]}" --format='value(acceleratorType)')"
    [[ -n "$ACCELERATOR_TYPE" ]] || die "cannot read the accelerator type of ${NODES[0]}; pass --accelerator-type TYPE"
  fi
  read -r -a zerolm <<< "${ZEROLM:-zerolm}"
  status=0
  slices_flag=()
  [[ "$SLICES" == 1 ]] || slices_flag=(--slices "$SLICES")
  "${zerolm[@]}" compile --config "$CONFIG" --target "$ACCELERATOR_TYPE" "${slices_flag[@]}" "${SETS[@]}" >&2 || status=$?
  if [[ "$status" != 0 ]]; then
    echo "error: launch.sh: not launched: the step does not compile and fit on $ACCELERATOR_TYPE (zerolm compile exit $status, above); change the config, or pass --skip-compile-check" >&2
    exit "$status"
  fi
fi

train=(.venv/bin/zerolm train --distributed --config "$CONFIG" --set "checkpoint.dir=$CHECKPOINT_DIR")
if [[ "$SLICES" != 1 ]]; then
  train+=(--set "mesh.slices=$SLICES")
fi
train+=("${SETS[@]}")
log="\$HOME/zerolm-$(printf '%q' "$RUN_NAME").log"
credentials=""
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    credentials="WANDB_API_KEY=*** "
  else
    credentials="WANDB_API_KEY=$(printf '%q' "$WANDB_API_KEY") "
  fi
fi
# remote ENVIRONMENT: what each worker's shell runs, the training process detached, with ENVIRONMENT.
remote() {
  echo "cd $(printf '%q' "$DIR") && $1${credentials}nohup setsid $(printf '%q ' "${train[@]}")> $log 2>&1 < /dev/null &"
}
if [[ "$SLICES" == 1 ]]; then
  on_workers all "$(remote "")"
else
  if [[ -z "$COORDINATOR" ]]; then
    location
    COORDINATOR="$(gcloud compute tpus tpu-vm describe "${NODES[0]}" "${LOCATION[@]}" --format='value(networkEndpoints[0].ipAddress)')"
    [[ -n "$COORDINATOR" ]] || die "cannot read the address of ${NODES[0]}'s worker 0; pass --coordinator ADDRESS"
  fi
  for ((slice = 0; slice < SLICES; slice++)); do
    megascale="MEGASCALE_COORDINATOR_ADDRESS=$(printf '%q' "$COORDINATOR:$MEGASCALE_PORT") MEGASCALE_NUM_SLICES=$SLICES"
    megascale+=" MEGASCALE_SLICE_ID=$slice MEGASCALE_PORT=$MEGASCALE_PORT "
    on_node "${NODES[$slice]}" all "$(remote "$megascale")"
  done
fi
if [[ "$DRY_RUN" != 1 ]]; then
  slices=""
  if [[ "$SLICES" != 1 ]]; then
    slices=" --slices $SLICES"
  fi
  echo "started on every worker of $NAME; follow it with: tpu_scripts/logs.sh --name $NAME --zone $ZONE$slices --run-name $RUN_NAME"
fi
