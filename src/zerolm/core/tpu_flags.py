"""libtpu's flags zerolm sets: its asynchronous collective fusion where it helps (`zero.tpu_async_collectives`).

By default the TPU compiler (libtpu as pinned) runs every collective of the step synchronously. With the
flags below (what MaxText sets), it splits collectives into a start and a done and schedules a matmul
between them. Read in the compiled schedule (BENCHMARKS.md, "The fastest plan that fits"; zerolm.compile.step_time):
at ZeRO-3 they hide two thirds of the layers' gather bytes (the 6.7B on a v3-32: 236.6 GB exposed per device
per step, 82.0 with them, at 0.32 GiB more peak); at ZeRO-2 they change nothing (1_3b's plan compiles to the
same schedule and peak). So `auto` sets them at ZeRO-3 only.

libtpu reads `LIBTPU_INIT_ARGS` once, when it initialises: `apply` runs before that, in `zerolm train`
before JAX opens its devices and in `zerolm compile --target <TPU>` before the compiler describes the slice.
A user's own LIBTPU_INIT_ARGS wins: only the flags it does not name are appended, and the line `apply`
returns says which were added and which of the user's were kept.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, MutableMapping

VARIABLE = "LIBTPU_INIT_ARGS"
ASYNC_COLLECTIVES = ("--xla_tpu_enable_async_collective_fusion=true",
                     "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
                     "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
                     "--xla_tpu_overlap_compute_collective_tc=true",
                     "--xla_enable_async_all_gather=true")

_applied: Applied | None = None


@dataclasses.dataclass(frozen=True)
class Applied:
    """What `apply` did to LIBTPU_INIT_ARGS."""

    setting: str  # zero.tpu_async_collectives: auto | on
    stages: tuple[int, ...]  # the ZeRO stage(s) it was applied for
    added: tuple[str, ...]  # appended by zerolm
    kept: tuple[str, ...]  # the user's own settings of these flags, left as they are

    def line(self) -> str:
        why = "on" if self.setting == "on" else f"auto at ZeRO-{'/'.join(map(str, self.stages))}"
        added = f"{len(self.added)} flag(s) appended to {VARIABLE}" if self.added else f"none appended to {VARIABLE}"
        kept = f"; yours kept: {' '.join(self.kept)}" if self.kept else ""
        return (f"libtpu: asynchronous collective fusion (zero.tpu_async_collectives={why}): {added}{kept} "
                f"(zero.tpu_async_collectives=off leaves it alone)")


def wanted(setting: str, stages: Iterable[int]) -> bool:
    """Does `zero.tpu_async_collectives` ask for the flags when compiling for these ZeRO stages?"""
    return setting == "on" or (setting == "auto" and 3 in set(stages))


def _name(token: str) -> str:
    """An absl flag's name as written (`--name=value`, `--name`, `--noname`: `noname`), without its dashes."""
    return token.lstrip("-").split("=", 1)[0]


def apply(setting: str, stages: Iterable[int], env: MutableMapping[str, str] = os.environ) -> Applied | None:
    """Append to LIBTPU_INIT_ARGS the asynchronous collective flags it does not set, if `setting` wants them at
    these stages; None where it does not. Call before libtpu initialises: it reads the variable once."""
    global _applied
    stages = tuple(sorted(set(stages)))
    if not wanted(setting, stages):
        return None
    user = env.get(VARIABLE, "").split()
    ours = {_name(f) for f in ASYNC_COLLECTIVES} | {"no" + _name(f) for f in ASYNC_COLLECTIVES}
    kept = tuple(t for t in user if _name(t) in ours)
    named = {_name(t).removeprefix("no") for t in kept}
    added = tuple(f for f in ASYNC_COLLECTIVES if _name(f) not in named)
    if added:
        env[VARIABLE] = " ".join([*user, *added])
    _applied = Applied(setting, stages, added, kept)
    return _applied


def applied() -> Applied | None:
    """What `apply` last did in this process (the run's header says it on a TPU), or None."""
    return _applied


def may_load_libtpu(env: MutableMapping[str, str] = os.environ) -> bool:
    """Could JAX open a TPU in this process (JAX_PLATFORMS unset, empty, or naming tpu)?"""
    platforms = env.get("JAX_PLATFORMS")
    return not platforms or "tpu" in platforms.split(",")
