"""The command line's one error rule: a ZerolmError is the user's, one line and its own exit code; any
other exception is a bug of ours, traceback and exit code 70, never 2. And `zerolm --help` imports no JAX; a
command on a machine without an accelerator says nothing about CUDA or TPUs, compile extras installed or not."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, TINY
from zerolm.commands import COMMANDS, run_command
from zerolm.config.section import ConfigError
from zerolm.core import platforms
from zerolm.core.errors import UsageError, ZerolmError
from zerolm.core.exitcodes import EXIT_BUG, EXIT_STORAGE, EXIT_USAGE
from zerolm.core.storage import StorageFault


def _raising(error: BaseException):
    def run(args: argparse.Namespace) -> int:
        raise error
    return run


@pytest.mark.parametrize("error, code", [(UsageError("--top-p 2: must be in (0, 1]"), EXIT_USAGE),
                                         (ConfigError("a.yaml: train.steps: must be positive"), EXIT_USAGE),
                                         (StorageFault("gs://b/ckpt: storage stopped answering"), EXIT_STORAGE)])
def test_a_zerolm_error_is_one_line_and_its_code(capsys, error, code):
    assert run_command(_raising(error), argparse.Namespace()) == code
    assert capsys.readouterr().err == f"error: {error}\n"


@pytest.mark.parametrize("error", [ValueError("a bug of ours"), KeyError("tokens"), AssertionError()])
def test_any_other_exception_is_a_bug_with_its_traceback(capsys, error):
    """Before the one base, commands caught bare ValueError as the user's mistake: a bug was exit 2."""
    assert run_command(_raising(error), argparse.Namespace()) == EXIT_BUG != EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert f"{type(error).__name__}" in err
    assert err.strip().splitlines()[-1].startswith("zerolm: this is a bug in zerolm")


def test_every_error_class_of_zerolm_derives_from_the_base():
    import inspect
    import pkgutil

    import zerolm
    for info in pkgutil.walk_packages(zerolm.__path__, "zerolm."):
        if info.name.startswith(("zerolm.commands", "zerolm.cli")):
            continue
        module = __import__(info.name, fromlist=["_"])
        for name, cls in inspect.getmembers(module, inspect.isclass):  # (private ones are pydantic's ValueErrors)
            if cls.__module__ == info.name and issubclass(cls, Exception) and not name.startswith("_"):
                assert issubclass(cls, ZerolmError), f"{info.name}.{name} is not a ZerolmError"


def test_help_imports_no_jax():
    probe = ("import sys\nfrom zerolm.commands import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('jax', 'orbax', 'flax', 'optax', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert all(name in out for name in COMMANDS)  # ... and still lists every command


def test_every_commands_help_imports_no_jax():
    """`zerolm train --help` took 4.5 s (cold) importing JAX, flax and orbax for its flags. One interpreter
    asks every command for its help in turn: the first to import a heavy module is the one named."""
    probe = textwrap.dedent("""
        import contextlib, io, json, sys
        from zerolm.commands import COMMANDS, main
        heavy = ('jax', 'flax', 'orbax', 'tensorflow')
        seen = {}
        for name in COMMANDS:
            before, help = {m for m in heavy if m in sys.modules}, io.StringIO()
            with contextlib.redirect_stdout(help):
                try:
                    main([name, '--help'])
                    code = None
                except SystemExit as e:
                    code = e.code
            new = sorted(m for m in heavy if m in sys.modules and m not in before)
            seen[name] = [code, new, help.getvalue().startswith(f'usage: zerolm {name}')]
        print(json.dumps(seen))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {name: [0, [], True] for name in COMMANDS}


def test_plans_flag_choices_are_the_planners():
    """commands/plan.py spells them out, as zerolm.plan imports JAX (see the test above)."""
    from zerolm.commands import OneLineParser
    from zerolm.commands import plan as commands_plan
    from zerolm.plan import PRECISIONS, STAGES

    parser = OneLineParser()
    commands_plan.add_arguments(parser)
    choices = {a.dest: tuple(a.choices or ()) for a in parser._actions if a.dest in ("stage", "precision")}
    assert choices == {"stage": STAGES, "precision": tuple(sorted(PRECISIONS))}


def test_a_command_imports_only_its_own_module():
    probe = ("import sys\nfrom zerolm.commands import main\ntry:\n    main(['plot', '--help'])\nexcept SystemExit:\n"
             "    pass\nprint(sorted(m for m in sys.modules if m.startswith('zerolm.commands.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['zerolm.commands.plot']"


# What JAX printed before every command, with the compile extras and no accelerator: the CUDA plugin's failed
# version check (a logged traceback) and libtpu's complaints about TPU worker hosts.
NOISE = ("Traceback", "cuFFT", "CUDA", "plugin configuration error", "hostname")


def test_a_command_says_nothing_of_cuda_or_tpus_on_a_machine_without_them():
    if platforms.for_machine() != "cpu":
        pytest.skip("this machine has an accelerator")
    if importlib.util.find_spec("libtpu") is None and not platforms._cuda_plugin_installed():
        pytest.skip("neither compile extra is installed (libtpu, the CUDA plugin): JAX has nothing to complain of")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the tests' setting would hide it all
    small = ["model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.seq_len=32"]
    # `comms` opens JAX's backends as `train` does (`plan` and `compile` ask for the CPU alone themselves)
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "comms", "--config", str(TINY), "--devices", "1",
                           *[a for s in small for a in ("--set", s)]], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grad" in proc.stdout
    assert [line for line in proc.stderr.splitlines() if any(word in line for word in NOISE)] == []


def test_jax_platforms_follow_the_machines_device_nodes(tmp_path):
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # VFIO's container alone is no TPU
    assert platforms.for_machine(dev) == "cpu"
    (dev / "nvidiactl").touch()
    assert platforms.for_machine(dev) == ("cuda,cpu" if platforms._cuda_plugin_installed() else None)
    for accelerator in ("accel0", "vfio/0", "kfd"):  # a TPU v4, a TPU v5e, an AMD GPU: JAX's own choice
        (dev / accelerator).touch()
        assert platforms.for_machine(dev) is None
        (dev / accelerator).unlink()


@pytest.mark.parametrize("users", [None, "", "tpu"])
def test_a_jax_platforms_the_user_set_is_kept(monkeypatch, tmp_path, users):
    monkeypatch.setattr(platforms, "_set_by_zerolm", False)
    if users is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", users)
    platforms.choose(dev=tmp_path)  # an empty /dev: no accelerator
    assert os.environ["JAX_PLATFORMS"] == ("cpu" if users is None else users)
    assert platforms.user_chose() == (users is not None)


def test_xla_command_buffers_are_off_where_jax_may_open_an_nvidia_gpu(tmp_path, monkeypatch):
    """XLA's CUDA graphs failed a cuDNN attention step on an H100 (platforms' docstring): off by default on a
    machine with NVIDIA GPUs, unless JAX is kept off them or the user's XLA_FLAGS sets the flag."""
    dev = tmp_path / "dev"
    dev.mkdir()
    assert platforms.gpu_flags(dev, {}) is None  # no GPU
    (dev / "nvidia0").touch()
    assert platforms.gpu_flags(dev, {}) == "--xla_gpu_enable_command_buffer="
    assert platforms.gpu_flags(dev, {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}) == (
        "--xla_dump_to=/tmp/d --xla_gpu_enable_command_buffer=")
    assert platforms.gpu_flags(dev, {"JAX_PLATFORMS": "cpu"}) is None
    assert platforms.gpu_flags(dev, {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"}) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    platforms.choose(dev=dev)  # what every command does before importing JAX
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_enable_command_buffer="
