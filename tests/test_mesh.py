"""Mesh helpers: this_host_has_first, submesh and host_reads (docs/design.md)."""

import types

import jax
import numpy as np
import pytest

from conftest import requires_devices
from zerolm.parallel import mesh as zmesh
from zerolm.parallel.mesh import DP, TP, host_reads, make_mesh, this_host_has_first


def _fake_mesh(host_of):
    """A (dp, tp) mesh whose device at [i, j] lives on host host_of[i][j]."""
    devices = np.empty((len(host_of), len(host_of[0])), object)
    for (i, j), host in np.ndenumerate(np.array(host_of)):
        devices[i, j] = types.SimpleNamespace(process_index=int(host), id=i * devices.shape[1] + j)
    return types.SimpleNamespace(devices=devices, axis_names=(DP, TP))


# docs/design.md, "Data on a (dp, tp) mesh": mesh (the host of each device) -> per host (reads, dp blocks).
HOST_READS = {
    "1x2": ([[0, 1]], [(True, 1), (False, 0)]),
    "2x1": ([[0], [1]], [(True, 1), (True, 1)]),
    "2x2": ([[0, 1], [0, 1]], [(True, 2), (False, 0)]),
    "4x4": ([[0, 1, 2, 3]] * 4, [(True, 4), (False, 0), (False, 0), (False, 0)]),
}


@pytest.mark.parametrize("name", HOST_READS)
def test_host_reads_per_mesh(name):
    host_of, expected = HOST_READS[name]
    mesh = _fake_mesh(host_of)
    assert [host_reads(mesh, process_index=h) for h in range(len(expected))] == expected
    assert [this_host_has_first(mesh, DP, process_index=h) for h in range(len(expected))] == [e[0] for e in expected]


def test_this_host_has_first_along_tp():
    mesh = _fake_mesh([[0, 0], [1, 1]])  # host 0 holds dp 0, host 1 dp 1
    assert this_host_has_first(mesh, TP, process_index=0) and not this_host_has_first(mesh, TP, process_index=1)


@requires_devices(8)
def test_slice_selects_first_ranks():
    mesh = make_mesh(4, 2)
    first = zmesh.submesh(mesh)[:1, :1]
    assert first.axis_names == (DP, TP) and first.devices.shape == (1, 1)
    assert first.devices[0, 0] == mesh.devices[0, 0]
    assert zmesh.submesh(mesh)[1].devices.tolist() == [mesh.devices[1].tolist()]
    assert zmesh.submesh(mesh)[:, :1].devices.shape == (4, 1)


def test_make_mesh_checks_device_count():
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh(3, 2, devices=jax.devices()[:4])
