"""What a checkpoint records beside its arrays: the run's metadata, written by the training loop and read
by resume, the checkpoint listing, evaluation, sampling and export.

`format` is the checkpoint's version: 2 since c_attn's kernel became (layers, d, 3, d) and the metadata
records tp. A version-2 checkpoint of an older zerolm lacks fields added since, which read as their
defaults (tp 1, one process); version 1 is refused (zerolm.checkpoint.store.Checkpoints.readable_meta).
"""

from __future__ import annotations

import dataclasses
from typing import Any

FORMAT = 2

# Config keys an older zerolm did not record in its checkpoints, and what they were then (each one's
# behaviour before the key existed): a checkpoint's config is read through these, here and nowhere else.
BEFORE_RECORDED: dict[str, dict[str, Any]] = {
    "model": {"attention_block": 512, "scan_layers": "auto", "document_mask": False, "document_positions": "continue",
              "eot_id": "auto", "position": "learned", "bias": True,
              "activation": "gelu_tanh", "embedding_dropout": 0.0, "residual_dropout": 0.0,
              "attention_dropout": 0.0, "rope_theta": 10000.0, "norm": "layernorm", "norm_eps": 1e-5, "mlp": "gelu",
              "mlp_hidden": "auto", "n_kv_head": "auto", "tie_embeddings": True,
              "parallel_residual": False, "shared_norm": False},
    "zero": {"precision": "fp32", "stage": 1, "tpu_async_collectives": "off"},
    "train": {"init_from": None, "schedule": "cosine", "decay_steps": None, "decay_shape": "linear",
              "branch_from": None, "ema": None, "context_stages": [], "context_rows": "split"},
    "eval": {"tasks": [], "every": None, "limit": None, "include_path": None},
    "logging": {"tensorboard": False, "tensorboard_dir": None},
    "mesh": {"slices": 1},
}


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    step: int  # optimizer steps taken: the checkpoint of step s holds the state after the s-th update
    time: float  # when it was saved (seconds since the epoch)
    config: dict[str, Any]  # the run's resolved config (zerolm.config.tree.Config.model_dump())
    dp: int  # the mesh it was trained on: its optimizer state is laid out for (dp, tp) and its zero.stage
    accum_steps: int
    dataset: dict[str, Any]  # the data's identity (zerolm.data.dataset.dataset_identity): a resume must match it
    tokens_seen: int
    loss: float | None  # the last training loss logged
    wandb_id: str  # a resumed run continues this wandb run
    tp: int = 1
    process_count: int = 1
    dataset_location: str | None = None  # where the run read its dataset (evaluation and the tokenizer look there)
    zerolm_version: str = ""
    # A decay branch's (train.branch_from): where its state came from (zerolm.checkpoint.branch.Source.record), its
    # source's own record within, if that was a branch too; None: a run that started fresh or from init_from.
    branched_from: dict[str, Any] | None = None
    # `zerolm average`'s: the checkpoint directory, the steps and what of them (params, master weights, ema) it averaged
    averaged: dict[str, Any] | None = None
    format: int = FORMAT

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMeta:
        """The metadata as saved (KeyError for a missing required field, as in a damaged checkpoint)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{"format": 1, **{k: v for k, v in data.items() if k in fields}})  # no format: version 1

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def full_config(self) -> dict[str, Any]:
        """The run's config with every key an older zerolm did not record read as it was then
        (BEFORE_RECORDED): what validates as a zerolm.config.tree.Config today."""
        return {**self.config, **{section: {**defaults, **self.config.get(section, {})}
                                  for section, defaults in BEFORE_RECORDED.items()}}

    @property
    def model(self) -> dict[str, Any]:
        """The `model` section of the run's config (what the parameters' shapes follow), keys an older
        zerolm did not record read as they were then (BEFORE_RECORDED)."""
        return {**BEFORE_RECORDED["model"], **self.config["model"]}

    @property
    def train(self) -> dict[str, Any]:
        return {**BEFORE_RECORDED["train"], **self.config["train"]}

    @property
    def ema(self) -> float | None:
        """train.ema (None before it existed): the decay of the moving average its optimizer state keeps, or None."""
        return self.train["ema"]

    @property
    def precision(self) -> str:
        """zero.precision (fp32 before mixed precision existed): what the optimizer state holds."""
        return {**BEFORE_RECORDED["zero"], **self.config.get("zero", {})}["precision"]

    @property
    def stage(self) -> int:
        """zero.stage (1 before stages 2 and 3 existed): with dp and tp, what the optimizer state is laid out for."""
        return int({**BEFORE_RECORDED["zero"], **self.config.get("zero", {})}["stage"])

    @property
    def slices(self) -> int:
        """mesh.slices (1 before Multislice): the slices it was trained on, each holding the (dp, tp) layout."""
        return int({**BEFORE_RECORDED["mesh"], **self.config.get("mesh", {})}["slices"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.dataset["tokenizer_sha256"]
