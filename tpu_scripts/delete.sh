#!/usr/bin/env bash
# Delete a slice and its queued resource. Checkpoints on gs:// are not touched.
#
#   tpu_scripts/delete.sh --name NAME
#
#   --name NAME         the queued resource / TPU VM (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --dry-run           print the gcloud command instead of running it
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

only_common_args "$@"
location
run gcloud compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet
