"""Cloud TPU Multislice as the TPU compiler writes it, compiled ahead of time by libtpu for 2 × v5e-8 (no TPU needed):
the devices of N slices (aot.target_devices), the transfers between slices read apart from the collectives inside one
(zerolm.compile.collectives.read_dcn, link_bytes), and their time at a device's share of its host's data-center
network (zerolm.core.hardware.dcn_bw, zerolm.plan.timing.dcn_time)."""

from __future__ import annotations

import functools
import importlib.util

import pytest

from zerolm.compile import aot, step_time
from zerolm.compile import collectives as comms
from zerolm.core import hardware
from zerolm.plan import timing

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]'): no TPU compiler here")


@pytest.mark.parametrize("target, slices, message", [
    ("v5e-8", 0, "--slices: 0: a run spans at least one slice"),
    ("h100-8", 2, "--slices 2: h100-8 is a GPU target; Multislice joins TPU slices"),
    ("v3-8", 2, "--slices 2: v3-8: Cloud TPU Multislice joins slices of TPU v4 and later")])
def test_slices_are_refused_below_one_on_a_gpu_and_before_v4(target, slices, message):
    with pytest.raises(aot.TargetError, match=message):
        aot.target_devices(aot.parse_target(target), slices)


@functools.cache
def _devices(slices: int) -> list:
    return aot.target_devices(aot.parse_target("v5e-8"), slices)


@needs_libtpu
def test_two_slices_are_their_devices_slice_by_slice_and_one_slice_is_as_before():
    assert [d.slice_index for d in _devices(2)] == [0] * 8 + [1] * 8
    assert [d.id for d in _devices(1)] == list(range(8))
    assert not hasattr(_devices(1)[0], "slice_index")  # the single-slice description, unchanged


# The programs below run on a (slice, dp) mesh of v5e-8 slices, each device holding a [1, 1024, 256] bf16 block.
WHOLE = 1024 * 256 * 2  # one device's block, bytes
SHARD = WHOLE // 8  # its 1/8 after a reduce-scatter over the slice's 8 devices


