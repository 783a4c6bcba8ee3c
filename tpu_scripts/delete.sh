#!/usr/bin/env bash
# Delete a slice and its queued resource (with --slices N, the queued resource and all N slices: --force
# deletes its nodes with it, so the command is the same for any N). Checkpoints on gs:// are not touched.
#
#   tpu_scripts/delete.sh --name NAME [--slices N]
#
#   --name NAME         the queued resource / TPU VM (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --slices N          as create.sh (default: 1); taken so that every script takes the run's --slices,
#                       it changes nothing here
#   --dry-run           print the gcloud command instead of running it
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
location
run gcloud compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet
