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
