"""Cloud TPU Multislice as the TPU compiler writes it: the devices of N slices (aot.target_devices), compiled ahead of
time by libtpu for 2 × v5e-8 (no TPU needed)."""

from __future__ import annotations

import functools
import importlib.util

import pytest

from zerolm.compile import aot

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
