"""The training step compiled ahead of time for a TPU slice or an NVIDIA GPU, on any machine: does it fit,
and what does it send?

Both compilers run without their device. libtpu's: `jax.experimental.topologies.get_topology_desc` gives
a slice's devices. XLA's GPU compiler (the `jax-cuda13` plugin, `pip install -e '.[gpu-compile]'`): the
same call with XLA's own description of the GPU (zerolm/core/gpu_targets/, from XLA's source tree) gives one
host's GPUs, under JAX_PLATFORMS=cpu. The step's three programs (grad, reshard, update; zerolm.parallel.zero) are
lowered with the run's abstract inputs and shardings on them and compiled. What comes back is the
compiler's own:

- per program, per device: argument, output, temporary and aliased bytes (`memory_analysis()`);
- the step's **peak** per device: for each program, arguments + outputs + temporaries − aliased, plus
  what lives outside that program while it runs (`zerolm.parallel.build.CompiledStep.memory`, the rule a run
  checks on its own device too). The peak is the largest of the three;
- the usable memory per device: on a TPU, as the compiler states it when a program exceeds it
  (measured by compiling one program too large for any TPU: 15.48 GiB on a v3 core, 30.75 GiB on a v4
  chip); on a GPU, the share of its memory JAX's allocator takes (0.75, or XLA_PYTHON_CLIENT_MEM_FRACTION);
- the collectives of each program (zerolm.compile.collectives), in or out of loops.

A TPU program whose temporaries exceed the HBM does not compile (RESOURCE_EXHAUSTED); it is reported with
the compiler's figure for its temporaries, and the step does not fit. The GPU compiler accepts any size:
the peak against the usable memory is the verdict. Without a GPU there is no autotuning: XLA then picks
its default GEMM configurations (memory is the same either way; zerolm.compile.bytes_moved reads the bytes moved).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerolm.compile import bytes_moved as census_lib
from zerolm.compile import collectives as comms
from zerolm.compile import gpu_time, step_time
from zerolm.config.tree import Config
from zerolm.core.errors import ZerolmError, first_line
from zerolm.core.hardware import GPU_TYPES, GPUS_PER_HOST, TPU_TYPES, gpu_memory_fraction, grid, preset
from zerolm.data.context import ContextPlan
from zerolm.parallel.build import (
    SharedPrograms,
    build_and_compile,
    compile_step,
    describe_remat_choice,
    live_outside,
    step_memory,
)
from zerolm.parallel.mesh import TP, make_mesh
from zerolm.parallel.sharding import shard_bytes
from zerolm.plan.traffic import Prediction, step_predictions


class TargetError(ZerolmError):
    """An unknown or unusable target (bad input)."""


class CompilerUnavailable(ZerolmError):
    """The target's compiler (libtpu, or XLA's GPU compiler in the jax-cuda13 plugin) cannot be loaded here."""


_EXAMPLES = ("v2-8, v3-8, v3-32, v4-8, v4-64, v5litepod-16 (or v5e-16), v5p-128, v6e-64; or a GPU: "
             + ", ".join(GPU_TYPES) + " (one GPU), h100-8 (eight of one host)")


# The planner's device preset for each TPU generation libtpu compiles for (zerolm.core.hardware).
PRESETS = {"v3": "v3-core", "v4": "v4", "v5e": "v5e", "v5p": "v5p"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given, e.g. v3-32, h100-8
    platform: str  # "tpu" | "gpu"
    generation: str  # TPU: libtpu's (v2, v3, v4, v5e, v5p, v6e); GPU: zerolm's GPU type (hardware.GPU_TYPES)
    topology: str  # libtpu's topology name (v3:4x4), or the GPU plugin's (1x1x8: one host of 8 GPUs)
    chip_config: str  # TPU: default | megacore; GPU: ""
    devices: int  # JAX devices of the slice or host


def preset_for(target: Target) -> str | None:
    """The planner's device preset for a target (zerolm.core.hardware.PRESETS), or None if it has none."""
    if target.platform == "gpu":
        return GPU_TYPES[target.generation].preset
    return PRESETS.get(target.generation)


