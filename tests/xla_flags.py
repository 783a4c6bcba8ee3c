"""The XLA flags the tests run under, in-process (conftest) and in the processes they start.

The CPU's code generation runs at -O0, through XLA's older elemental fusion emitters, in one piece: the
tests' models are tiny, so compiling is most of their time (a third less at -O0; then 31% less of the
backend's compile time without the MLIR fusion emitters and the parallel codegen split, whose threads only
contend on two cores: 19.6 s -> 13.5 s over the 18 compiles of a test_model_options case, measured with
jax.monitoring's backend_compile_duration on dev-cpu, jax 0.10.2). Nothing they check changes: the HLO, its
collectives, and the TPU and GPU compilers' memory figures are the same. Benchmarks run without them.
Imports nothing, so a process can set its flags before jax is imported."""

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")


def cpu_flags(devices: int, *, fast_compile: bool = True) -> str:
    """XLA_FLAGS for a test process with `devices` fake CPU devices; `fast_compile=False` for the few that
    compute more than they compile (a run of many steps), which -O0 code would slow down."""
    return f"--xla_force_host_platform_device_count={devices}" + (f" {FAST_COMPILE}" if fast_compile else "")
