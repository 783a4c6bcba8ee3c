#!/usr/bin/env bash
# Relaunch after a preemption: if the slice is not READY (a spot slice that was preempted), delete
# its queued resource, create it again and set it up; then launch the run, which resumes from the
# latest checkpoint on gs://. Takes the parameters of create.sh, setup.sh and launch.sh.
#
# With --slices N > 1 a preempted slice restarts the whole run, on every slice, from the latest
# checkpoint. By the queued resource's state:
#   ACTIVE                     every slice is up: stop what is left of the run on every slice and wait
#                              until it has exited (stop.sh --wait 300), then launch on every slice
#   ACCEPTED, PROVISIONING, WAITING_FOR_RESOURCES, CREATING
#                              on its way up: wait until it is ACTIVE, set up every slice, launch
#   anything else, or gone     (SUSPENDED after a preemption, FAILED, ...): delete it, create it again,
#                              set up every slice, launch
#
#   tpu_scripts/relaunch.sh --name NAME --accelerator-type v3-32 --spot --config FILE --checkpoint-dir gs://... [--set K=V ...] [--slices N]
#
#   --name NAME               the queued resource / TPU VM (required)
#   --zone ZONE               default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT         default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --slices N                as create.sh: the queued resource's N slices, NAME-0 ... NAME-(N-1)
#                             (default: 1, the TPU VM NAME)
#   --accelerator-type TYPE   as create.sh (default: v3-32)
#   --runtime-version V       as create.sh (default: tpu-ubuntu2204-base)
#   --spot                    as create.sh
#   --wait-timeout S          as create.sh, and how long to wait for a queued resource on its way up
#                             (default: 3600)
#   --repo URL, --ref REF     as setup.sh (default: this checkout's origin and commit)
#   --python VERSION          as setup.sh (default: 3.11)
#   --config FILE, --checkpoint-dir URL, --set K=V, --run-name NAME, --skip-compile-check: as launch.sh
#                             (which compiles for --accelerator-type before it launches; default: check)
#   --coordinator ADDRESS     as launch.sh, with --dry-run only (default: none; a real relaunch reads slice
#                             0's address once the slices are up, new ones when they were created again)
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
COORDINATOR=""
WAIT_TIMEOUT=3600
while [[ $# -gt 0 ]]; do
  case "$1" in
    --accelerator-type) need "$@"; create+=("$1" "$2"); launch+=("$1" "$2"); shift 2 ;;
    --runtime-version) need "$@"; create+=("$1" "$2"); shift 2 ;;
    --wait-timeout) need "$@"; create+=("$1" "$2"); WAIT_TIMEOUT="$2"; shift 2 ;;
    --skip-compile-check) launch+=("$1"); shift ;;
    --spot) create+=("$1"); shift ;;
    --repo|--ref|--python) need "$@"; setup+=("$1" "$2"); shift 2 ;;
    --config|--checkpoint-dir|--set|--run-name) need "$@"; launch+=("$1" "$2"); shift 2 ;;
    --coordinator) need "$@"; COORDINATOR="$2"; launch+=("$1" "$2"); shift 2 ;;
    --slices) need "$@"; common+=("$1" "$2"); SLICES="$2"; shift 2 ;;
    --name|--zone|--project) need "$@"; common+=("$1" "$2"); common_arg "$@" || shift $? ;;
    --dry-run) common+=("$1"); common_arg "$@" || shift $? ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
[[ "$WAIT_TIMEOUT" =~ ^[0-9]+$ ]] || die "--wait-timeout must be a number of seconds, got '$WAIT_TIMEOUT'"
if [[ "$DRY_RUN" == 1 && "$SLICES" != 1 ]]; then
  [[ -n "$COORDINATOR" ]] || die "--dry-run needs --coordinator ADDRESS with --slices $SLICES (the address launch.sh would read from slice 0)"
fi
[[ -z "$COORDINATOR" || "$DRY_RUN" == 1 ]] || die "--coordinator is for --dry-run only: a relaunch reads slice 0's address once the slices are up"
state_query
state=""
if [[ "$DRY_RUN" == 1 ]]; then
  run "${STATE_QUERY[@]}"
else
  state="$("${STATE_QUERY[@]}" 2>/dev/null || true)"
fi
if [[ "$state" == "$READY_STATE" ]]; then
  if [[ "$SLICES" != 1 ]]; then
    # What is left of the run on the slices still up must be gone before it starts again everywhere.
    echo "relaunch: $NAME is $state; stopping the run on every slice, to start it again on all of them" >&2
    "$here/stop.sh" "${common[@]}" --wait 300
  fi
elif [[ "$SLICES" != 1 && "$state" =~ ^(CREATING|ACCEPTED|PROVISIONING|WAITING_FOR_RESOURCES)$ ]]; then
  echo "relaunch: $NAME is $state; waiting for it to be $READY_STATE" >&2
  wait_until_ready "$WAIT_TIMEOUT"
  "$here/setup.sh" "${common[@]}" "${setup[@]}"
else
  echo "relaunch: $NAME is ${state:-gone}; creating it again" >&2
  if [[ -n "$state" || "$DRY_RUN" == 1 ]]; then
    "$here/delete.sh" "${common[@]}"
  fi
  "$here/create.sh" "${common[@]}" "${create[@]}"  # returns once the slice is READY (every slice: ACTIVE)
  "$here/setup.sh" "${common[@]}" "${setup[@]}"
fi
"$here/launch.sh" "${common[@]}" "${launch[@]}"