def parse_target(name: str) -> Target:
    """A gcloud TPU accelerator type (`v3-32`, `v5litepod-16`, ...) as a libtpu topology, or a GPU type
    (`h100`, `h100-8`: GPUs of one host) as the GPU plugin's."""
    text = name.strip().lower()
    gpu = re.fullmatch(rf"({'|'.join(sorted(GPU_TYPES, key=len, reverse=True))})(?:-(\d+))?", text)
    if gpu:
        n = int(gpu[2] or 1)
        if not 1 <= n <= GPUS_PER_HOST:
            raise TargetError(f"--target: {name}: zerolm compiles for the GPUs of one host, 1 to {GPUS_PER_HOST} "
                              f"(a multi-host GPU cluster is dp over hosts: compile one host's share)")
        return Target(name, "gpu", gpu[1], f"1x1x{n}", "", n)
    m = re.fullmatch(rf"({'|'.join(TPU_TYPES)})-(\d+)", text)
    if not m:
        raise TargetError(f"--target: {name!r} is not a TPU accelerator type or a GPU zerolm knows; valid ones look "
                          f"like {_EXAMPLES}")
    kind, n = TPU_TYPES[m[1]], int(m[2])
    chips = n // 2 if kind.counts == "cores" else n
    shape = grid(chips, kind.dims) if (kind.counts == "chips" or n % 2 == 0) else None
    if shape is None or (kind.dims == 3 and chips < 4):
        raise TargetError(f"--target: {name}: no {m[1]} slice has {n} {kind.counts}; valid ones look like {_EXAMPLES}")
    return Target(name, "tpu", kind.generation, f"{kind.generation}:{'x'.join(map(str, shape))}", kind.chip_config,
                  kind.devices(n))


def _quiet_libtpu(target: Target) -> None:
    """libtpu probes for a TPU VM (metadata server, worker hosts) unless told what it is: the target."""
    os.environ["TPU_ACCELERATOR_TYPE"] = target.name
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Compiling touches no chip: let other processes (a run on this TPU VM, a parallel test) load libtpu too.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# Cloud TPU Multislice is "only supported on Cloud TPU v4 and later" (https://cloud.google.com/tpu/docs/multislice-introduction).
_NO_MULTISLICE = ("v2", "v3")


def target_devices(target: Target, slices: int = 1) -> list:
    """The slice's or host's devices, from the compiler's topology description (no TPU or GPU needed); `slices` > 1:
    the devices of that many slices of a TPU target joined by the data-center network (Cloud TPU Multislice), slice
    by slice (each device's `slice_index` says which). The compiler builds one program per slice: a collective's
    replica groups stay inside a slice, and what crosses slices is a host transfer (zerolm.compile.collectives.read_dcn)."""
    if slices < 1:
        raise TargetError(f"--slices: {slices}: a run spans at least one slice")
    if slices > 1 and target.platform != "tpu":
        raise TargetError(f"--slices {slices}: {target.name} is a GPU target; Multislice joins TPU slices (a "
                          "multi-host GPU cluster is dp over hosts: compile one host's share)")
    if slices > 1 and target.generation in _NO_MULTISLICE:
        raise TargetError(f"--slices {slices}: {target.name}: Cloud TPU Multislice joins slices of TPU v4 and later")
    return _gpu_devices(target) if target.platform == "gpu" else _tpu_devices(target, slices)


def run_devices(target: Target, config: str, sets: Sequence[str]) -> list:
    """The devices a run of `config` (with `sets`) has on `target`: its mesh.slices slices of it."""
    from zerolm.config.load import load_config

    return target_devices(target, load_config(config, list(sets)).mesh.slices)


