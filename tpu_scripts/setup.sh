#!/usr/bin/env bash
# Set up every worker of a slice (of every slice, with --slices N): the repository at a ref, a virtual
# environment with a Python that zerolm supports (the TPU images' own python3 is older: uv, from PyPI,
# installs one), the same requirements file as everywhere else, and JAX's TPU runtime.
#
#   tpu_scripts/setup.sh --name NAME [--repo URL] [--ref REF] [--slices N]
#
#   --name NAME         the TPU VM, or the queued resource of --slices N (required)
#   --zone ZONE         default: $ZEROLM_TPU_ZONE or us-central2-b
#   --project PROJECT   default: $ZEROLM_TPU_PROJECT or gcloud's configured project
#   --repo URL          git repository to clone on each worker (default: this checkout's origin)
#   --ref REF           branch, tag or commit (default: this checkout's commit, which must be pushed to
#                       --repo: the workers fetch it from there)
#   --dir DIR           where on each worker (default: zerolm, in the home directory)
#   --python VERSION    the venv's Python, installed by uv (default: 3.11)
#   --slices N          as create.sh: the nodes NAME-0 ... NAME-(N-1), each set up alike (default: 1, the
#                       TPU VM NAME)
#   --dry-run           print the gcloud commands instead of running them
#   -h, --help          this help
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

ORIGIN="$(git -C "$here" remote get-url origin 2>/dev/null || true)"
REPO="$ORIGIN"
REF=""
DIR="zerolm"
PYTHON="3.11"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repo) need "$@"; REPO="$2"; shift 2 ;;
    --ref) need "$@"; REF="$2"; shift 2 ;;
    --dir) need "$@"; DIR="$2"; shift 2 ;;
    --python) need "$@"; PYTHON="$2"; shift 2 ;;
    --slices) need "$@"; SLICES="$2"; shift 2 ;;
    *) common_arg "$@" || shift $? ;;
  esac
done
require_name
require_slices
[[ -n "$REPO" ]] || die "--repo is required: this checkout has no origin remote to default to"
[[ "$PYTHON" =~ ^3\.[0-9]+$ ]] || die "--python must be a version like 3.11, got '$PYTHON'"
if [[ -z "$REF" ]]; then
  # This checkout's commit, which the workers can fetch only if it was pushed (checked here when they
  # clone this checkout's origin; on a worker in any case).
  REF="$(git -C "$here" rev-parse HEAD 2>/dev/null || echo main)"
  if [[ "$REPO" == "$ORIGIN" && "$REF" != main && -z "$(git -C "$here" branch -r --contains "$REF" 2>/dev/null)" ]]; then
    die "this checkout's commit ${REF:0:12} is on no branch of origin, so the workers cannot fetch it: push it (git push), or pass --ref"
  fi
fi

q() { printf '%q' "$1"; }
remote="set -euo pipefail
if [ -d $(q "$DIR")/.git ]; then git -C $(q "$DIR") remote set-url origin $(q "$REPO"); else git clone -q $(q "$REPO") $(q "$DIR"); fi
cd $(q "$DIR")
git fetch -q origin $(q "$REF") 2>/dev/null && git checkout -q --detach FETCH_HEAD || { echo \"error: setup.sh: \$(hostname): cannot fetch $(q "$REF") from $(q "$REPO"): push it, or pass --ref\" >&2; exit 2; }
python3 -m pip install -q --user 'uv>=0.5' && export PATH=\"\$HOME/.local/bin:\$PATH\"
uv venv -q --seed --python $(q "$PYTHON") .venv
uv pip install -q --python .venv/bin/python -r requirements.txt -e . 'jax[tpu]'"
on_workers all "$remote"
