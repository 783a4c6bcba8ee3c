#!/usr/bin/env bash
# Set up every worker of a slice: the repository at a ref, a virtual environment, the same
# requirements file as everywhere else, and JAX's TPU runtime.
#
#   tpu_scripts/setup.sh --name NAME [--repo URL] [--ref REF]
#
#   --name NAME         the TPU VM (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --repo URL          git repository to clone on each worker (default: this checkout's origin)
#   --ref REF           branch, tag or commit (default: this checkout's commit)
#   --dir DIR           where on each worker (default: zerolm, in the home directory)
#   --dry-run           print the gcloud commands instead of running them
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

REPO="$(git -C "$here" remote get-url origin 2>/dev/null || true)"
REF="$(git -C "$here" rev-parse HEAD 2>/dev/null || echo main)"
DIR="zerolm"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repo) need "$@"; REPO="$2"; shift 2 ;;
    --ref) need "$@"; REF="$2"; shift 2 ;;
    --dir) need "$@"; DIR="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
[[ -n "$REPO" ]] || die "--repo is required: this checkout has no origin remote to default to"

remote="set -euo pipefail
if [ -d $(printf '%q' "$DIR")/.git ]; then git -C $(printf '%q' "$DIR") fetch -q origin; else git clone -q $(printf '%q' "$REPO") $(printf '%q' "$DIR"); fi
cd $(printf '%q' "$DIR") && git checkout -q $(printf '%q' "$REF")
python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt -e . 'jax[tpu]'"
on_workers all "$remote"
