"""A built step looked at from outside, for benchmarks and tests: its batch laid out by hand, the bytes each
device holds, and an instruction counted inside and outside the compiled program's loops."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerolm.compile import hlo


def to_accum_layout(rows: np.ndarray, n_devices: int, accum: int, micro: int) -> np.ndarray:
    """(n_devices · accum · micro, T) rows -> (accum, n_devices · micro, T): device d's contiguous block
    of rows, split into `accum` micro-batches of `micro`."""
    T = rows.shape[-1]
    return rows.reshape(n_devices, accum, micro, T).transpose(1, 0, 2, 3).reshape(accum, n_devices * micro, T)


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes of a (sharded) pytree that each local device actually holds."""
    per_device: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


def ops_in_loops(hlo_text: str, opcode: str) -> tuple[int, int]:
    """(instructions of `opcode` inside a while body or what it calls, instructions of it elsewhere)."""
    program = hlo.program(hlo_text)
    counts = [0, 0]
    for name, ins in program.instructions():
        counts[name not in program.in_loop] += ins.opcode == opcode
    return counts[0], counts[1]
