"""The typed, frozen config tree: every section of a run's config and the checks between them (loaded from YAML
by zerolm.config.load).

The schema has no defaults of its own (but None for the optional `name` of a mixture entry, which YAML cannot
default inside a list), so a key missing from the merged YAML is an error, and `configs/defaults.yaml` is the one
place a default lives; what older checkpoints' configs lacked is read through
zerolm.checkpoint.meta.BEFORE_RECORDED. Validation is pydantic's: an unknown key, a wrong type or an impossible
combination fails, before any device work, naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, ValidationInfo, field_validator, model_validator

from zerolm.config.model import ModelConfig, resolved_shape, tp_split_problem
from zerolm.config.sampling import Sampling
from zerolm.config.section import PositiveInt, _KeyError, set_dotted
from zerolm.config.section import Section as _Section


class ContextStage(_Section):
    """One stage of a run's staged context (train.context_stages): its steps at a context of seq_len tokens."""

    steps: int = PositiveInt
    seq_len: int = PositiveInt


class TrainConfig(_Section):
    steps: int = PositiveInt
    # Persistent XLA compilation cache: "default" ($ZEROLM_CACHE/xla), a directory (or gs:// path), or null (off).
    compilation_cache: str | None
    schedule_steps: int | None = Field(gt=0)  # length of the lr schedule; null: steps
    # The lr after the warmup (zerolm.parallel.optim.lr_schedule): cosine to lr * min_lr_ratio at the schedule's end;
    # wsd: constant, then a decay over the schedule's last decay_steps; constant: lr for ever.
    schedule: Literal["cosine", "wsd", "constant"]
    decay_steps: int | None = Field(gt=0)  # wsd only: the decay's length, the last steps of the schedule
    decay_shape: Literal["linear", "sqrt"]  # wsd's decay: linear, or 1 - sqrt (Hägele et al. 2024)
    seed: int = Field(ge=0)
    global_batch_size: int = PositiveInt  # sequences per optimizer step
    micro_batch_size: int = PositiveInt  # sequences per device per accumulation micro-step
    lr: float = Field(gt=0)
    min_lr_ratio: float = Field(ge=0, le=1)
    warmup_steps: int = Field(ge=0)
    weight_decay: float = Field(ge=0)
    beta1: float = Field(ge=0, lt=1)
    beta2: float = Field(ge=0, lt=1)
    eps: float = Field(gt=0)
    grad_clip: float = Field(gt=0)
    eval_every: int = PositiveInt
    # Validation sequences per evaluation: a fixed set (the split's first ones), whatever dp and the
    # micro-batch are, so a checkpoint's validation loss is the same on any device count. 0: no evaluation.
    eval_sequences: int = Field(ge=0)
    skip_nonfinite: bool  # skip (and count) updates with a non-finite gradient instead of stopping
    max_consecutive_skips: int = PositiveInt  # with skip_nonfinite: stop when this many in a row were skipped
    init_from: str | None  # a checkpoint whose params a fresh run starts from (zerolm.checkpoint.warm_start)
    # Staged context (zerolm.data.context): the first stage's steps at its seq_len, then the next stage's, then
    # model.seq_len; each sample cut to the stage's context (truncate) or into model.seq_len / seq_len rows (split).
    context_stages: tuple[ContextStage, ...]
    context_rows: Literal["truncate", "split"]
    # A checkpoint whose whole state (params, optimizer state, step, data position) a run without checkpoints of
    # its own starts from, into its own directories: a decay branch (zerolm.checkpoint.branch).
    branch_from: str | None
    # The decay of an exponential moving average of the params kept in the optimizer state (zerolm.parallel.optim.with_ema)
    # and evaluated beside them; null: none.
    ema: float | None = Field(gt=0, lt=1)

    @property
    def schedule_length(self) -> int:
        return self.schedule_steps or self.steps

    @model_validator(mode="wrap")
    @classmethod
    def _warmup_within_schedule(cls, data: Any, handler: ModelWrapValidatorHandler[TrainConfig],
                                info: ValidationInfo) -> TrainConfig:
        """A warmup not shorter than the lr schedule (a smoke run of a few steps on a config made for
        hundreds) ends on the schedule's last step instead: train.warmup_steps becomes schedule length - 1,
        what the run records and resumes with. The line that says so goes to the context's `notes`."""
        train = handler(data)
        length = train.schedule_length
        if train.warmup_steps < length:
            return train._agreed()
        notes = (info.context or {}).get("notes")
        if notes is not None:
            key = "train.schedule_steps" if train.schedule_steps else "train.steps"
            keep = "; train.schedule_steps keeps the full schedule in a short run" if key == "train.steps" else ""
            notes.append(f"warning: train.warmup_steps {train.warmup_steps} is not shorter than the lr schedule "
                         f"({key} {length}): this run warms up over {length - 1} step(s) (train.warmup_steps "
                         f"{length - 1}){keep}")
        return train.model_copy(update={"warmup_steps": length - 1})._agreed()

    def _agreed(self) -> TrainConfig:
        """The keys that must agree: train.decay_steps is wsd's, and wsd's decay starts after the warmup (as cut
        to the schedule); a run starts from one other checkpoint at most."""
        if self.branch_from is not None and self.init_from is not None:
            raise _KeyError("train.branch_from", "set beside train.init_from: a run starts from another run's whole "
                            "state (branch_from) or from its parameters alone (init_from), not both",
                            related=("train.init_from",))
        if self.schedule != "wsd":
            if self.decay_steps is not None:
                raise _KeyError("train.decay_steps", f"{self.decay_steps} is set and train.schedule is {self.schedule}, "
                                "which has no decay of a set length; set train.schedule=wsd, or train.decay_steps=null",
                                related=("train.schedule",))
            return self
        length_key = "train.schedule_steps" if self.schedule_steps else "train.steps"
        if self.decay_steps is None:
            raise _KeyError("train.decay_steps", "null, and train.schedule is wsd, which decays over the schedule's "
                            "last train.decay_steps steps; set it (20% of the schedule is usual)",
                            related=("train.schedule",))
        if self.warmup_steps + self.decay_steps > self.schedule_length:
            raise _KeyError("train.decay_steps", f"{self.decay_steps} after train.warmup_steps {self.warmup_steps} is "
                            f"longer than the lr schedule ({length_key} {self.schedule_length}): wsd's decay ends the "
                            "schedule and starts after its warmup",
                            related=("train.warmup_steps", "train.schedule_steps", "train.steps"))
        return self


