#!/usr/bin/env bash
# Follow a run's log on one worker (worker 0 shows the progress bar and the metrics lines).
#
#   tpu_scripts/logs.sh --name NAME [--worker 0] [--run-name 125m] [--lines 100]
#
#   --name NAME         the TPU VM (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --worker N          which worker's log (default: 0)
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
while [[ $# -gt 0 ]]; do
  case "$1" in
    --worker) need "$@"; WORKER="$2"; shift 2 ;;
    --run-name) need "$@"; RUN_NAME="$2"; shift 2 ;;
    --lines) need "$@"; LINES="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
[[ "$WORKER" =~ ^[0-9]+$ ]] || die "--worker must be a worker number, got '$WORKER'"
[[ "$LINES" =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LINES'"
on_workers "$WORKER" "tail -n $LINES -F \$HOME/zerolm-$(printf '%q' "$RUN_NAME").log"
