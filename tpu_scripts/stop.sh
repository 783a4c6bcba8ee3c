#!/usr/bin/env bash
# Stop a run on every worker: SIGTERM, as a preemption. The workers agree on a step, save it to the
# checkpoint directory and exit 75; launch.sh (or relaunch.sh) later resumes from there.
#
#   tpu_scripts/stop.sh --name NAME
#
#   --name NAME         the TPU VM (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --dry-run           print the gcloud command instead of running it
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

only_common_args "$@"
on_workers all "pkill -TERM -f '[z]erolm train' || true"  # [z]: the pattern cannot match this shell's own command line
