"""The training step from a config: the model, the optimizer and its schedule, and the ZeRO step on a mesh;
and the one way to compile it ahead of time.

One place below everything that needs the step as a run would build it: `zerolm train`, `zerolm comms`,
`zerolm compile`, the planner's exact bytes, the benchmarks and the tests. No data, no checkpoints, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
from jax.sharding import Mesh

from zerolm.config.tree import Config
from zerolm.core.errors import ZerolmError, first_line, is_out_of_memory
from zerolm.model import decoder as gpt_model
from zerolm.model import losses
from zerolm.model.dropout import has_dropout
from zerolm.parallel import auto, sharding
from zerolm.parallel.optim import make_optimizer
from zerolm.parallel.zero import Objective, Programs, Zero


def resolved(cfg: Config, mesh: Mesh) -> Config:
    """`cfg` with its model's `auto` settings decided for the mesh's devices, its tp and the ZeRO stage
    (zerolm.parallel.auto.model_settings); the devices may be a TPU slice or GPUs compiled for ahead of time. An
    attention they cannot run is a ConfigError."""
    return cfg.model_copy(update={"model": auto.model_settings(cfg.model, auto.Where.of_mesh(mesh, cfg.zero.stage))})


def build_step(cfg: Config, mesh: Mesh, rules=sharding.RULES) -> tuple[gpt_model.GPT, Zero, functools.partial]:
    """The model, its ZeRO step (zero.stage) on `mesh` and its init function, as the config says (vocab resolved;
    the model's `auto` settings resolved for the mesh: `resolved`). `rules`: the logical-axis rule table
    (zerolm.parallel.sharding)."""
    model_cfg = auto.model_settings(cfg.model, auto.Where.of_mesh(mesh, cfg.zero.stage))
    cfg = cfg.model_copy(update={"model": model_cfg})
    model = gpt_model.GPT(model_cfg)
    init_fn = functools.partial(gpt_model.init_params, model)
    tx, schedule = make_optimizer(cfg.train)
    objective = Objective(functools.partial(losses.lm_loss, model), jax.eval_shape(init_fn, jax.random.key(0)),
                          gpt_model.logical_axes(model), cfg.train.seed if has_dropout(cfg.model) else None)
    zero = Zero(mesh, objective, tx, cfg.zero, lr_schedule=schedule, rules=rules)
    return model, zero, init_fn


@dataclasses.dataclass
class CompiledStep:
    """The step's programs compiled ahead of time for a run's shapes (`compile_step`)."""

    programs: Programs  # jax.stages.Compiled each (None: not run by the step, or refused)
    seconds: dict[str, float]  # compile time per program
    refused: dict[str, str]  # programs the compiler refused for their size (keep_refusals): its message

    def memory(self, zero: Zero, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, dict[str, int]]:
        """Per compiled program, its bytes per device (`memory_analysis()`: argument, output, temp, alias),
        what lives outside it while it runs (`live_outside`) and its peak: arguments + outputs + temporaries
        − aliased + outside. The step's peak is the largest; `zerolm compile` reports it, a run checks it."""
        outside = live_outside(zero, micro_batch, seq_len, accum_steps)
        rows = {}
        for name, executable in self.programs.items():
            m = executable.memory_analysis()
            row = {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
                   "temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
                   "live_outside_bytes": outside[name]}
            row["peak_bytes"] = (row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"] - row["alias_bytes"]
                                 + row["live_outside_bytes"])
            rows[name] = row
        return rows

    @property
    def texts(self) -> dict[str, str]:
        """The optimized HLO of each compiled program (zerolm.compile.hlo reads their collectives)."""
        return {name: executable.as_text() or "" for name, executable in self.programs.items()}


def live_outside(zero: Zero, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, int]:
    """Per program, the bytes per device that live outside it while it runs: the optimizer state during
    `grad`; the optimizer state and `grad`'s output (the gradient, by its reduction) during `reshard`; nothing
    during `update` (it takes the state whole: the old parameters are its donated argument)."""
    x = zero.inputs(micro_batch, seq_len, accum_steps)
    grads = x.params if zero.grad_reduce == "all_reduce" else x.views
    return {"grad": sharding.shard_bytes(x.opt_state),
            "reshard": sharding.shard_bytes(x.opt_state) + sharding.shard_bytes(grads),
            "update": 0}


@dataclasses.dataclass
class BuiltStep:
    """The step built and compiled for a run's shapes (`build_and_compile`)."""

    cfg: Config  # as compiled: every `auto` of the model's section resolved (remat by the compile, the rest: `resolved`)
    model: gpt_model.GPT
    zero: Zero
    init_fn: functools.partial
    compiled: CompiledStep
    tried: dict[str, int | None]  # model.remat auto: each policy tried -> its compiled peak (None: refused)


def step_peak(compiled: CompiledStep, zero: Zero, cfg: Config) -> int | None:
    """The compiled step's peak bytes per device (the largest of its programs'), None if a program was refused."""
    return step_memory(compiled, zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps)


def step_memory(compiled: CompiledStep, zero: Zero, micro_batch: int, seq_len: int, accum_steps: int) -> int | None:
    """`step_peak` for the shapes the step was compiled for (a staged context's: its rows and seq_len)."""
    if compiled.refused:
        return None
    memory = compiled.memory(zero, micro_batch, seq_len, accum_steps)
    return max(m["peak_bytes"] for m in memory.values())


class SharedPrograms:
    """The steps one search compiles (`zerolm compile --largest-micro-batch`, `--fastest`; model.remat auto): the
    reshard and update programs of the first step compiled for given inputs are taken by every later step with
    the same inputs, shapes and shardings alike (another micro-batch, remat policy or attention block changes
    only the gradient's program), so each is compiled once per ZeRO stage, not once per candidate."""

    def __init__(self):
        self._first: dict[Any, CompiledStep] = {}

    @staticmethod
    def _key(zero: Zero, seq_len: int) -> Any:
        """What the programs other than the gradient's take: their names and abstract inputs."""
        inputs = zero.program_inputs(1, seq_len, 1)
        return tuple((name, jax.tree.structure(args), tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(args)))
                     for name, args in inputs.items() if name != "grad")

    def compile(self, zero: Zero, micro_batch: int, seq_len: int, accum_steps: int) -> CompiledStep:
        """`compile_step` (refusals kept), taking the programs an earlier step with the same inputs compiled."""
        key = self._key(zero, seq_len)
        compiled = compile_step(zero, micro_batch, seq_len, accum_steps, keep_refusals=True, reuse=self._first.get(key))
        self._first.setdefault(key, compiled)
        return compiled


