"""JAX's persistent compilation cache (`train.compilation_cache`): a restarted run, after a preemption say,
loads its compiled programs instead of compiling them again. A local directory or a gs:// URL (JAX reads
and writes it through etils.epath, so through zerolm's storage layer), which a re-created TPU slice
shares with the one before it."""

from __future__ import annotations

import functools

import jax

from zerolm.core.storage import cache_dir


def directory(setting: str | None) -> str | None:
    """Where the cache lives: "default" is $ZEROLM_CACHE/xla; None: no cache."""
    return str(cache_dir() / "xla") if setting == "default" else setting


def use(setting: str | None) -> None:
    """Point JAX's persistent compilation cache at `setting` (see `directory`)."""
    if setting is None:
        return
    jax.config.update("jax_compilation_cache_dir", directory(setting))
    # Every program, however quick to compile: on a fast machine a small model's update compiles in under
    # JAX's default threshold (1 s) and a restart would compile it again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # Not XLA's own caches beside it (JAX's default puts the GPU per-fusion autotune results there): on an
    # H100 (jax 0.11.2, 2026-11-27) a run that found another run's autotune results there stopped at its
    # first step, `cuda_graph_end_capture ... capturing stream has unjoined work` while deserializing a cuDNN
    # attention graph; with them off the same two runs trained (BENCHMARKS.md, "H100, third session"). The
    # whole-program cache above still spares a restart its compiles.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")


class Hits:
    """Counts the programs JAX loads from the cache (a jax.monitoring listener, one per process)."""

    hits = 0

    @classmethod
    @functools.cache
    def listen(cls) -> type[Hits]:
        def count(event: str, **kwargs) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                cls.hits += 1

        jax.monitoring.register_event_listener(count)
        return cls
