"""The XLA flags the tests run under, in-process (conftest) and in the processes they start.

The CPU's code generation runs at -O0: the tests' models are tiny, so compiling is most of their time (a
third less at -O0), and nothing they check changes: the HLO, its collectives, and the TPU and GPU
compilers' memory figures are the same. Benchmarks run without it. Imports nothing, so a process can
set its flags before jax is imported."""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
