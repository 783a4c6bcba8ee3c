#!/usr/bin/env bash
# Relaunch after a preemption: if the slice is not READY (a spot slice that was preempted), delete
# its queued resource, create it again and set it up; then launch the run, which resumes from the
# latest checkpoint on gs://. Takes the parameters of create.sh, setup.sh and launch.sh.
#
#   tpu_scripts/relaunch.sh --name NAME --accelerator-type v3-32 --spot --config FILE --checkpoint-dir gs://... [--set K=V ...]
#
#   --name NAME               the queued resource / TPU VM (required)
#   --zone ZONE               default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT         default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --accelerator-type TYPE   as create.sh (default: v3-32)
#   --runtime-version V       as create.sh (default: tpu-ubuntu2204-base)
#   --spot                    as create.sh
#   --repo URL, --ref REF     as setup.sh (default: this checkout's origin and commit)
#   --python VERSION          as setup.sh (default: 3.11)
#   --config FILE, --checkpoint-dir URL, --set K=V, --run-name NAME, --skip-compile-check: as launch.sh
#                             (which compiles for --accelerator-type before it launches; default: check)
#   --dry-run                 print the gcloud commands instead of running them (the slice is taken as
#                             not READY, so every step is shown)
#   -h, --help                this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

common=()
create=()
setup=()
launch=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --accelerator-type) need "$@"; create+=("$1" "$2"); launch+=("$1" "$2"); shift 2 ;;
    --runtime-version) need "$@"; create+=("$1" "$2"); shift 2 ;;
    --skip-compile-check) launch+=("$1"); shift ;;
    --spot) create+=("$1"); shift ;;
    --repo|--ref|--python) need "$@"; setup+=("$1" "$2"); shift 2 ;;
    --config|--checkpoint-dir|--set|--run-name) need "$@"; launch+=("$1" "$2"); shift 2 ;;
    --name|--zone|--project) need "$@"; common+=("$1" "$2"); common_arg "$@" || shift $? ;;
    --dry-run) common+=("$1"); common_arg "$@" || shift $? ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
location
state=""
if [[ "$DRY_RUN" == 1 ]]; then
  run gcloud compute tpus tpu-vm describe "$NAME" "${LOCATION[@]}" --format='value(state)'
else
  state="$(gcloud compute tpus tpu-vm describe "$NAME" "${LOCATION[@]}" --format='value(state)' 2>/dev/null || true)"
fi
if [[ "$state" != READY ]]; then
  echo "relaunch: $NAME is ${state:-gone}; creating it again" >&2
  if [[ -n "$state" || "$DRY_RUN" == 1 ]]; then
    "$here/delete.sh" "${common[@]}"
  fi
  "$here/create.sh" "${common[@]}" "${create[@]}"  # returns once the slice is READY
  "$here/setup.sh" "${common[@]}" "${setup[@]}"
fi
"$here/launch.sh" "${common[@]}" "${launch[@]}"
