"""Test setup: 8 fake CPU devices, no wandb traffic, a private cache; shared small-model fixtures."""

import os

from xla_flags import FAST_COMPILE

# Must happen before jax is imported anywhere.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if FAST_COMPILE not in os.environ["XLA_FLAGS"]:  # tests/xla_flags.py says why; subprocesses inherit it
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["WANDB_MODE"] = "disabled"

import functools  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from zerolm.config.load import load_config  # noqa: E402
from zerolm.model import decoder as gpt_model  # noqa: E402
from zerolm.model import losses  # noqa: E402
from zerolm.parallel.auto import for_device  # noqa: E402
from zerolm.train import compilation_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


# Tests that use these need a training run in a subprocess or a GCS server: the `slow` tier, with the
# modules that mark themselves (`pytestmark`) and single tests marked where they are.
SLOW_FIXTURES = {"trained_run", "gcs", "gcs_module", "gcs_server"}


# The files that take longest (`pytest --durations=0` on 2 cores), run first: `make test` hands whole files to
# its two workers in this order (--no-loadscope-reorder), so that the last files to start are short ones and
# neither worker idles at the end waiting for the other's long file.
LONGEST_FIRST = ("test_launch.py", "test_benchmarks.py", "test_storage.py", "test_checkpoint.py", "test_compile.py", "test_harness.py",
                 "test_gpu_compile.py", "test_model_options.py", "test_train.py", "test_averaging.py", "test_serve.py", "test_data.py", "test_import_hf.py",
                 "test_parts.py", "test_export.py",
                 "test_model.py", "test_branch.py", "test_schedules.py", "test_zero_stages.py", "test_tensor_parallel.py", "test_documents.py", "test_grow.py",
                 "test_evaluate.py", "test_mixture.py", "test_step_time.py", "test_zero.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Tokenizers, the prepared default corpus and compiled programs go into the session's own cache, never the
    user's; one for both xdist workers (their common directory), so that each is built once, not once each
    (zerolm prepares the default corpus under a lock; JAX's compilation cache takes several processes)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (root / "zerolm-cache").mkdir(exist_ok=True)
    os.environ["ZEROLM_CACHE"] = str(root / "zerolm-cache")
    # JAX's persistent cache in the workers too (training turns it on in-process anyway, from its first run): a
    # program another test compiled loads instead (test_zero.py: 116 of 411 compiles, a quarter of its compile time).
    compilation_cache.use("default")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a jax.distributed coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requires_devices(n: int):
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")


def small_config(*overrides: str, device_count: int = 8):
    """The tiny config shrunk to a model that compiles in a second or two."""
    base = ["model.vocab_size=100", "model.n_layer=2", "model.d_model=32", "model.n_head=4",
            "model.seq_len=16", "model.dtype=float32"]
    return load_config(TINY, [*base, *overrides], device_count=device_count)


def small_step(*overrides: str, dp: int = 8, tp: int = 1, slices: int = 1, devices=None, device_count: int | None = None,
               **kw):
    """(cfg, model, zero, init_fn): small_config's step on a (dp, tp) mesh (a (slice, dp, tp) one with `slices`),
    built as training builds it (zerolm.parallel.build.build_step; `kw`: its other arguments, e.g. rules)."""
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    n = slices * dp * tp
    cfg = small_config(*overrides, f"mesh.tp={tp}", f"mesh.slices={slices}", device_count=device_count or n)
    mesh = make_mesh(dp, tp, devices if devices is not None else jax.devices()[:n], slices)
    model, zero, init_fn = build_step(cfg, mesh, **kw)
    return cfg, model, zero, init_fn


@functools.cache
def small_model(cfg_model):
    model = gpt_model.GPT(for_device(cfg_model))  # resolved for this process's devices
    init_fn = functools.partial(gpt_model.init_params, model)
    return model, init_fn, functools.partial(losses.lm_loss, model), jax.eval_shape(init_fn, jax.random.key(0))


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """One real GCS server (benchmarks/lib/gcs.py) for the session (each xdist worker starts its own)."""
    from benchmarks.lib.gcs import GCSServer

    server = GCSServer(tmp_path_factory.mktemp("gcs") / "root").start()
    yield server
    server.stop()


class Bucket:
    """A bucket of its own on the session's GCS server: `url` is gs://NAME."""

    def __init__(self, server, name: str):
        self.server, self.name, self.url = server, name, server.make_bucket(name)

    def objects(self, prefix: str = "") -> dict[str, int]:
        return self.server.objects(self.name, prefix)


def _bucket(server, monkeypatch) -> Bucket:
    import uuid

    for key, value in server.env().items():  # this process's clients and its children find the server here
        monkeypatch.setenv(key, value)
    return Bucket(server, f"zerolm-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """A fresh bucket on the session's GCS server, found by every client through its standard variables."""
    return _bucket(gcs_server, monkeypatch)


@pytest.fixture(scope="module")
def gcs_module(gcs_server):
    """As `gcs`, for a module's fixtures."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _bucket(gcs_server, monkeypatch)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A small model trained for 16 steps (tests/runs.py's SMALL), evaluated at steps 8 and 16; the run's
    directory holds ckpt/ (steps 8 and 16 kept of every 4) and log/."""
    import runs

    run_dir = tmp_path_factory.mktemp("trained")
    runs.train(run_dir, "train.eval_every=8", "checkpoint.keep=2")
    return run_dir