def build_and_compile(cfg: Config, mesh: Mesh, limit: int | None, rules=sharding.RULES,
                      shared: SharedPrograms | None = None) -> BuiltStep:
    """`build_step` and `compile_step` (refusals kept) for the config's shapes. With model.remat auto, the
    policies of zerolm.parallel.auto.REMAT_ORDER in turn until one's compiled peak fits `limit` (bytes per device; None: no limit,
    so the first); if none does, the last (the caller's fit check says it does not fit). `shared`: a search's
    programs that the step's other shapes do not change (SharedPrograms; remat auto shares its own)."""
    candidates = auto.remat_candidates(cfg.model.remat)
    tried: dict[str, int | None] = {}
    shared = shared if shared is not None else SharedPrograms()
    for remat in candidates:
        this = cfg.with_values({"model.remat": remat}) if remat != cfg.model.remat else cfg
        model, zero, init_fn = build_step(this, mesh, rules)
        compiled = shared.compile(zero, this.train.micro_batch_size, this.model.seq_len, this.accum_steps)
        peak = tried[remat] = step_peak(compiled, zero, this)
        if remat == candidates[-1] or (peak is not None and (limit is None or peak <= limit)):
            return BuiltStep(this.model_copy(update={"model": model.cfg}), model, zero, init_fn, compiled,
                             tried if len(candidates) > 1 else {})
    raise AssertionError("unreachable")


