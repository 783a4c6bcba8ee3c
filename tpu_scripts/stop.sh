#!/usr/bin/env bash
# Stop a run on every worker (of every slice, with --slices N): SIGTERM, as a preemption. The workers
# agree on a step, save it to the checkpoint directory and exit 75; launch.sh (or relaunch.sh) later
# resumes from there.
#
#   tpu_scripts/stop.sh --name NAME [--slices N]
#
#   --name NAME         the TPU VM, or the queued resource of --slices N (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --slices N          as create.sh: the nodes NAME-0 ... NAME-(N-1) (default: 1, the TPU VM NAME)
#   --dry-run           print the gcloud commands instead of running them
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --slices) need "$@"; SLICES="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
on_workers all "pkill -TERM -f '[z]erolm train' || true"  # [z]: the pattern cannot match this shell's own command line
