"""A zerolm model as a backend of EleutherAI's lm-evaluation-harness (the `lm-eval` package, `pip install
zerolm[eval]`): the harness's model interface (log-likelihoods of continuations, rolling log-likelihoods
for perplexity and bits per byte, generation until a stop sequence) run by zerolm's own model on a mesh,
its parameters sharded however they are (a restored checkpoint's replicated ones, or a training run's at
any dp, tp and ZeRO stage: the programs take the arrays' own shardings).

    lm = ZerolmLM(checkpoint="checkpoints/tiny")         # what `--model zerolm --model_args checkpoint=...` makes
    lm_eval.simple_evaluate(model=lm, tasks=["zerolm_cloze"])

Requests are scored as the harness's `hf` backend scores them, so the numbers are the same: a continuation's
tokens are those of context + continuation after the context's (a context's trailing spaces moved to the
continuation), an empty context is the end-of-text token, and a request longer than the model's context
keeps its last seq_len + 1 tokens (truncated from the left). They go through the model in batches of a
fixed number of rows (a multiple of the mesh's dp), each padded to one of a few lengths (powers of two from
128, and seq_len), longest first: a handful of programs compile, whatever the requests.

Importing this module registers the backend under the name "zerolm" (`lm_eval.api.registry`); the harness's
own `lm_eval` command imports nothing of zerolm, so `python -m zerolm.lm_eval_cli` is that command with the
backend registered and zerolm's task definitions (zerolm.eval.tasks) on its include path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

# lm_eval.models: the harness's own models, registered before ours (its registry imports them only while it is
# empty, so once "zerolm" is in it, "hf" and the rest would be unknown).
import lm_eval.models  # noqa: F401
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from zerolm.config.sampling import Sampling
from zerolm.core.errors import UsageError
from zerolm.data.contamination import training_locations
from zerolm.data.tokenizer import Tokenizer
from zerolm.model.decoder import GPT
from zerolm.model.generate import generate
from zerolm.parallel.mesh import data_ranks
from zerolm.parallel.sharding import rows as row_sharding

DEFAULT_BATCH = 8  # rows per batch when the harness says "auto" or nothing
MIN_LENGTH = 128  # the shortest padded length (Pallas attention's block; shorter models use seq_len)
MAX_GEN_TOKS = 256  # generate_until's default, as the hf backend's


def lengths(seq_len: int) -> list[int]:
    """The padded lengths a batch takes: powers of two from MIN_LENGTH below seq_len, and seq_len."""
    out, n = [seq_len], MIN_LENGTH
    while n < seq_len:
        out.append(n)
        n *= 2
    return sorted(out)


def _row_scores(model: GPT, params, inputs_BxL: jax.Array, targets_BxL: jax.Array, scored_BxL: jax.Array):
    """Each row's summed log-probability of its scored targets, and whether every one is the argmax."""
    logits_BxLxV = model.apply({"params": params}, inputs_BxL)
    assert isinstance(logits_BxLxV, jax.Array)
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    lse_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    greedy_BxL = jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
    return (jnp.where(scored_BxL, target_BxL - lse_BxL, 0.0).sum(-1),
            jnp.all(greedy_BxL | ~scored_BxL, axis=-1))


