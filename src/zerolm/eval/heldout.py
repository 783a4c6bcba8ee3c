"""Held-out loss: the evaluator training calls every `train.eval_every` steps, and `zerolm eval`.

The loss is the mean next-token loss over a fixed set of sequences (the split's first N), and the
perplexity is exp of it. The sequences go through the mesh in padded, masked batches, so the set,
not the device count, decides what is averaged: the same checkpoint gives the same number on 1 or 8
devices.

    zerolm eval --checkpoint checkpoints/tiny            # newest intact step, the run's held-out split
    zerolm eval --checkpoint checkpoints/tiny/200 --data /data/other-prepared --split val --sequences 512
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from zerolm.data.dataset import recorded_dataset
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.model import losses
from zerolm.observe.metrics import perplexity
from zerolm.parallel.sharding import rows as row_sharding

# The sequences `zerolm eval` reads when neither --sequences nor the run says how many: a run trained with
# train.eval_sequences 0 evaluated nothing while training, which says nothing of what may be evaluated later.
# (configs/defaults.yaml's train.eval_sequences; tests/test_evaluate.py checks they agree.)
DEFAULT_SEQUENCES = 256


def make_evaluator(token_loss_fn, param_shardings, rows_sharding, rows_NxT1: np.ndarray, batch_rows: int):
    """Mean token loss of `params` over the rows (N sequences of seq_len + 1 tokens).

    The rows go `batch_rows` at a time, sharded like a training micro-batch; the last batch is
    padded and its padding masked out."""
    n_rows, T1 = rows_NxT1.shape
    n_batches = -(-n_rows // batch_rows)
    tokens = np.zeros((n_batches * batch_rows, T1), np.int32)
    tokens[:n_rows] = rows_NxT1
    weights = (np.arange(n_batches * batch_rows) < n_rows).astype(np.float32)

    def global_rows(host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, rows_sharding, lambda index: host[index])

    batches = [(global_rows(tokens[i * batch_rows:(i + 1) * batch_rows]),
                global_rows(weights[i * batch_rows:(i + 1) * batch_rows])) for i in range(n_batches)]
    total = jax.jit(lambda params, tokens_BxT1, weight_B: (token_loss_fn(params, tokens_BxT1).sum(-1) * weight_B).sum(),
                    in_shardings=(param_shardings, rows_sharding, rows_sharding))

    def evaluate(params) -> float:
        return sum(float(total(params, t, w)) for t, w in batches) / (n_rows * (T1 - 1))

    return evaluate


def evaluate_checkpoint(model_run, data: str | None, split: str, sequences: int | None,
                        seq_len: int | None = None) -> dict:
    """The loss of `model_run` on a split's first `sequences` (None: the run's train.eval_sequences, or
    DEFAULT_SEQUENCES if that is 0; fewer if the split has fewer). `seq_len`: at that context instead of the
    trained one (longer only for ALiBi models): each sequence is that many tokens of the dataset's stream,
    consecutive samples joined (a dataset's samples are consecutive stretches of its text)."""
    trained = model_run.model.cfg.seq_len
    if seq_len is not None:
        model_run = model_run.at_context(seq_len, "--seq-len")
    model_cfg = model_run.model.cfg
    location = data or model_run.meta.dataset_location
    flag = "--data" if data else f"{model_run.where}: the run's dataset"
    try:
        # The run's own data by default: its dataset, or its mixture (the validation set training logged).
        dataset = PreparedDataset(data) if data else recorded_dataset(model_run.config, location)
    except DataError as e:
        raise DataError(f"{flag}: {e}") from None
    location = dataset.location
    if dataset.seq_len != trained:
        raise DataError(f"{flag}: {location} has sequences of {dataset.seq_len} tokens, the model "
                        f"{trained} (model.seq_len)")
    if dataset.manifest.tokenizer.sha256 != model_run.tokenizer_sha256:
        raise DataError(f"{flag}: {location} was prepared with another tokenizer ({dataset.manifest.tokenizer.name}, "
                        f"sha256 {dataset.manifest.tokenizer.sha256[:12]}) than the model's "
                        f"(sha256 {model_run.tokenizer_sha256[:12]})")
    rows = dataset.split(split)
    join = -(-(model_cfg.seq_len + 1) // (trained + 1))  # samples per sequence at the context evaluated
    n = min(sequences or model_run.config["train"]["eval_sequences"] or DEFAULT_SEQUENCES, len(rows) // join)
    if n == 0:
        raise DataError(f"{flag}: {location} has no {split} sequences" + (
            f" of {model_cfg.seq_len} tokens" if join > 1 else ""))
    stream = rows.head(n * join).reshape(n, join * (trained + 1))[:, :model_cfg.seq_len + 1]
    mesh = model_run.mesh
    evaluate = make_evaluator(functools.partial(losses.token_losses, model_run.model),
                              jax.tree.map(lambda x: x.sharding, model_run.params), row_sharding(mesh),
                              stream, mesh.size * model_run.config["train"]["micro_batch_size"])
    loss = evaluate(model_run.params)
    return {"checkpoint": str(model_run.where.parent), "step": model_run.step, "dataset": str(dataset.location),
            "split": split, "sequences": n, "seq_len": model_cfg.seq_len, "tokens": n * model_cfg.seq_len, "loss": loss,
            "perplexity": perplexity(loss)}
