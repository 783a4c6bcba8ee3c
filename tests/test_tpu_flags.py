"""libtpu's asynchronous collective fusion set by zerolm (zerolm.core.tpu_flags): where, and a user's flags win.
Its effect on the compiled schedule: tests/test_compile.py (ZeRO-3 on v3-8, with and without)."""

from __future__ import annotations

import argparse
import os

import pytest

from conftest import TINY
from zerolm.commands import train as train_command
from zerolm.config.load import load_config
from zerolm.core import tpu_flags

ALL = " ".join(tpu_flags.ASYNC_COLLECTIVES)


@pytest.mark.parametrize("setting, stages, on", [
    ("auto", [3], True), ("auto", [1], False), ("auto", [2], False), ("auto", [1, 2, 3], True),
    ("on", [1], True), ("off", [3], False)])
def test_auto_wants_the_flags_at_zero_3_only(setting, stages, on):
    env: dict[str, str] = {}
    applied = tpu_flags.apply(setting, stages, env)
    assert (applied is not None) == on
    assert env == ({tpu_flags.VARIABLE: ALL} if on else {})


def test_the_users_own_flags_win_and_the_line_says_so():
    user = "--xla_tpu_enable_async_collective_fusion=false --noxla_enable_async_all_gather --other_flag=1"
    env = {tpu_flags.VARIABLE: user}
    applied = tpu_flags.apply("auto", [3], env)
    assert applied is not None
    assert applied.kept == ("--xla_tpu_enable_async_collective_fusion=false", "--noxla_enable_async_all_gather")
    assert env[tpu_flags.VARIABLE] == " ".join([user, *tpu_flags.ASYNC_COLLECTIVES[1:4]])
    line = applied.line()
    assert "\n" not in line and "auto at ZeRO-3" in line and "3 flag(s) appended" in line
    assert "yours kept: --xla_tpu_enable_async_collective_fusion=false --noxla_enable_async_all_gather" in line


def test_yaml_on_and_off_read_as_the_settings():
    """YAML 1.1 reads a bare on/off as a boolean."""
    for word in ("on", "off", "auto"):
        assert load_config(TINY, [f"zero.tpu_async_collectives={word}"]).zero.tpu_async_collectives == word


@pytest.mark.parametrize("platforms, stage, expected", [
    ("", 3, ALL), ("tpu,cpu", 3, ALL), ("cpu", 3, None), ("", 1, None)])
def test_zerolm_train_sets_them_before_jax_opens_a_tpu(monkeypatch, platforms, stage, expected):
    """`zerolm train` reads zero.stage before the devices open (mesh.dp auto unresolved), and only where JAX may
    open a TPU."""
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.delenv(tpu_flags.VARIABLE, raising=False)
    args = argparse.Namespace(config=str(TINY), set=[f"zero.stage={stage}"], profile=None)
    train_command._libtpu_flags(args)
    assert os.environ.get(tpu_flags.VARIABLE) == expected
