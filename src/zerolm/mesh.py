"""Device mesh construction. The mesh axis names are defined here, once."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DP = "dp"  # data parallel: batch rows and the ZeRO-1 optimizer-state shards
TP = "tp"  # tensor parallel: reserved (size 1 until tensor parallelism lands)


def make_mesh(dp: int, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (dp, tp) mesh. Auto axis types, so jit's sharding propagation (the reshard and update) works."""
    devices = list(devices) if devices is not None else jax.devices()
    if dp * tp != len(devices):
        raise ValueError(f"mesh dp × tp = {dp} × {tp} needs {dp * tp} devices, got {len(devices)}")
    return jax.make_mesh((dp, tp), (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
