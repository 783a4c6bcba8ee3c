"""Which of JAX's platforms a zerolm process opens, chosen before JAX starts (`zerolm.cli` calls `choose`).

Left to itself, JAX initialises every backend whose plugin is installed, hardware or not. With the compile
extras (`pip install -e '.[tpu]' -e '.[gpu-compile]'`) on a machine without an accelerator, that is a
20-line traceback from the CUDA plugin's version check ("Unable to load cuFFT") and libtpu's warnings about
TPU worker hostnames, before every command. So when the user has not set JAX_PLATFORMS, zerolm sets it
from the device nodes the machine has, as JAX itself looks for them (jax._src.hardware_utils):

- no accelerator at all: `cpu`;
- NVIDIA GPUs only (/dev/nvidia0, /dev/nvidiactl), with a CUDA plugin installed: `cuda,cpu` (libtpu, if
  installed, is not probed);
- anything else (a TPU's /dev/accel* or /dev/vfio/N, an AMD GPU's /dev/kfd, WSL's /dev/dxg, NVIDIA nodes
  without a CUDA plugin): nothing; JAX chooses, as it would without zerolm.

A JAX_PLATFORMS the user set, even to "" (JAX's own choice), is never touched. Compiling for a TPU or GPU
target (zerolm.compile.aot) needs none of these backends: libtpu and the CUDA plugin compile under `cpu`.
Commands that need shapes but no device (`zerolm plan`, `zerolm compile`) ask for `cpu` alone through
`no_device_needed`, so that they do not take a GPU or TPU a run is using.

On a machine with NVIDIA GPUs that JAX may open, `choose` also turns off XLA's command buffers (its CUDA
graphs) unless the user's XLA_FLAGS sets them: on 125m at micro-batch 16 on an H100 they moved the step by
0.3% (BENCHMARKS.md, "H100"), and they were first blamed for a failure ("cuda_graph_end_capture ... capturing
stream has unjoined work") whose cause turned out to be XLA's autotune cache (`train.compilation_cache`);
on again, they have not been tried since. XLA reads XLA_FLAGS when its backend starts, so this runs before.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from pathlib import Path

VARIABLE = "JAX_PLATFORMS"
_NVIDIA = ("nvidia0", "nvidiactl")  # JAX's own test (hardware_utils.has_visible_nvidia_gpu), less WSL's dxg
_OTHER_ACCELERATORS = ("accel*", "vfio/[0-9]*", "kfd", "dxg")  # TPU v2-v4, TPU v5+, AMD, WSL (any GPU)

# XLA's GPU flag that, empty, records no program into a CUDA graph (module docstring).
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="

_set_by_zerolm = False


def for_machine(dev: Path = Path("/dev")) -> str | None:
    """JAX_PLATFORMS for this machine (module docstring), or None to leave the choice to JAX."""
    if any(any(dev.glob(pattern)) for pattern in _OTHER_ACCELERATORS):
        return None
    if any((dev / name).exists() for name in _NVIDIA):
        return "cuda,cpu" if _cuda_plugin_installed() else None
    return "cpu"


def _cuda_plugin_installed() -> bool:
    """A `jax_plugins.xla_cuda*` module (the jax-cuda12/13 plugins), found without importing JAX."""
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or spec.submodule_search_locations is None:
        return False
    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(spec.submodule_search_locations))


def choose(dev: Path = Path("/dev")) -> None:
    """Set JAX_PLATFORMS for this machine unless the user set it, and XLA's GPU flags where JAX may open an
    NVIDIA GPU (`gpu_flags`). Call before JAX is imported."""
    global _set_by_zerolm
    if VARIABLE not in os.environ:
        platforms = for_machine(dev)
        if platforms is not None:
            os.environ[VARIABLE] = platforms
            _set_by_zerolm = True
    if (flags := gpu_flags(dev, os.environ)) is not None:
        os.environ["XLA_FLAGS"] = flags


def gpu_flags(dev: Path, env) -> str | None:
    """XLA_FLAGS with command buffers off, where this machine has NVIDIA GPUs, JAX_PLATFORMS lets JAX open them
    (unset, empty, or naming cuda or gpu) and the user's XLA_FLAGS does not set the flag; else None."""
    if not any((dev / name).exists() for name in _NVIDIA):
        return None
    chosen = env.get(VARIABLE, "")
    if chosen and not {"cuda", "gpu"} & set(chosen.split(",")):
        return None
    flags = env.get("XLA_FLAGS", "")
    if COMMAND_BUFFERS.split("=")[0] in flags:
        return None
    return f"{flags} {COMMAND_BUFFERS}".strip()


def user_chose() -> bool:
    """Did the user (not `choose`) set JAX_PLATFORMS?"""
    return VARIABLE in os.environ and not _set_by_zerolm


def no_device_needed() -> None:
    """For a command that traces shapes and compiles but runs nothing on a device: the CPU backend alone,
    unless the user chose. Works after `import jax`, up to the first use of a device."""
    if user_chose():
        return
    import jax

    jax.config.update("jax_platforms", "cpu")