class Scorer:
    """Log-likelihoods of token continuations on `mesh`, `batch_rows` rows at a time (rounded up to a multiple
    of dp), each batch padded to one of `lengths(seq_len)`."""

    def __init__(self, model: GPT, params, mesh: jax.sharding.Mesh, batch_rows: int):
        self.model, self.params, self.mesh = model, params, mesh
        dp = data_ranks(mesh)
        self.batch_rows = -(-batch_rows // dp) * dp
        self.lengths = lengths(model.cfg.seq_len)
        self.rows_sharding = row_sharding(mesh)
        replicated = NamedSharding(mesh, P())  # every process reads the scores (a multi-host mesh too)
        self._program = jax.jit(functools.partial(_row_scores, model), out_shardings=(replicated, replicated))
        self.batches = self.requests = 0  # batches run and sequences scored: for the benchmark and the tests

    def _global(self, host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, self.rows_sharding, lambda index: host[index])

    def score(self, sequences: Sequence[np.ndarray], n_scored: Sequence[int]) -> list[tuple[float, bool]]:
        """For each sequence (at most seq_len + 1 tokens): the log-probability of its last `n_scored` tokens
        given those before, and whether each is the model's most likely next token."""
        self.requests += len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(sequences)
        for start in range(0, len(order), self.batch_rows):
            batch = order[start:start + self.batch_rows]
            longest = len(sequences[batch[0]]) - 1
            L = next(n for n in self.lengths if n >= longest)
            tokens = np.zeros((self.batch_rows, L + 1), np.int32)
            scored = np.zeros((self.batch_rows, L), bool)
            for row, i in enumerate(batch):
                seq = sequences[i]
                tokens[row, :len(seq)] = seq
                scored[row, len(seq) - 1 - n_scored[i]:len(seq) - 1] = True
            logprob_B, greedy_B = self._program(self.params, self._global(tokens[:, :-1]), self._global(tokens[:, 1:]),
                                                self._global(scored))
            self.batches += 1
            logprob_B, greedy_B = np.asarray(logprob_B), np.asarray(greedy_B)
            for row, i in enumerate(batch):
                out[i] = (float(logprob_B[row]), bool(greedy_B[row]))
        return out


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model to evaluate: its parameters (sharded over `mesh`) and its tokenizer."""

    model: GPT
    params: Any
    mesh: jax.sharding.Mesh
    tokenizer: Tokenizer
    checkpoints: str = ""  # the run's checkpoint directory ("" for a training run's live model)
    step: int = 0
    data: tuple[str, ...] = ()  # where the run's training data is (zerolm.data.contamination.training_locations)

    @property
    def name(self) -> str:
        """What the harness's results name as the model."""
        return f"{self.checkpoints or 'zerolm'} step {self.step}"


def _batch_rows(batch_size: int | str | None) -> int:
    """The harness's --batch_size: a number, or "auto"/"auto:N"/None (DEFAULT_BATCH: zerolm pads to fixed
    shapes, so a larger batch only costs memory)."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return DEFAULT_BATCH
    try:
        rows = int(batch_size)
    except ValueError:
        raise UsageError(f"--batch-size: {batch_size!r} is not a number") from None
    if rows <= 0:
        raise UsageError(f"--batch-size: {rows} must be > 0")
    return rows


def load_checkpoint(checkpoint: str, tokenizer: str | None = None) -> Loaded:
    """A checkpoint as `zerolm eval` restores it (its newest intact step, or the step named; its parameters
    replicated over this process's devices) with the run's tokenizer (or the file `tokenizer`)."""
    from zerolm.checkpoint import trained_model as restored
    from zerolm.core.storage import check

    check(checkpoint, "checkpoint")
    model_run = restored.load(checkpoint)
    return Loaded(model_run.model, model_run.params, model_run.mesh, model_run.tokenizer(tokenizer),
                  str(model_run.where.parent), model_run.step,
                  tuple(training_locations(model_run.config, model_run.meta.dataset_location)))


@register_model("zerolm")
class ZerolmLM(TemplateLM):
    """The harness's model: `checkpoint` (a run's checkpoint directory or a step's, local or gs://) and
    optionally `tokenizer` (the run's tokenizer file, if its dataset is not where the checkpoint says), or an
    already `loaded` model (a training run's). `batch_size`: rows per batch."""

    backend = "causal"

    def __init__(self, checkpoint: str | None = None, tokenizer: str | None = None, batch_size: int | str | None = None,
                 max_gen_toks: int | str = MAX_GEN_TOKS, loaded: Loaded | None = None, **_harness: Any):
        """`_harness`: what the harness passes every backend and zerolm has no use for (device, max_batch_size:
        the mesh decides where it runs and the batch is fixed)."""
        super().__init__()
        if loaded is None:
            if checkpoint is None:
                raise UsageError("the zerolm model needs checkpoint=DIR (--model_args checkpoint=checkpoints/tiny)")
            loaded = load_checkpoint(str(checkpoint), tokenizer)
        self.loaded = loaded
        self.zerolm_tokenizer = loaded.tokenizer
        self.scorer = Scorer(loaded.model, loaded.params, loaded.mesh, _batch_rows(batch_size))
        self._max_gen_toks = int(max_gen_toks)

    def use_params(self, params: Any, step: int) -> None:
        """Score with `params` from now on (a training run's, at the step it evaluates), sharded as before:
        the programs already compiled run again."""
        self.loaded = dataclasses.replace(self.loaded, params=params, step=step)
        self.scorer.params = params

    @property
    def eot_token_id(self) -> int:
        eot = self.zerolm_tokenizer.eot_id
        assert eot is not None  # (a Tokenizer refuses a file without one)
        return int(eot)

    @property
    def max_length(self) -> int:
        return self.loaded.model.cfg.seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.zerolm_tokenizer.name

    def get_model_info(self) -> dict:
        return {"model_name": self.loaded.name, "tokenizer_sha256": self.zerolm_tokenizer.sha256}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.zerolm_tokenizer.encode(string).tolist()

    def tok_decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        return self.zerolm_tokenizer.decode(tokens)

    quiet = False  # no progress bar of the harness's own (a training run's evaluation: zerolm.eval.downstream)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """`requests`: (cache key, context tokens, continuation tokens); each keeps its last seq_len + 1
        tokens, the continuation's scored (all of it that is left)."""
        sequences, n_scored = [], []
        for _, context, continuation in requests:
            whole = np.asarray([*context, *continuation], np.int32)[-(self.max_length + 1):]
            sequences.append(whole)
            n_scored.append(min(len(continuation), len(whole) - 1))
        results = self.scorer.score(sequences, n_scored)
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood: seq_len-token windows, each scored given the one before (the first
        given end-of-text), as the hf backend cuts them."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation (greedy unless the task asks to sample), cut before the first of its
        stop sequences; the context keeps its last seq_len - max_gen_toks tokens."""
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            keep = max(1, self.max_length - max_new)
            prompt = self.tok_encode(context)[-keep:] if context else []
            tokens = generate(self.loaded.model, self.loaded.params, prompt, max_new, Sampling(temperature=temperature),
                              self.eot_token_id)
            text = self.tok_decode(tokens[max(len(prompt), 1):])
            for stop in [*until, self.zerolm_tokenizer.eot_text]:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