def _tpu_devices(target: Target, slices: int = 1) -> list:
    _quiet_libtpu(target)
    from jax.experimental import topologies

    try:
        import libtpu  # noqa: F401  (only to say how to get it when it is missing)
    except ImportError:
        raise CompilerUnavailable("libtpu is not installed, so the TPU compiler cannot run here: "
                                  "pip install -e '.[tpu]' (libtpu pinned to this jax's version)") from None
    many = f" × {slices} slices" if slices > 1 else ""
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                                chip_config_name=target.chip_config,
                                                chips_per_host_bounds=(2, 2, 1), num_slices=slices)
    except Exception as e:  # libtpu's own error, e.g. a version that does not know the generation
        raise CompilerUnavailable(f"libtpu cannot describe {target.name}{many} ({target.topology}): "
                                  f"{first_line(e)}") from None
    if len(topology.devices) != target.devices * slices:
        raise CompilerUnavailable(f"libtpu describes {target.name}{many} with "
                                  f"{len(topology.devices)} devices, not {target.devices * slices}")
    return list(topology.devices)


def _gpu_devices(target: Target) -> list:
    from jax.experimental import topologies

    try:
        import jax_plugins.xla_cuda13  # noqa: F401  (only to say how to get it when it is missing)
    except ImportError:
        raise CompilerUnavailable("XLA's GPU compiler (the jax-cuda13 plugin) is not installed here: "
                                  "pip install -e '.[gpu-compile]' (about 1.2 GB of wheels; no GPU needed)") from None
    try:
        topology = topologies.get_topology_desc(topology_name=target.name, platform="cuda", topology=target.topology,
                                                target_config=GPU_TYPES[target.generation].target_config())
    except Exception as e:
        hint = ("" if os.environ.get("JAX_PLATFORMS") == "cpu" else
                "; on a machine without a GPU, run with JAX_PLATFORMS=cpu so JAX registers the plugin without a driver")
        raise CompilerUnavailable(f"XLA's GPU compiler cannot describe {target.name}: "
                                  f"{first_line(e, 200)}{hint}") from None
    return list(topology.devices)


_HBM = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_TEMPS = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(match: re.Match) -> int:
    return int(float(match[1]) * _UNIT[match[2]])


def usable_bytes(target: Target, device) -> int:
    """The memory a step may use on one device of `target`: on a GPU, the share JAX's allocator takes
    (hardware.gpu_memory_fraction) of the memory XLA's description states; on a TPU, as the compiler
    states it (`_tpu_usable_bytes`)."""
    if target.platform == "gpu":
        return int(GPU_TYPES[target.generation].memory() * gpu_memory_fraction())
    return _tpu_usable_bytes(device)


