"""What a run may continue or start from: the checkpoint's model, precision and train.ema against the config's.

A resume (zerolm.checkpoint.resume) and a decay branch continue a checkpoint only with the same parameters,
`zero.precision` and `train.ema` (`check_compatible`); a warm start, a growth and an average ask only which model
settings make other parameters (`parameter_differences`): the settings that change how the model computes, not
what its parameters are, may differ.
"""

from __future__ import annotations

from etils import epath

from zerolm.checkpoint.errors import CheckpointError
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.config.model import resolved_shape


def check_compatible(meta: CheckpointMeta, where: epath.Path, model_config: dict, precision: str,
                     ema: float | None) -> None:
    """CheckpointError unless a run of this model, precision and train.ema can continue checkpoint `where`."""
    differs = [f"model.{k}: checkpoint {saved!r}, config {v!r}" for k, saved, v in
               parameter_differences(meta.model, model_config)]
    if differs:
        raise CheckpointError(f"{where}: the checkpoint's model differs from the config: " + "; ".join(differs))
    if meta.precision != precision:
        raise CheckpointError(
            f"{where}: the checkpoint was trained with zero.precision={meta.precision}, the config says "
            f"{precision}; resume with --set zero.precision={meta.precision} (the optimizer state differs: "
            "mixed keeps float32 master weights in it; zerolm does not change a run's precision mid-way)")
    if meta.ema != ema:
        null = lambda v: "null" if v is None else v  # noqa: E731
        raise CheckpointError(
            f"{where}: the checkpoint was trained with train.ema={null(meta.ema)}, the config says {null(ema)}; resume "
            f"with --set train.ema={null(meta.ema)} (the moving average lives in the optimizer state and goes on with "
            "the decay it began with: zerolm does not start, stop or change one mid-run)")


# Keys that change how the model computes, not what its parameters are.
_COMPUTE_ONLY = {"dtype", "attention", "attention_block", "remat", "scan_layers", "loss_chunk", "embedding_dropout",
                 "residual_dropout", "attention_dropout",
                 "eot_id"}  # the tokenizer's: the data's identity (its sha256) already pins it


def parameter_differences(saved_model: dict, model_config: dict, *, besides: tuple[str, ...] = ()) -> list[tuple]:
    """(key, saved value, config value) of each model setting that differs and makes other parameters
    (not one of _COMPUTE_ONLY, nor of `besides`), in the config's key order."""
    # A key differs where it is written differently and means different shapes (auto and the number it resolves
    # to are the same). Where the config leaves a key auto, what it resolves to follows other keys: a difference
    # there is named only where no key the config sets differs (a checkpoint records the number a run resolved).
    saved, wanted = resolved_shape(saved_model), resolved_shape(model_config)
    differing = [(k, saved_model.get(k), v) for k, v in model_config.items()
                 if saved_model.get(k) != v and saved.get(k) != wanted.get(k) and k not in _COMPUTE_ONLY
                 and k not in besides]
    explicit = [d for d in differing if d[2] != "auto"]
    return explicit or differing
