#!/usr/bin/env bash
# Prepare a corpus on every worker of a slice at once, detached: worker w runs
# `zerolm prepare --part w+1/N` (its number from the TPU VM's metadata), all into one gs:// dataset;
# the part that completes the last unit of work publishes it (the same dataset one machine would make).
# A part that fails or is stopped can be run again: it packs only what it had not finished, so running
# this script again after a failure completes the dataset. Each worker logs to ~/zerolm-prepare.log
# (tpu_scripts/logs.sh --run-name prepare follows worker 0).
#
#   tpu_scripts/prepare.sh --name NAME --source 'jsonl:gs://BUCKET/raw/*.jsonl.zst' --out gs://BUCKET/data/web [-- FLAGS]
#
#   --name NAME              the TPU VM (required)
#   --zone ZONE              default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT        default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --source SPEC            zerolm prepare's --source; its files must be readable on every worker: gs://
#                            (required)
#   --out URL                the dataset, a gs:// path every worker reaches (required)
#   --hosts N                the slice's workers, one part each (default: read from the slice with gcloud
#                            describe; required with --dry-run)
#   --dir DIR                the repository on each worker (default: zerolm)
#   -- FLAGS                 the rest goes to zerolm prepare as it is (--tokenizer, --seq-len, --vocab-size, ...)
#   --dry-run                print the gcloud commands instead of running them
#   -h, --help               this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

SOURCE=""
OUT=""
HOSTS=""
DIR="zerolm"
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) need "$@"; SOURCE="$2"; shift 2 ;;
    --out) need "$@"; OUT="$2"; shift 2 ;;
    --hosts) need "$@"; HOSTS="$2"; shift 2 ;;
    --dir) need "$@"; DIR="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
[[ -n "$SOURCE" ]] || die "--source is required (e.g. 'jsonl:gs://BUCKET/raw/*.jsonl.zst')"
[[ "$OUT" == gs://* ]] || die "--out must be a gs:// path that every worker can reach (got '${OUT}')"
if [[ -z "$HOSTS" ]]; then
  [[ "$DRY_RUN" != 1 ]] || die "--dry-run needs --hosts N (the slice's workers)"
  location
  HOSTS="$(gcloud compute tpus tpu-vm describe "$NAME" "${LOCATION[@]}" --format='value(networkEndpoints.len())')"
fi
[[ "$HOSTS" =~ ^[1-9][0-9]*$ ]] || die "--hosts must be a positive number of workers (got '${HOSTS}')"

# Worker w (0, 1, ...) reads its number from the metadata server every TPU VM worker has, and prepares part w+1.
number="curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number"
prepare=(.venv/bin/zerolm prepare --source "$SOURCE" --out "$OUT" "${EXTRA[@]}")
part="--part \$((\$($number) + 1))/$HOSTS"
remote="cd $(printf '%q' "$DIR") && nohup setsid $(printf '%q ' "${prepare[@]}")$part > \$HOME/zerolm-prepare.log 2>&1 < /dev/null &"
on_workers all "$remote"
if [[ "$DRY_RUN" != 1 ]]; then
  echo "preparing on the $HOSTS workers of $NAME; follow it with: tpu_scripts/logs.sh --name $NAME --zone $ZONE --run-name prepare"
fi
