"""The training step compiled ahead of time for a TPU slice, on any machine: does it fit, and what does it send?

libtpu's compiler runs without a TPU: `jax.experimental.topologies.get_topology_desc` gives a slice's
devices, and the step's three programs (grad, reshard, update; zerolm.zero) are lowered with the run's
abstract inputs and shardings on them and compiled. What comes back is the compiler's own:

- per program, per device: argument, output, temporary and aliased bytes (`memory_analysis()`);
- the step's **peak** per device: for each program, arguments + outputs + temporaries − aliased, plus
  what lives outside that program while it runs: the optimizer state during `grad`; the optimizer
  state and `grad`'s output (the gradient) during `reshard`; the old replicated parameters during
  `update` (it takes only their dp-sharded view). The peak is the largest of the three;
- the usable HBM per device, as the compiler states it when a program exceeds it (measured by
  compiling one program too large for any TPU: 15.48 GiB on a v3 core, 30.75 GiB on a v4 chip);
- the collectives of each program (zerolm.comms), in or out of loops.

A program whose temporaries exceed the HBM does not compile (RESOURCE_EXHAUSTED); it is reported with
the compiler's figure for its temporaries, and the step does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from zerolm import comms
from zerolm.config import Config
from zerolm.mesh import make_mesh
from zerolm.sharding import shard_bytes
from zerolm.step import build_step


class TargetError(ValueError):
    """An unknown or unusable target (bad input)."""


class CompilerUnavailable(RuntimeError):
    """libtpu cannot be loaded on this machine."""


# gcloud accelerator-type generations: (topology name in libtpu, what N counts, chip config, dimensions).
# v2/v3 count TensorCores (2 per chip, one JAX device each); v4/v5p count TensorCores but a chip is one
# JAX device ("megacore"); v5e/v6e count chips (one core each).
_GENERATIONS = {"v2": ("v2", "cores", "default", 2), "v3": ("v3", "cores", "default", 2),
                "v4": ("v4", "cores", "megacore", 3), "v5p": ("v5p", "cores", "megacore", 3),
                "v5e": ("v5e", "chips", "default", 2), "v5litepod": ("v5e", "chips", "default", 2),
                "v6e": ("v6e", "chips", "default", 2)}
_EXAMPLES = "v2-8, v3-8, v3-32, v4-8, v4-64, v5litepod-16 (or v5e-16), v5p-128, v6e-64"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given, e.g. v3-32
    generation: str  # libtpu's: v2, v3, v4, v5e, v5p, v6e
    topology: str  # libtpu's topology name, e.g. v3:4x4
    chip_config: str  # default | megacore
    devices: int  # JAX devices of the slice


def _grid(chips: int, dims: int) -> tuple[int, ...] | None:
    """The slice's chip grid as Cloud TPU builds it: 2-D x ≤ y ≤ 2x; 3-D from 2x2x1, z doubled to 2x2x4,
    then y, x, z in turn (v4-64 is 2x4x4, v4-128 4x4x4, v4-256 4x4x8)."""
    if chips < 1 or chips & (chips - 1):
        return None
    if dims == 2:
        x = 1 << (chips.bit_length() - 1) // 2
        return (x, chips // x)
    shape = [1, 1, 1] if chips == 1 else [2, 2, 1] if chips >= 4 else None
    if shape is None:
        return None
    order = iter([2, 2] + [1, 0, 2] * 10)
    while shape[0] * shape[1] * shape[2] < chips:
        shape[next(order)] *= 2
    return tuple(shape)


def parse_target(name: str) -> Target:
    """A gcloud accelerator type (`v3-32`, `v5litepod-16`, ...) as a libtpu topology."""
    m = re.fullmatch(r"(v2|v3|v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if not m:
        raise TargetError(f"--target: {name!r} is not a TPU accelerator type; valid ones look like {_EXAMPLES}")
    generation, counts, chip_config, dims = _GENERATIONS[m[1]]
    n = int(m[2])
    chips = n // 2 if counts == "cores" else n
    grid = _grid(chips, dims) if (counts == "chips" or n % 2 == 0) else None
    if grid is None or (dims == 3 and chips < 4):
        raise TargetError(f"--target: {name}: no {m[1]} slice has {n} {counts}; valid ones look like {_EXAMPLES}")
    devices = n if generation in ("v2", "v3") else chips
    return Target(name, generation, f"{generation}:{'x'.join(map(str, grid))}", chip_config, devices)


def _quiet_libtpu(target: Target) -> None:
    """libtpu probes for a TPU VM (metadata server, worker hosts) unless told what it is: the target."""
    os.environ["TPU_ACCELERATOR_TYPE"] = target.name
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Compiling touches no chip: let other processes (a run on this TPU VM, a parallel test) load libtpu too.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def target_devices(target: Target) -> list:
    """The slice's devices, from libtpu's topology description (no TPU needed)."""
    _quiet_libtpu(target)
    from jax.experimental import topologies

    try:
        import libtpu  # noqa: F401  (only to say how to get it when it is missing)
    except ImportError:
        raise CompilerUnavailable("libtpu is not installed, so the TPU compiler cannot run here: "
                                  "pip install -e '.[tpu]' (libtpu pinned to this jax's version)") from None
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                                chip_config_name=target.chip_config,
                                                chips_per_host_bounds=(2, 2, 1), num_slices=1)
    except Exception as e:  # libtpu's own error, e.g. a version that does not know the generation
        raise CompilerUnavailable(f"libtpu cannot describe {target.name} ({target.topology}): "
                                  f"{str(e).splitlines()[0]}") from None
    if len(topology.devices) != target.devices:
        raise CompilerUnavailable(f"libtpu describes {target.name} with {len(topology.devices)} devices, "
                                  f"not {target.devices}")
    return list(topology.devices)


_HBM = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_TEMPS = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(match: re.Match) -> int:
    return int(float(match[1]) * _UNIT[match[2]])


@functools.cache
def usable_bytes(device) -> int:
    """The HBM a program may use on one device, as the compiler states it: compile a program that
    needs more temporaries than any TPU has, and read the figure from its refusal."""
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


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}


def compile_for(cfg: Config, target: Target, devices: list) -> dict:
    """Compile `cfg`'s step (vocab resolved, mesh dp × tp = the slice's devices) for `target`."""
    mesh = make_mesh(cfg.dp, cfg.mesh.tp, devices)
    model, zero, _ = build_step(cfg, mesh)
    micro, seq, accum = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps
    programs = zero.programs(micro, seq, accum)
    params, (views, _, opt_state, _) = programs["grad"][1][0], programs["update"][1]
    grads = params if cfg.zero.grad_reduce == "all_reduce" else views  # grad's output, by its reduction
    outside = {"grad": shard_bytes(opt_state), "reshard": shard_bytes(opt_state) + shard_bytes(grads),
               "update": shard_bytes(params)}
    report_programs, texts = {}, {}
    for name, (fn, args) in programs.items():
        t0 = time.perf_counter()
        row = {"live_outside_bytes": outside[name], "error": None}
        try:
            compiled = fn.lower(*args).compile()
            row.update(_memory(compiled))
            texts[name] = compiled.as_text()
            row["peak_bytes"] = (row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
                                 - row["alias_bytes"] + outside[name])
        except Exception as e:  # the compiler's refusal of a program too large is the answer, not a crash
            temps = _TEMPS.search(str(e))
            if "RESOURCE_EXHAUSTED" not in str(e) or temps is None:
                raise
            row.update(argument_bytes=shard_bytes(args), output_bytes=None, temp_bytes=_bytes(temps),
                       alias_bytes=None, error=str(e).splitlines()[0].strip())
            row["peak_bytes"] = row["argument_bytes"] + row["temp_bytes"] + outside[name]  # at least
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        report_programs[name] = row
    rows = comms.traffic(texts, dict(mesh.shape))
    row_dicts = [r.as_dict() for r in rows]
    predicted = comms.predicted_traffic(cfg, model, zero)
    comms.attach_predictions(row_dicts, predicted)
    usable = usable_bytes(devices[0])
    peak_program = max(report_programs, key=lambda p: report_programs[p]["peak_bytes"])
    peak = report_programs[peak_program]["peak_bytes"]
    fits = peak <= usable and all(r["error"] is None for r in report_programs.values())
    return {"config": cfg.name, "target": target.name, "topology": target.topology,
            "device_kind": devices[0].device_kind, "devices": len(devices), "mesh": dict(mesh.shape),
            "micro_batch": micro, "accum_steps": accum, "remat": cfg.model.remat, "grad_reduce": cfg.zero.grad_reduce,
            "precision": cfg.zero.precision, "attention": model.cfg.attention, "scatter": zero.scatter,
            "scatter_inner": zero.scatter_inner,
            "programs": report_programs, "peak_program": peak_program, "peak_bytes_per_device": peak,
            "usable_bytes_per_device": usable, "fits": fits,
            "collectives": [{k: v for k, v in r.items() if k != "predicted"} for r in row_dicts],
            "predicted": predicted, "_rows": rows,
            # Pallas kernels (Mosaic custom calls) per program: the flash attention's forward and backward.
            "pallas_kernels": {name: text.count('custom_call_target="tpu_custom_call"') for name, text in texts.items()},
            "compile_s": round(sum(r["compile_s"] for r in report_programs.values()), 2)}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


_SCATTER = {"collective": "", "ring": " (as a ring of collective-permutes)",
            "two_stage": " (in two stages, the second over {scatter_inner} dp positions)"}


def describe(r: dict) -> list[str]:
    lines = [f"compile: {r['config']} for {r['target']} ({r['topology']}, {r['devices']} × {r['device_kind']}), "
             f"mesh {' × '.join(f'{k}={v}' for k, v in r['mesh'].items())}, micro-batch {r['micro_batch']} × "
             f"{r['accum_steps']} accumulation step(s), remat {r['remat']}, attention {r['attention']}, "
             f"precision {r['precision']}, grad_reduce={r['grad_reduce']}"
             + (_SCATTER[r["scatter"]].format(**r) if r["grad_reduce"] == "reduce_scatter" else ""),
             "per device      arguments      outputs  temporaries      aliased  live outside         peak   compile"]
    for name, p in r["programs"].items():
        lines.append(f"  {name:8s} {_gib(p['argument_bytes']):>12s} {_gib(p['output_bytes']):>12s} "
                     f"{_gib(p['temp_bytes']):>12s} {_gib(p['alias_bytes']):>12s} {_gib(p['live_outside_bytes']):>13s} "
                     f"{_gib(p['peak_bytes']):>12s} {p['compile_s']:7.1f} s"
                     + (f"   the compiler: {p['error']}" if p["error"] else ""))
    lines.append("  (peak = arguments + outputs + temporaries - aliased + what lives outside the program: the "
                 "optimizer state during grad, it and the gradient during reshard, the old parameters during update)")
    lines.append("collectives per step (bytes per device, per HLO instruction):")
    lines += ["  " + line for line in comms.describe(r["_rows"], list(r["programs"]))]
    for p in r["predicted"]:
        if p["program"] == "grad" and p["bytes"] > 4:
            found = "none" if p["found_bytes"] is None else f"{p['found_bytes']:,}"
            lines.append(f"  gradient reduction ({p['op']} over {'+'.join(p['span'])}): {found} bytes per device; zerolm plan predicts "
                         f"{p['bytes']:,}" + ("" if p["found_bytes"] is None else f" ({p['found_bytes'] / p['bytes']:.1%})"))
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: peak {_gib(r['peak_bytes_per_device'])} per device ({r['peak_program']}) of "
                 f"{_gib(r['usable_bytes_per_device'])} usable on {r['device_kind']}; compiled in {r['compile_s']:.0f} s")
    return lines