def describe_remat_choice(built: BuiltStep, limit: int | None) -> str | None:
    """The header line of model.remat auto: what each policy tried needed, and which one runs."""
    if not built.tried:
        return None
    gib = lambda n: "refused by the compiler" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    tries = ", ".join(f"{r} {gib(p)}" for r, p in built.tried.items())
    against = f" of {limit / 2**30:.2f} GiB" if limit else " (no device limit: the first)"
    return f"remat auto: {built.cfg.model.remat} ({tries}{against})"


def check_fits(built: BuiltStep, limit: int | None) -> str | None:
    """Stop before anything is written when the step cannot fit this device (DoesNotFit): the compiler
    refused a program (a TPU's does), or the compiled peak (`CompiledStep.memory`, `zerolm compile`'s rule)
    is over the allocator's `limit` (a GPU's: its compiler accepts any size). The header's line, or None where
    the backend states no limit (CPU)."""
    cfg, compiled = built.cfg, built.compiled
    if compiled.refused:
        name, refusal = next(iter(compiled.refused.items()))
        raise DoesNotFit(cfg, f"the compiler refused its {name} program: {first_line(refusal)}")
    if not limit:
        return None
    memory = compiled.memory(built.zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps)
    name = max(memory, key=lambda n: memory[n]["peak_bytes"])
    peak = memory[name]["peak_bytes"]
    where = f"{peak / 2**30:.2f} GiB per device at its peak ({name}) of the {limit / 2**30:.2f} GiB"
    if peak > limit:
        gpu = jax.local_devices()[0].platform in ("gpu", "cuda", "rocm")
        raise DoesNotFit(cfg, f"the compiled step needs {where} the device may allocate"
                         + (", XLA_PYTHON_CLIENT_MEM_FRACTION of its memory (0.75 unless set)" if gpu else ""))
    return f"device memory: the compiled step needs {where} the device may allocate"


class DoesNotFit(ZerolmError):
    """The step needs more memory than the device has (the compiler refused a program, the compiled peak
    is over the device's limit, or the device ran out): one line naming the keys that size it."""

    def __init__(self, cfg: Config, detail: str):
        super().__init__(
            f"the training step does not fit in device memory ({detail.rstrip('.')}); lower "
            f"train.micro_batch_size (now {cfg.train.micro_batch_size}), recompute more (model.remat, now "
            f"{cfg.model.remat}: dots_attention, dots or full) or spread the model wider (mesh.tp, more devices): "
            "`zerolm plan` says what fits")


def compile_step(zero: Zero, micro_batch: int, seq_len: int, accum_steps: int, *,
                 keep_refusals: bool = False, reuse: CompiledStep | None = None) -> CompiledStep:
    """Compile each of the step's programs (`Zero.program_inputs`) for a run's shapes: what training runs
    (`Zero.using`), what `zerolm comms` and the run's header read, what `zerolm compile` measures. With
    `keep_refusals`, a program the compiler refuses for its size (RESOURCE_EXHAUSTED: its temporaries exceed
    the device) is recorded, not raised: that refusal is `zerolm compile`'s answer. `reuse`: a step whose
    reshard and update programs take the same inputs (SharedPrograms: another remat policy, micro-batch or
    attention block changes only the gradient's), taken as they are, refusals and compile times included."""
    executables: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    refused: dict[str, str] = {}
    for name, args in zero.program_inputs(micro_batch, seq_len, accum_steps).items():
        if reuse is not None and name != "grad" and name in reuse.seconds:
            if (executable := getattr(reuse.programs, name)) is not None:
                executables[name] = executable
            if name in reuse.refused:
                refused[name] = reuse.refused[name]
            seconds[name] = reuse.seconds[name]
            continue
        t0 = time.perf_counter()
        try:
            executables[name] = getattr(zero.programs, name).lower(*args).compile()
        except Exception as e:
            if not (keep_refusals and is_out_of_memory(e)):
                raise
            refused[name] = str(e)
        seconds[name] = time.perf_counter() - t0
    programs = Programs(**{name: executables.get(name) for name in Programs.NAMES})
    return CompiledStep(programs, seconds, refused)