@functools.cache  # once per program: JAX's persistent cache cannot hand a deviceless compile back
def _compiled(body, slices: int) -> str:
    """`body` under shard_map over a (slice, dp) mesh of `slices` v5e-8 slices, compiled by libtpu: one slice's program."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = _devices(slices)
    grid = (mesh_utils.create_hybrid_device_mesh((1, 8), (slices, 1), devices) if slices > 1
            else np.array(devices).reshape(1, 8))
    mesh = Mesh(grid, ("slice", "dp"))
    spec = P(("slice", "dp"))
    x = jax.ShapeDtypeStruct((8 * slices, 1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    step = jax.shard_map(lambda b: body(b[0])[None], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(step).lower(x).compile().as_text()


def _hierarchical(x):
    """An all-reduce over both slices as a ZeRO step over slices does it: reduce-scatter inside the slice, the shard
    all-reduced across slices, gathered again inside the slice."""
    from jax import lax

    shard = lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True)
    return lax.all_gather(lax.psum(shard, "slice"), "dp", axis=0, tiled=True)


def _in_a_loop(x):
    """The cross-slice all-reduce of the shard three times, in a loop the compiler keeps."""
    from jax import lax

    shard = lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True)
    return lax.fori_loop(0, 3, lambda i, s: lax.psum(s, "slice") * 0.5, shard)


@needs_libtpu
def test_a_cross_slice_all_reduce_is_one_dcn_transfer_of_each_devices_shard_apart_from_the_ici_collectives():
    text = _compiled(_hierarchical, 2)
    ops = comms.read(text)
    assert sorted(c.op for c in ops) == ["all-gather", "reduce-scatter"]
    # one program per slice: every replica group is the slice's own 8 devices
    assert all(c.groups == (frozenset(range(8)),) for c in ops)
    (transfer,) = comms.read_dcn(text)  # the send; its recv and the two -dones are not counted again
    assert (transfer.kind, transfer.bytes, transfer.runs, transfer.in_loop, transfer.slices) == \
        ("ALL_REDUCE", SHARD, 1, False, 2)
    assert comms.link_bytes(text) == comms.LinkBytes(ici=SHARD + WHOLE, dcn=SHARD)


@needs_libtpu
def test_a_transfer_in_a_loop_runs_its_trip_count_times():
    text = _compiled(_in_a_loop, 2)
    (transfer,) = comms.read_dcn(text)
    assert (transfer.kind, transfer.bytes, transfer.runs, transfer.in_loop) == ("ALL_REDUCE", SHARD, 3, True)
    assert comms.link_bytes(text) == comms.LinkBytes(ici=SHARD, dcn=3 * SHARD)


@needs_libtpu
def test_one_slice_sends_nothing_over_dcn():
    text = _compiled(_hierarchical, 1)
    assert comms.read_dcn(text) == []
    assert comms.link_bytes(text) == comms.LinkBytes(ici=SHARD + WHOLE, dcn=0)


@needs_libtpu
@pytest.mark.parametrize("collective, kind, sent", [
    ("all_gather", "ALL_GATHER", WHOLE),  # its own block; it receives both slices' (2 × WHOLE)
    ("psum_scatter", "REDUCE_SCATTER", WHOLE),  # the whole block it reduces; it receives its half
    ("psum", "ALL_REDUCE", WHOLE)])  # over the slices alone: no reduce-scatter inside the slice first
def test_each_collective_over_the_slice_axis_alone_is_a_transfer_of_its_kind(collective, kind, sent):
    from jax import lax

    body = {"all_gather": lambda x: lax.all_gather(x, "slice", axis=0, tiled=True)[:1024],
            "psum_scatter": lambda x: lax.psum_scatter(x, "slice", scatter_dimension=0, tiled=True),
            "psum": lambda x: lax.psum(x, "slice")}[collective]
    text = _compiled(body, 2)
    assert [(t.kind, t.bytes) for t in comms.read_dcn(text)] == [(kind, sent)]
    assert comms.read(text) == []  # nothing inside the slice


@needs_libtpu
def test_a_flat_psum_over_both_slices_and_dp_still_crosses_slices_and_is_counted():
    """The control: one psum over ("slice", "dp"), all 16 devices of both slices. The compiler splits it itself:
    an all-reduce of the whole block inside the slice, each device's 1/8 of it all-reduced across slices, and an
    all-gather inside the slice. The DCN transfer is found, with the shard's bytes (not the whole block's)."""
    from jax import lax

    text = _compiled(lambda x: lax.psum(x, ("slice", "dp")), 2)
    assert sorted(c.op for c in comms.read(text)) == ["all-gather", "all-reduce"]
    assert [(t.kind, t.bytes) for t in comms.read_dcn(text)] == [("ALL_REDUCE", SHARD)]
    assert comms.link_bytes(text) == comms.LinkBytes(ici=2 * WHOLE, dcn=SHARD)


@needs_libtpu
def test_the_bytes_census_counts_a_send_as_one_read_of_its_buffer_and_a_recv_as_one_write():
    """A send returns (its buffer, a context, a token): counting operands and result read the shard twice."""
    from zerolm.compile import bytes_moved

    rows = {r.kind: r for r in bytes_moved.census(_compiled(_in_a_loop, 2)).rows}
    assert (rows["send"].executions, rows["send"].bytes) == (3, 3 * SHARD)
    assert (rows["recv"].executions, rows["recv"].bytes) == (3, 3 * SHARD)
    assert "send-done" not in rows and "recv-done" not in rows


@pytest.mark.parametrize("kind, per_device", [
    ("TPU v4", 200e9 / 8 / 4),  # a host's 200 Gbit/s (the scaling book's typical figure) over its 4 chips
    ("TPU v5 lite", 2 * 100e9 / 8 / 8),  # 2 x 100 Gbit/s NICs over 8 chips: 25 Gbit/s, the pod's 6.4 Tbit/s / 256
    ("TPU v5p", 50e9 / 8),  # 50 Gbit/s per chip, as Cloud TPU states it
    ("TPU v6 lite", 4 * 200e9 / 8 / 8),  # 4 x 200 Gbit/s NICs over 8 chips: the pod's 25.6 Tbit/s / 256
    ("TPU v3", None), ("H100", None)])  # no Multislice
def test_each_devices_dcn_bandwidth_is_its_share_of_its_hosts_nics(kind, per_device):
    assert hardware.dcn_bw(kind) == per_device


def test_dcn_bytes_are_charged_at_the_devices_share_of_the_hosts_network():
    # MaxText's 1.3B model on 2 x v5e-64: 0.046 GB per device per step over DCN, 14.7 ms at 3.125 GB/s
    assert timing.dcn_time(hardware.preset("v5e"), 0.046e9) == pytest.approx(0.01472)
    assert timing.dcn_time(hardware.preset("v5p"), 0.046e9) == pytest.approx(0.00736)
    assert timing.dcn_time(hardware.preset("h100"), 0) == 0.0
    with pytest.raises(ValueError, match="h100 states no data-center network bandwidth"):
        timing.dcn_time(hardware.preset("h100"), 1)


@needs_libtpu
def test_a_programs_dcn_bytes_are_charged_apart_from_its_collectives():
    text = _compiled(_in_a_loop, 2)
    v5e = hardware.preset("v5e")
    assert timing.dcn_time(v5e, comms.link_bytes(text).dcn) == pytest.approx(3 * SHARD / 3.125e9)


@needs_libtpu
def test_the_step_model_counts_dcn_bytes_apart_and_times_only_the_collectives_inside_the_slice():
    """The host sends are no collective of the program: the ring times cover the reduce-scatter and the gather alone
    (as on one slice), and the DCN bytes are counted apart, neither ignored nor folded into the ICI bytes."""
    v5e = hardware.preset("v5e")
    two, one = (step_time.comms(_compiled(_hierarchical, n), v5e, 8) for n in (2, 1))
    assert (two.bytes, two.exposed_s, two.dcn_bytes) == (one.bytes, one.exposed_s, SHARD)
    assert one.dcn_bytes == 0 and two.bytes == SHARD + WHOLE
