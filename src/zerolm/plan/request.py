"""What `zerolm plan` is asked, checked, and the Planner for it: the model (a config, or a parameter count
shaped like GPT-3's), the device preset and the parallel layout, with every default a config gives."""

from __future__ import annotations

import dataclasses
import functools
import math

from zerolm.config.load import load_config
from zerolm.config.model import resolved_shape, tp_split_problem
from zerolm.config.tree import Config
from zerolm.core.hardware import preset
from zerolm.data.context import ContextPlan
from zerolm.data.dataset import load_planned
from zerolm.plan.build import Shape, from_config, model_from_params
from zerolm.plan.planner import Planner, PlanSettings
from zerolm.plan.spec import Parallelism, PlanError
from zerolm.plan.states import AnalyticStates

# The request's counts, by the flag that gives each: finite and positive where given.
_COUNTS = ("params", "dp", "tp", "slices", "global_batch", "micro_batch", "layers", "width", "heads", "seq_len", "vocab")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One plan, as `zerolm plan`'s flags say it (None: the config's value, else the default)."""

    device: str = "h100"
    config: str | None = None
    sets: tuple[str, ...] = ()
    params: float | None = None
    layers: int | None = None
    width: int | None = None
    heads: int | None = None
    seq_len: int = 2048
    vocab: int = 50257
    dp: int | None = None
    tp: int | None = None
    slices: int | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    precision: str | None = None
    remat: str | None = None
    efficiency: float = 0.5
    memory_fraction: float | None = None

    def check(self) -> None:
        """PlanError, naming the flag, for a value no plan can use."""
        for flag in _COUNTS:
            value = getattr(self, flag)
            if value is not None and not math.isfinite(value):
                raise PlanError(f"--{flag.replace('_', '-')}: {value} is not a number of parameters, devices or sequences")
            if value is not None and value <= 0:
                raise PlanError(f"--{flag.replace('_', '-')}: {value:g} is not positive")
        if not 0 < self.efficiency <= 1:
            raise PlanError(f"--efficiency: {self.efficiency} is not in (0, 1]")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise PlanError(f"--memory-fraction: {self.memory_fraction} is not in (0, 1]")
        if (self.config is None) == (self.params is None):
            raise PlanError("give the model as --config FILE or as --params N (one of them)")
        if self.sets and self.config is None:
            raise PlanError("--set needs --config")


def planner_for(request: PlanRequest) -> Planner:
    """The Planner `request` asks for; PlanError / ConfigError for bad input."""
    device = preset(request.device)
    request.check()
    cfg = load_config(request.config, list(request.sets)) if request.config is not None else None
    tp = request.tp or (cfg.mesh.tp if cfg else 1)
    shape = resolved_shape(cfg.model.model_dump()) if cfg is not None else {}
    if cfg is not None and (why := tp_split_problem(cfg.model.n_head, shape["mlp_hidden"], tp, shape["n_kv_head"])):
        raise PlanError(f"--tp: {tp} {why} of {request.config}")
    dp = request.dp or (cfg.mesh.dp if cfg and cfg.mesh.dp != "auto" else max(1, device.per_node // tp))
    slices = request.slices or (cfg.mesh.slices if cfg else 1)
    if slices > 1 and device.dcn_bw is None:
        raise PlanError(f"--slices: {slices}, but {device.name} devices are not joined across slices (Cloud TPU "
                        "Multislice: v4, v5e, v5p)")
    global_batch = request.global_batch or (cfg.train.global_batch_size if cfg else 256)
    if global_batch % (dp * slices):
        why = "" if request.dp else f" (dp defaults to one {device.name} node of {device.per_node} devices; give --dp)"
        over = f"dp = {dp}" if slices == 1 else f"slices × dp = {slices} × {dp}"
        raise PlanError(f"--dp: the global batch of {global_batch} sequences does not divide over {over}{why}")
    micro = _micro_batch(request, cfg, global_batch // (dp * slices), dp * slices, global_batch)
    if cfg is not None:
        assert request.config is not None
        sets = [f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.slices={slices}", f"train.global_batch_size={global_batch}",
                f"train.micro_batch_size={micro}"] + ([f"model.remat={request.remat}"] if request.remat else [])
        cfg = load_planned(request.config, [*request.sets, *sets])
        model, factory = from_config(cfg, dp, tp)
    else:
        assert request.params is not None  # check(): one of config and params
        model = model_from_params(int(request.params), Shape(request.layers, request.width, request.heads),
                                  request.seq_len, request.vocab, request.remat or "none")
        if why := tp_split_problem(model.n_head, 4 * model.d_model, tp):
            raise PlanError(f"--tp: {tp} {why}")
        factory = functools.partial(AnalyticStates, model)
    precision = request.precision or (cfg.zero.precision if cfg is not None else "fp32")
    contexts = () if cfg is None else tuple(
        (f"{c.first}-{c.last}", c.seq_len, c.rows) for c in ContextPlan.of(cfg.train, cfg.model.seq_len).contexts[:-1])
    return Planner(model, factory, device, Parallelism(dp, tp, global_batch, slices),
                   PlanSettings(precision, micro, efficiency=request.efficiency, memory_fraction=request.memory_fraction,
                                stage=cfg.zero.stage if cfg is not None else 1, contexts=contexts))


def _micro_batch(request: PlanRequest, cfg: Config | None, per_rank: int, dp: int, global_batch: int) -> int:
    """--micro-batch, which must divide a rank's share; else the configured one, or the largest below it
    that divides the share."""
    if request.micro_batch:
        if per_rank % request.micro_batch:
            raise PlanError(f"--micro-batch: {request.micro_batch} does not divide the {per_rank} sequences of each "
                            f"of the dp = {dp} ranks (global batch {global_batch})")
        return request.micro_batch
    wanted = cfg.train.micro_batch_size if cfg else 1
    return max(b for b in range(1, min(wanted, per_rank) + 1) if per_rank % b == 0)