class MeshConfig(_Section):
    # Data parallel inside a slice: the ZeRO split (zerolm.parallel.sharding). "auto": every device of a slice not
    # used by tp. The batch's rows are split over slices x dp.
    dp: int | Literal["auto"]
    tp: int = PositiveInt
    # TPU slices joined by the data-center network (Multislice): data parallel across them, the ZeRO state
    # replicated on each, one all-reduce of each device's gradient shard across them per step (zerolm.parallel.zero).
    slices: int = PositiveInt

    @model_validator(mode="after")
    def _positive(self) -> MeshConfig:
        if self.dp != "auto" and self.dp < 1:
            raise ValueError(f"dp must be 'auto' or >= 1, got {self.dp}")
        return self


class ZeroConfig(_Section):
    # 1: the optimizer state split over dp, one gradient reduction per step; 2: also the gradient (a
    # reduce-scatter per micro-step); 3: also the parameters (each layer gathered where it is used).
    stage: Literal[1, 2, 3]
    # all_reduce: one pmean of the accumulated gradients (the seed design);
    # reduce_scatter: one psum_scatter straight into the optimizer-state layout (half the bytes).
    grad_reduce: Literal["all_reduce", "reduce_scatter"]
    # fp32: float32 parameters, reduced and gathered in float32. mixed: bfloat16 working parameters,
    # float32 master weights in the dp-sharded optimizer state, bfloat16 reduction and all-gather.
    precision: Literal["fp32", "mixed"]
    accumulate_dtype: Literal["float32", "bfloat16"]  # each device's gradient sum over its micro-batches
    scatter: Literal["auto", "collective", "two_stage", "ring"]  # how reduce_scatter runs (zerolm.parallel.zero.Zero)
    # libtpu's asynchronous collective fusion (zerolm.core.tpu_flags): auto = on at stage 3 when the step runs or
    # compiles for a TPU; on; off (libtpu's default schedule).
    tpu_async_collectives: Literal["auto", "on", "off"]

    @field_validator("tpu_async_collectives", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML reads on/off as booleans

    @model_validator(mode="after")
    def _scatter_needs_reduce_scatter(self) -> ZeroConfig:
        if self.scatter != "auto" and self.grad_reduce == "all_reduce":
            raise _KeyError("zero.scatter", f"{self.scatter} is how a reduce-scatter runs, and zero.grad_reduce is "
                            "all_reduce, which runs none; set zero.grad_reduce=reduce_scatter, or leave scatter auto",
                            related=("zero.grad_reduce",))
        if self.stage > 1 and self.grad_reduce == "all_reduce":
            raise _KeyError("zero.stage", f"{self.stage} keeps the gradient split over dp, and zero.grad_reduce is "
                            "all_reduce, which reduces it whole; set zero.grad_reduce=reduce_scatter, or zero.stage=1",
                            related=("zero.grad_reduce",))
        return self


class MixtureEntry(_Section):
    dataset: str  # a prepared dataset dir / URL (or "default")
    weight: float = Field(gt=0)  # its share of the samples: weights are normalized to sum to 1
    name: str | None = None  # in the run's header and metrics (default: the dataset's last path part)


class DataConfig(_Section):
    dataset: str  # "default" (the embedded corpus, prepared on first use) or a prepared dataset dir / URL
    # Several datasets, interleaved by weight (zerolm.data.mixture); data.dataset must then stay "default".
    mixture: tuple[MixtureEntry, ...] | None = Field(min_length=1)
    tokenizer: str | None  # optional tokenizer file the dataset must have been prepared with
    default_vocab_size: int = Field(ge=257)  # BPE size for the default dataset: 256 bytes + end-of-text at least
    skip_bad_samples: bool  # replace unreadable samples by a neighbour and count them, instead of stopping
    prefetch: int = Field(ge=1)  # batches read ahead on a background thread

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.mixture is None:
            return self
        if self.dataset != "default":
            raise _KeyError("data.dataset", f"{self.dataset!r} is set beside data.mixture, which a run reads instead; "
                            "put it in the mixture, or drop data.mixture", related=("data.mixture",))
        return self  # (each weight's share of a block: zerolm.data.mixture.check_weights, as the data opens)


class CheckpointConfig(_Section):
    dir: str | None  # null: checkpoints/<name>; a local path or gs://
    every: int = PositiveInt  # steps between saves (and one at the end)
    keep: int = PositiveInt  # the last `keep` checkpoints are kept ...
    keep_every: int | None = Field(gt=0)  # ... plus every keep_every-th step, if set


class LoggingConfig(_Section):
    dir: str | None  # null: runs/<name>
    wandb: Literal["disabled", "offline", "online"]
    wandb_project: str
    every: int = PositiveInt  # progress-bar refresh, in steps; metrics.jsonl gets every step
    profile: str | None = Field(pattern=r"^\d+-\d+$")  # "A-B": a jax.profiler trace of steps A..B
    tensorboard: bool  # metrics.jsonl's numbers as TensorBoard scalars too (zerolm.observe.tensorboard)
    tensorboard_dir: str | None  # where they go: null = <logging.dir>/tensorboard; a local path or gs://

    @property
    def profile_steps(self) -> tuple[int, int] | None:
        if self.profile is None:
            return None
        first, last = map(int, self.profile.split("-"))
        return first, last

    @field_validator("profile")
    @classmethod
    def _profile_range(cls, value: str | None) -> str | None:
        if value is not None:
            first, last = map(int, value.split("-"))
            if not 1 <= first <= last:
                raise ValueError(f"{value!r}: expected FIRST-LAST steps with 1 <= FIRST <= LAST")
        return value

    @model_validator(mode="after")
    def _tensorboard_dir_needs_tensorboard(self) -> LoggingConfig:
        if self.tensorboard_dir is not None and not self.tensorboard:
            raise _KeyError("logging.tensorboard_dir", f"{self.tensorboard_dir} is set and logging.tensorboard is "
                            "false, which writes no TensorBoard events; set logging.tensorboard=true, or "
                            "logging.tensorboard_dir=null", related=("logging.tensorboard",))
        return self


class SampleConfig(Sampling):
    """Training's samples: the prompt, how many tokens, how often; drawn as `Sampling` says (seed None: train.seed)."""

    prompt: str
    tokens: int = Field(ge=0)
    every: int | None = PositiveInt


class EvalConfig(_Section):
    # lm-evaluation-harness tasks evaluated during training (zerolm.eval.downstream): zerolm's, the harness's, or
    # include_path's; a YAML list or "a,b". Each is checked (known, its data here) before the step compiles.
    tasks: tuple[str, ...]
    every: int | None = PositiveInt  # steps between task evaluations (and one at the end); null: train.eval_every
    limit: int | None = PositiveInt  # each task's first N documents; null: all
    include_path: str | None  # a local directory of your own task definitions (the harness's --include_path)

    @field_validator("tasks", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):  # --set eval.tasks=zerolm_cloze,zerolm_choice
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("tasks")
    @classmethod
    def _each_once(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if twice := sorted({name for name in value if value.count(name) > 1}):
            raise ValueError(f"{', '.join(twice)} named more than once")
        if "" in (name.strip() for name in value):
            raise ValueError("an empty task name")
        return value


class Config(_Section):
    name: str
    model: ModelConfig
    train: TrainConfig
    mesh: MeshConfig
    zero: ZeroConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    sample: SampleConfig
    eval: EvalConfig

    @model_validator(mode="before")
    @classmethod
    def _resolve_dp(cls, data: Any, info: ValidationInfo) -> Any:
        """`mesh.dp: auto` is every device tp does not use, where the device count is known (the one place
        it is resolved)."""
        device_count = (info.context or {}).get("device_count")
        mesh = data.get("mesh") if isinstance(data, dict) else None
        if device_count is None or not isinstance(mesh, dict) or mesh.get("dp") != "auto":
            return data
        tp, slices = mesh.get("tp", 1), mesh.get("slices", 1)
        if not (isinstance(tp, int) and tp > 0 and isinstance(slices, int) and slices > 0):
            return data  # the fields' own checks name them
        if device_count % slices:
            raise _KeyError("mesh.slices", f"{slices} slices do not divide the {device_count} devices")
        per_slice = device_count // slices
        if per_slice % tp:
            raise _KeyError("mesh.tp", f"tp={tp} does not divide the {per_slice} devices"
                            + (f" of each of {slices} slices" if slices > 1 else ""))
        return {**data, "mesh": {**mesh, "dp": per_slice // tp}}

    @model_validator(mode="after")
    def _batch_and_mesh(self, info: ValidationInfo) -> Config:
        device_count = (info.context or {}).get("device_count")
        dp, slices = self.mesh.dp, self.mesh.slices
        if device_count is not None and dp * self.mesh.tp * slices != device_count:
            if slices == 1:
                raise _KeyError("mesh.dp", f"dp × tp = {dp} × {self.mesh.tp} = {dp * self.mesh.tp}, "
                                f"but there are {device_count} devices")
            if device_count % slices:
                raise _KeyError("mesh.slices", f"{slices} slices do not divide the {device_count} devices")
            raise _KeyError("mesh.dp", f"dp × tp = {dp} × {self.mesh.tp} = {dp * self.mesh.tp} devices, but each "
                            f"of the {slices} slices has {device_count // slices}: dp and tp are the mesh inside one "
                            "slice (dp may not cross a slice)", related=("mesh.slices",))
        tp = self.mesh.tp
        m = self.model
        shape = resolved_shape(m.model_dump())  # n_kv_head and mlp_hidden, auto or not, as numbers
        if (why := tp_split_problem(m.n_head, shape["mlp_hidden"], tp, shape["n_kv_head"])) is not None:
            key = next(k for k in ("n_kv_head", "n_head", "mlp_hidden") if f"model.{k}" in why)
            raise _KeyError("mesh.tp", f"tp={tp} {why}", related=(f"model.{key}",))
        _check_context_stages(self.train, m.seq_len)
        if dp != "auto":
            per_step = self.train.micro_batch_size * dp * slices
            if self.train.global_batch_size % per_step:
                ways = "dp" if slices == 1 else "slices × dp"
                factors = f"{dp}" if slices == 1 else f"{slices} × {dp}"
                raise _KeyError("train.global_batch_size",
                                f"{self.train.global_batch_size} is not divisible by micro_batch_size × {ways} = "
                                f"{self.train.micro_batch_size} × {factors} = {per_step}")
        return self

    @model_validator(mode="after")
    def _branch_elsewhere(self) -> Config:
        """A branch writes its own checkpoints: train.branch_from may not name checkpoint.dir or a step in it
        (refused here, before the run locks the directory or removes unfinished saves from it)."""
        source = self.train.branch_from
        if source is None:
            return self
        own = place(self.checkpoint_dir)
        if own in (place(source), place(source).rsplit("/", 1)[0]):
            raise _KeyError("train.branch_from", f"{source} is in this run's own checkpoint.dir {self.checkpoint_dir}: "
                            "a branch writes its checkpoints and logs apart from its source's; give it its own "
                            "(set name, or checkpoint.dir and logging.dir)",
                            related=("checkpoint.dir", "name"))
        return self

    # Derived quantities: read these rather than recomputing them at call sites.
    @property
    def dp(self) -> int:
        if self.mesh.dp == "auto":
            raise ValueError("mesh.dp is 'auto': load the config with device_count to resolve it")
        return self.mesh.dp

    @property
    def data_ranks(self) -> int:
        """The batch's split: data parallel inside a slice times the slices."""
        return self.dp * self.mesh.slices

    @property
    def device_count(self) -> int:
        return self.data_ranks * self.mesh.tp

    @property
    def accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_ranks)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path("checkpoints") / self.name)

    @property
    def log_dir(self) -> Path:
        return Path(self.logging.dir) if self.logging.dir else Path("runs") / self.name

    @property
    def tensorboard_dir(self) -> str | None:
        """Where the run's TensorBoard scalars go (logging.tensorboard_dir, else <logging.dir>/tensorboard), or None
        without logging.tensorboard."""
        if not self.logging.tensorboard:
            return None
        return self.logging.tensorboard_dir or str(self.log_dir / "tensorboard")

    def with_values(self, values: dict[str, Any]) -> Config:
        """A copy with the values of these dotted keys (`{"model.vocab_size": 50257}`; a section's whole dict
        too), validated again."""
        data = self.model_dump()
        for key, value in values.items():
            set_dotted(data, key, value)
        return Config.model_validate(data)


def _check_context_stages(train: TrainConfig, seq_len: int) -> None:
    """Each stage's context shorter than model.seq_len, and (split) a divisor of it: its samples cut into whole rows."""
    for i, stage in enumerate(train.context_stages):
        key = f"train.context_stages.{i}.seq_len"
        if stage.seq_len >= seq_len:
            raise _KeyError(key, f"{stage.seq_len} is not shorter than model.seq_len={seq_len}: a stage trains at a "
                            "shorter context, and model.seq_len comes after the last", related=("model.seq_len",))
        if train.context_rows == "split" and seq_len % stage.seq_len:
            raise _KeyError(key, f"{stage.seq_len} does not divide model.seq_len={seq_len}: train.context_rows split "
                            "cuts each sample into model.seq_len / seq_len rows; use a divisor, or context_rows "
                            "truncate", related=("train.context_rows", "model.seq_len"))


def place(location: str) -> str:
    """A directory's name to compare: a gs:// URL as written, a local path made absolute; no trailing slash."""
    return location.rstrip("/") if "://" in location else os.path.normpath(os.path.abspath(location))


