#!/usr/bin/env bash
# Follow a run's log on one worker (worker 0 of slice 0, the run's process 0, shows the progress bar and
# the metrics lines).
#
#   tpu_scripts/logs.sh --name NAME [--worker 0] [--run-name 125m] [--lines 100] [--slices N --slice I]
#
#   --name NAME         the TPU VM, or the queued resource of --slices N (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --worker N          which worker's log (default: 0)
#   --slices N          as create.sh: the nodes NAME-0 ... NAME-(N-1) (default: 1, the TPU VM NAME)
#   --slice I           which slice's worker, 0 ... N-1: the node NAME-I (default: 0)
#   --run-name NAME     as given to launch.sh (default: 125m)
#   --lines N           lines of history before following (default: 100)
#   --dry-run           print the gcloud command instead of running it
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

WORKER=0
RUN_NAME="125m"
LINES=100
SLICE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --worker) need "$@"; WORKER="$2"; shift 2 ;;
    --run-name) need "$@"; RUN_NAME="$2"; shift 2 ;;
    --lines) need "$@"; LINES="$2"; shift 2 ;;
    --slices) need "$@"; SLICES="$2"; shift 2 ;;
    --slice) need "$@"; SLICE="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
[[ "$WORKER" =~ ^[0-9]+$ ]] || die "--worker must be a worker number, got '$WORKER'"
[[ "$LINES" =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LINES'"
[[ "$SLICE" =~ ^[0-9]+$ && "$SLICE" -lt "$SLICES" ]] || die "--slice must be a slice number below --slices $SLICES, got '$SLICE'"
nodes
on_node "${NODES[$SLICE]}" "$WORKER" "tail -n $LINES -F \$HOME/zerolm-$(printf '%q' "$RUN_NAME").log"
