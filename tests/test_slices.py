"""Several slices (`mesh.slices`, Cloud TPU Multislice): the config's refusals, the (slice, dp, tp) mesh, and runs
whose processes are grouped as slices giving what one slice gives. The step's own equalities and collectives
are in test_zero_stages.py; the compiled multi-slice TPU step's data-center-network bytes in test_dcn.py."""

from types import SimpleNamespace

import jax
import pytest

from conftest import TINY, requires_devices
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.parallel.mesh import SLICE, SliceError, data_axes, data_ranks, make_mesh, slice_groups


@pytest.mark.parametrize("overrides, devices, message", [
    (["mesh.slices=3"], 8, "mesh.slices: 3 slices do not divide the 8 devices"),
    (["mesh.slices=2", "mesh.dp=8"], 8, "mesh.dp: dp × tp = 8 × 1 = 8 devices, but each of the 2 slices has 4: dp and "
                                        "tp are the mesh inside one slice (dp may not cross a slice)"),
    (["mesh.slices=2", "mesh.tp=8"], 8, "mesh.tp: tp=8 does not divide the 4 devices of each of 2 slices"),
    (["mesh.slices=0"], 8, "mesh.slices: Input should be greater than 0 (got 0)"),
    (["mesh.slices=2", "train.global_batch_size=12", "train.micro_batch_size=2"], 8,
     "train.global_batch_size: 12 is not divisible by micro_batch_size × slices × dp = 2 × 2 × 4 = 16"),
])
def test_a_bad_slice_count_is_one_line_naming_the_key(overrides, devices, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides, device_count=devices)
    assert str(e.value).endswith(message) and "\n" not in str(e.value), str(e.value)


def test_dp_auto_is_each_slices_devices_less_tp_and_the_batch_splits_over_slices_and_dp():
    cfg = load_config(TINY, ["mesh.slices=2", "mesh.tp=2", "train.global_batch_size=16", "train.micro_batch_size=2"],
                      device_count=8)
    assert (cfg.mesh.slices, cfg.dp, cfg.mesh.tp, cfg.data_ranks, cfg.device_count) == (2, 2, 2, 4, 8)
    assert cfg.accum_steps == 2  # 16 rows over 4 data ranks, 2 a micro-batch


@requires_devices(8)
def test_the_mesh_lays_each_slice_on_its_own_devices():
    """In one process (no slice_index, one process): the devices in halves, slice-major; dp and tp inside each."""
    mesh = make_mesh(2, 2, jax.devices()[:8], slices=2)
    assert mesh.axis_names == (SLICE, "dp", "tp") and dict(mesh.shape) == {SLICE: 2, "dp": 2, "tp": 2}
    assert [sorted(d.id for d in mesh.devices[s].flat) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert data_axes(mesh) == (SLICE, "dp") and data_ranks(mesh) == 4
    flat = make_mesh(8, 1, jax.devices()[:8])
    assert data_axes(flat) == "dp" and data_ranks(flat) == 8


def test_tpu_devices_are_grouped_by_their_slice_and_a_wrong_count_is_refused():
    devices = [SimpleNamespace(id=i, slice_index=i % 2, process_index=0) for i in range(8)]  # interleaved on purpose: grouped by slice_index, not by position
    assert [[d.id for d in g] for g in slice_groups(devices, 2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(SliceError, match=r"^mesh.slices: 4, but the devices are in 2 slice\(s\) \(0, 1\); set "
                                         r"mesh.slices to 2$"):
        slice_groups(devices, 4)
