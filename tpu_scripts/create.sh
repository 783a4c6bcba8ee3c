#!/usr/bin/env bash
# Create a Cloud TPU VM slice through a queued resource (the current way to get spot capacity), and
# wait until it is READY, so that setup.sh can run next. With --slices N > 1, one queued resource of N
# slices (Multislice: one run over N slices, joined over the data-center network), nodes NAME-0 ...
# NAME-(N-1), provisioned together; it waits until the queued resource is ACTIVE.
#
#   tpu_scripts/create.sh --name NAME [--zone ZONE] [--accelerator-type TYPE] [--runtime-version V] [--spot] [--slices N]
#
#   --name NAME               the queued resource and TPU VM name (required); with --slices N > 1 the
#                             queued resource's name and its nodes' prefix
#   --zone ZONE               default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT         default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --accelerator-type TYPE   v3-32, v4-64, v5p-128, ... (default: v3-32, what configs/ are sized for)
#   --runtime-version V       TPU software version (default: tpu-ubuntu2204-base)
#   --spot                    spot capacity: cheaper, can be preempted (relaunch.sh resumes)
#   --slices N                slices of --accelerator-type each, in one queued resource (default: 1, one
#                             TPU VM named NAME)
#   --wait-timeout S          how long to wait for READY (ACTIVE) before giving up (default: 3600; 0: do
#                             not wait)
#   --dry-run                 print the gcloud commands instead of running them
#   -h, --help                this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

ACCELERATOR_TYPE="v3-32"
RUNTIME_VERSION="tpu-ubuntu2204-base"
SPOT=0
WAIT_TIMEOUT=3600
while [[ $# -gt 0 ]]; do
  case "$1" in
    --accelerator-type) need "$@"; ACCELERATOR_TYPE="$2"; shift 2 ;;
    --runtime-version) need "$@"; RUNTIME_VERSION="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --wait-timeout) need "$@"; WAIT_TIMEOUT="$2"; shift 2 ;;
    --slices) need "$@"; SLICES="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
[[ "$WAIT_TIMEOUT" =~ ^[0-9]+$ ]] || die "--wait-timeout must be a number of seconds, got '$WAIT_TIMEOUT'"
location
node_flags=(--node-id="$NAME")
if [[ "$SLICES" != 1 ]]; then
  node_flags=(--node-count="$SLICES" --node-prefix="$NAME")  # the nodes NAME-0 ... NAME-(N-1)
fi
extra=()
if [[ "$SPOT" == 1 ]]; then
  extra+=(--spot)
fi
run gcloud compute tpus queued-resources create "$NAME" "${LOCATION[@]}" "${node_flags[@]}" \
  --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${extra[@]}"
if [[ "$WAIT_TIMEOUT" != 0 ]]; then
  wait_until_ready "$WAIT_TIMEOUT"
fi
