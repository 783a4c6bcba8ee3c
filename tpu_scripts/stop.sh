#!/usr/bin/env bash
# Stop a run on every worker (of every slice, with --slices N): SIGTERM, as a preemption. The workers
# agree on a step, save it to the checkpoint directory and exit 75; launch.sh (or relaunch.sh) later
# resumes from there. With --wait S, it returns once they have exited, so that a new run can start.
#
#   tpu_scripts/stop.sh --name NAME [--slices N] [--wait S]
#
#   --name NAME         the TPU VM, or the queued resource of --slices N (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --slices N          as create.sh: the nodes NAME-0 ... NAME-(N-1) (default: 1, the TPU VM NAME)
#   --wait S            wait up to S seconds for the training processes to exit, and fail (exit 1) on a
#                       worker where one is still running then (default: 0, do not wait)
#   --dry-run           print the gcloud commands instead of running them
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

WAIT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --slices) need "$@"; SLICES="$2"; shift 2 ;;
    --wait) need "$@"; WAIT="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
[[ "$WAIT" =~ ^[0-9]+$ ]] || die "--wait must be a number of seconds, got '$WAIT'"
# [z]: the pattern cannot match this shell's own command line (nor may any other word of it: the pattern's
# words, unbracketed, would make pgrep find the shell that runs it).
stop="pkill -TERM -f '[z]erolm train' || true"
if [[ "$WAIT" != 0 ]]; then
  stop+="; for _ in \$(seq $WAIT); do pgrep -f '[z]erolm train' > /dev/null || exit 0; sleep 1; done"
  stop+="; echo \"error: stop.sh: \$(hostname): the training processes still run $WAIT s after SIGTERM\" >&2; exit 1"
fi
on_workers all "$stop"