@functools.cache
def _tpu_usable_bytes(device) -> int:
    """Compile a program that needs more temporaries than any TPU has, and read the HBM from its refusal."""
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    x = jax.ShapeDtypeStruct((2**17,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    try:  # the sort makes the 64 GiB outer product a real buffer
        jax.jit(lambda v: jnp.sort(v[:, None] * v[None, :], axis=0)[0]).lower(x).compile()
    except Exception as e:
        m = _HBM.search(str(e))
        if m:
            return _bytes(m)
        raise
    raise CompilerUnavailable(f"the TPU compiler accepted a 64 GiB program for {device.device_kind}; "
                              "it states no memory limit to check against")


def _staged_contexts(built, usable: int) -> list[dict]:
    """Each staged context's step (train.context_stages; zerolm.data.context) compiled for its shapes, and its peak."""
    cfg = built.cfg
    rows = []
    for context in ContextPlan.of(cfg.train, cfg.model.seq_len).contexts[:-1]:
        micro = cfg.train.micro_batch_size * context.rows
        compiled = compile_step(built.zero, micro, context.seq_len, cfg.accum_steps, keep_refusals=True)
        peak = step_memory(compiled, built.zero, micro, context.seq_len, cfg.accum_steps)
        rows.append({"steps": f"{context.first}-{context.last}", "seq_len": context.seq_len, "rows": context.rows,
                     "micro_rows": micro, "peak_bytes": peak, "fits": peak is not None and peak <= usable})
    return rows


def compile_for(cfg: Config, target: Target, devices: list, *, census: bool = False,
                shared: SharedPrograms | None = None) -> CompileReport:
    """Compile `cfg`'s step (vocab resolved, mesh dp × tp = the slice's devices) for `target`; `shared`: the
    programs of a search's earlier compiles that this one's shapes do not change (SharedPrograms)."""
    mesh = make_mesh(cfg.dp, cfg.mesh.tp, devices, cfg.mesh.slices)
    usable = usable_bytes(target, devices[0])
    built = build_and_compile(cfg, mesh, usable, shared=shared)  # model.remat auto: the least recomputed that fits
    cfg, model, zero, compiled = built.cfg, built.model, built.zero, built.compiled
    micro, seq, accum = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps
    memory = compiled.memory(zero, micro, seq, accum)
    outside = live_outside(zero, micro, seq, accum)
    report_programs: dict[str, dict[str, Any]] = {}
    for name, args in zero.program_inputs(micro, seq, accum).items():
        row: dict[str, Any] = {"error": None}
        if name not in compiled.refused:
            row.update(memory[name])
        else:  # the compiler's refusal of a program too large is the answer, not a crash
            refusal = compiled.refused[name]
            temps = _TEMPS.search(refusal)
            if temps is None:
                raise RuntimeError(refusal)
            row.update(argument_bytes=shard_bytes(args), output_bytes=None, temp_bytes=_bytes(temps),
                       alias_bytes=None, live_outside_bytes=outside[name], error=first_line(refusal))
            row["peak_bytes"] = row["argument_bytes"] + row["temp_bytes"] + outside[name]  # at least
        row["compile_s"] = round(compiled.seconds[name], 2)
        report_programs[name] = row
    texts = compiled.texts
    links = sum((comms.link_bytes(t) for t in texts.values()), comms.LinkBytes())
    rows = comms.traffic(texts, dict(mesh.shape))
    predicted = step_predictions(cfg, model, zero)
    comms.compare(rows, predicted)
    peak_program = max(report_programs, key=lambda p: report_programs[p]["peak_bytes"])
    peak = report_programs[peak_program]["peak_bytes"]
    contexts = _staged_contexts(built, usable)
    fits = peak <= usable and all(r["error"] is None for r in report_programs.values()) and \
        all(c["fits"] for c in contexts)
    return CompileReport(
        config=cfg.name, target=target.name, topology=target.topology, device_kind=devices[0].device_kind,
        devices=len(devices), mesh=dict(mesh.shape), micro_batch=micro, accum_steps=accum, remat=cfg.model.remat,
        grad_reduce=cfg.zero.grad_reduce, stage=zero.stage, precision=cfg.zero.precision, attention=model.cfg.attention,
        scatter=zero.scatter, scatter_inner=zero.scatter_inner, programs=report_programs, peak_program=peak_program,
        peak_bytes_per_device=peak, usable_bytes_per_device=usable, fits=fits, collectives=rows, predicted=predicted,
        # Pallas kernels (Mosaic custom calls) per program: the flash attention's forward and backward.
        pallas_kernels={name: text.count('custom_call_target="tpu_custom_call"') for name, text in texts.items()},
        compile_s=round(sum(r["compile_s"] for r in report_programs.values()), 2),
        memory_fraction=gpu_memory_fraction() if target.platform == "gpu" else None,
        scan_layers=bool(model.cfg.scan_layers), remat_choice=describe_remat_choice(built, usable),
        census=census_lib.merge(census_lib.census(t) for t in texts.values()) if census else None,
        step_model=(step_time.of_step(built, preset(device_preset)) if (device_preset := preset_for(target))
                    and not compiled.refused
                    else None),
        gpu_step=_gpu_step(target, texts, len(devices)) if not compiled.refused else None,
        contexts=contexts, slices=cfg.mesh.slices,
        ici_bytes_per_device_per_step=links.ici, dcn_bytes_per_device_per_step=links.dcn,
        async_collectives=[{"program": name, "ops": list(a.ops), "in_loop": a.in_loop, "bytes": a.bytes,
                            "overlaps": list(a.overlaps)} for name, text in texts.items()
                           for a in comms.read_async(text)])


def _gpu_step(target: Target, texts: dict[str, str], devices: int) -> gpu_time.GpuStep | None:
    """A GPU target's step modeled kernel by kernel on its card, its collectives over the preset's links."""
    if target.platform != "gpu":
        return None
    gpu = GPU_TYPES[target.generation]
    return gpu_time.step(texts, gpu_time.card(gpu), preset(gpu.preset) if gpu.preset else None, devices)


@dataclasses.dataclass
class CompileReport:
    """What `zerolm compile` says: per-program memory per device, the step's peak against the usable HBM,
    and the collectives beside the planner's predictions."""

    config: str
    target: str
    topology: str
    device_kind: str
    devices: int
    mesh: dict[str, int]
    micro_batch: int
    accum_steps: int
    remat: str
    grad_reduce: str
    stage: int
    precision: str
    attention: str
    scatter: str
    scatter_inner: int | None
    programs: dict[str, dict]  # per program: argument/output/temp/alias/outside/peak bytes, compile_s, error
    peak_program: str
    peak_bytes_per_device: int
    usable_bytes_per_device: int
    fits: bool
    collectives: list[comms.Traffic]
    predicted: list[Prediction]
    pallas_kernels: dict[str, int]
    compile_s: float
    memory_fraction: float | None  # GPU: the share of its memory JAX's allocator takes (the usable bytes')
    scan_layers: bool  # the layer loop compiled: a scan, or unrolled (model.scan_layers as the target resolves it)
    remat_choice: str | None  # model.remat auto: what each policy needed and which was taken
    census: census_lib.Census | None = None  # where the step's bytes go (--census)
    # each collective the schedule split into a start and a done (zerolm.compile.collectives.read_async): program, ops,
    # in_loop, bytes, the compute between them (libtpu: zero.tpu_async_collectives, zerolm.core.tpu_flags)
    async_collectives: list[dict] = dataclasses.field(default_factory=list)
    # zerolm.compile.step_time's model of the step on the target's planner preset (None: no preset, or a refused program)
    step_model: step_time.StepModel | None = None
    # train.context_stages: each staged context's step compiled (steps, seq_len, rows per sample, peak, fits)
    contexts: list[dict] = dataclasses.field(default_factory=list)
    # a GPU target's step modeled kernel by kernel (zerolm.compile.gpu_time; None: a TPU, or a refused program)
    gpu_step: gpu_time.GpuStep | None = None
    slices: int = 1  # mesh.slices: the target's slices joined by the data-center network
    # bytes each device sends per step over its slice's own links (ICI: the collectives' results) and to other slices
    # (DCN: the Multislice transfers' sends; 0 on one slice), zerolm.compile.collectives.link_bytes
    ici_bytes_per_device_per_step: int = 0
    dcn_bytes_per_device_per_step: int = 0

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "collectives": [r.as_dict() for r in self.collectives],
                "predicted": [p.to_json() for p in self.predicted],
                "census": self.census.to_json() if self.census else None,
                "step_model": self.step_model.to_json() if self.step_model else None,
                "gpu_step": self.gpu_step.to_json() if self.gpu_step else None}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


_SCATTER = {"collective": "", "ring": " (as a ring of collective-permutes)",
            "two_stage": " (in two stages, the second over {scatter_inner} dp positions)"}


def describe(report: CompileReport) -> list[str]:
    r = report.to_json()
    lines = [f"compile: {r['config']} for {'' if r['slices'] == 1 else str(r['slices']) + ' × '}{r['target']} "
             f"({r['topology']}, {r['devices']} × {r['device_kind']}), "
             f"mesh {' × '.join(f'{k}={v}' for k, v in r['mesh'].items())}, micro-batch {r['micro_batch']} × "
             f"{r['accum_steps']} accumulation step(s), remat {r['remat']}, layers "
             f"{'in a scan' if r['scan_layers'] else 'unrolled'}, attention {r['attention']}, "
             f"precision {r['precision']}, ZeRO-{r['stage']}, grad_reduce={r['grad_reduce']}"
             + (_SCATTER[r["scatter"]].format(**r) if r["grad_reduce"] == "reduce_scatter" else ""),
             "per device      arguments      outputs  temporaries      aliased  live outside         peak   compile"]
    for name, p in r["programs"].items():
        lines.append(f"  {name:8s} {_gib(p['argument_bytes']):>12s} {_gib(p['output_bytes']):>12s} "
                     f"{_gib(p['temp_bytes']):>12s} {_gib(p['alias_bytes']):>12s} {_gib(p['live_outside_bytes']):>13s} "
                     f"{_gib(p['peak_bytes']):>12s} {p['compile_s']:7.1f} s"
                     + (f"   the compiler: {p['error']}" if p["error"] else ""))
    lines.append("  (peak = arguments + outputs + temporaries - aliased + what lives outside the program: the "
                 "optimizer state during grad, it and the gradient during reshard; the update takes the old parameters, donated)")
    if r["slices"] > 1:
        lines.append(f"{r['slices']} slices of {r['target']}: per device per step, "
                     f"{r['dcn_bytes_per_device_per_step'] / 1e9:.4f} GB to other slices over the data-center network "
                     f"(DCN) and {r['ici_bytes_per_device_per_step'] / 1e9:.4f} GB over its slice's ICI")
    lines.append("collectives per step (bytes per device, per HLO instruction):")
    lines += ["  " + line for line in comms.describe(report.collectives, list(r["programs"]))]
    for p in report.predicted:
        if p.program == "grad" and p.bytes > 4 and TP not in (p.span or []):
            found = "none" if p.found_bytes_per_step is None else f"{p.found_bytes_per_step:,}"
            lines.append(f"  {p.op} over {'+'.join(p.span or ['dp'])}{' in the loop' if p.in_loop else ''}: {found} "
                         f"bytes per device per step; zerolm plan predicts {p.bytes_per_step:,}"
                         + ("" if p.found_bytes_per_step is None else f" ({p.found_bytes_per_step / p.bytes_per_step:.1%})"))
    overlapped = [a for a in report.async_collectives if a["overlaps"]]
    lines.append(f"asynchronous collectives with compute between their start and done: {len(overlapped)}"
                 + (f" ({sum(a['in_loop'] for a in overlapped)} in a loop, {sum(a['bytes'] for a in overlapped):,} "
                    f"bytes per device per execution)" if overlapped else " (every collective blocks until done)"))
    if report.remat_choice:
        lines.append(report.remat_choice)
    if report.step_model is not None:
        lines.append(report.step_model.describe())
    if report.gpu_step is not None:
        lines.append(report.gpu_step.describe())
    for c in report.contexts:
        lines.append(f"context stage, steps {c['steps']}: {c['seq_len']} tokens, {c['micro_rows']} rows per device per "
                     f"micro-step: peak {_gib(c['peak_bytes'])} per device"
                     + ("" if c["fits"] else " DOES NOT FIT"))
    if report.census is not None:
        lines += census_lib.describe(report.census)
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    usable = (f" ({r['memory_fraction']:.2f} of its memory: JAX's allocator share, XLA_PYTHON_CLIENT_MEM_FRACTION)"
              if r["memory_fraction"] is not None else "")
    lines.append(f"{verdict}: peak {_gib(r['peak_bytes_per_device'])} per device ({r['peak_program']}) of "
                 f"{_gib(r['usable_bytes_per_device'])} usable on {r['device_kind']}{usable}; compiled in "
                 f"{r['compile_s']:.0f} s")
    return lines
