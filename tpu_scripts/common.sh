#!/usr/bin/env bash
# Shared by the tpu_scripts: parameters, --help, --dry-run. Sourced, not run.
# shellcheck disable=SC2034  # the variables set here are read by the script that sources this file

set -euo pipefail

DRY_RUN=0
NAME=""
ZONE="${ZEROLM_TPU_ZONE:-us-central2-b}"
PROJECT="${ZEROLM_TPU_PROJECT:-}"
SLICES=1

# Print the script's header comment (the lines after the shebang that start with '#') as its help.
usage() {
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}

die() {
  echo "error: $(basename "$0"): $*" >&2
  exit 2
}

# need FLAG VALUE: a flag's value must be there.
need() {
  [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see $(basename "$0") --help)"
}

# Parse the parameters every script has; the script handles the rest in its own loop first.
common_arg() {
  case "$1" in
    --name) need "$@"; NAME="$2"; return 2 ;;
    --zone) need "$@"; ZONE="$2"; return 2 ;;
    --project) need "$@"; PROJECT="$2"; return 2 ;;
    --dry-run) DRY_RUN=1; return 1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown parameter: $1 (see $(basename "$0") --help)" ;;
  esac
}

require_name() {
  [[ -n "$NAME" ]] || die "--name is required (the TPU VM / queued resource name)"
}

# For a script that takes --slices N: N must be a positive number.
require_slices() {
  [[ "$SLICES" =~ ^[1-9][0-9]*$ ]] || die "--slices must be a positive number of slices, got '$SLICES'"
}

# The TPU VMs of the run, in slice order: one slice is the TPU VM NAME; N slices are the nodes of the
# queued resource NAME, which gcloud names NAME-0 ... NAME-(N-1) (create.sh gives NAME as their prefix).
nodes() {
  NODES=()
  if [[ "$SLICES" == 1 ]]; then
    NODES=("$NAME")
  else
    local i
    for ((i = 0; i < SLICES; i++)); do
      NODES+=("$NAME-$i")
    done
  fi
}

# run CMD...: run it, or with --dry-run print it, quoted so that it can be pasted into a shell.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q' "$1"
    shift
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# The flags every gcloud call of a slice takes.
location() {
  LOCATION=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then
    LOCATION+=(--project="$PROJECT")
  fi
}

# on_node NODE WORKER COMMAND: run a shell command on one worker (0, 1, ...) of one TPU VM, or on all of them.
on_node() {
  location
  run gcloud compute tpus tpu-vm ssh "$1" "${LOCATION[@]}" --worker="$2" --command="$3"
}

# on_workers WORKER COMMAND: the same, on every slice of the run.
on_workers() {
  local node
  nodes
  for node in "${NODES[@]}"; do
    on_node "$node" "$1" "$2"
  done
}

# state_query: STATE_QUERY, the gcloud command that prints the run's state, and READY_STATE, the state
# it has once every host is up: one slice's TPU VM READY; N slices' queued resource ACTIVE (all its
# nodes provisioned).
state_query() {
  location
  if [[ "$SLICES" == 1 ]]; then
    STATE_QUERY=(gcloud compute tpus tpu-vm describe "$NAME" "${LOCATION[@]}" --format='value(state)')
    READY_STATE=READY
  else
    STATE_QUERY=(gcloud compute tpus queued-resources describe "$NAME" "${LOCATION[@]}" --format='value(state.state)')
    READY_STATE=ACTIVE
  fi
}

# wait_until_ready TIMEOUT_S: poll until the run's TPU VMs are up (READY_STATE: a queued resource is
# provisioned asynchronously, spot capacity can take a while). With --dry-run, print the poll once.
wait_until_ready() {
  state_query
  if [[ "$DRY_RUN" == 1 ]]; then
    run "${STATE_QUERY[@]}"
    return
  fi
  local deadline=$((SECONDS + $1)) state=""
  while true; do
    state="$("${STATE_QUERY[@]}" 2>/dev/null || true)"
    [[ "$state" == "$READY_STATE" ]] && return
    if (( SECONDS >= deadline )); then
      echo "error: $(basename "$0"): $NAME is not $READY_STATE after $1 s (state: ${state:-not created yet}); see: gcloud compute tpus queued-resources describe $NAME ${LOCATION[*]}" >&2
      exit 1
    fi
    echo "$(basename "$0"): waiting for $NAME to be $READY_STATE (state: ${state:-not created yet})" >&2
    sleep 30
  done
}
