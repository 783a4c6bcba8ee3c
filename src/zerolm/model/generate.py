"""Generation with a KV cache, for `zerolm sample`, training's samples, the harness and `zerolm serve`.

A `Batch` is R rows that decode together, each its own sequence at its own position: prompts are admitted
into free rows (`admit`: `prefill` runs their positions once, on rows of their own, `insert` puts them in
the batch), then every `step` draws each row's next token and runs the model one position further on all
rows at once, so a row can join or leave between any two steps (continuous batching), and `regroup` moves
the rows held into a batch of another size. Prompts of one length bucket that arrive together are
prefilled and inserted together (`admit_together`), in one call each. `prefill` is compiled once per
prompt-length bucket (powers of two) and number of prompts, the others once per row count, whatever the
prompts, the number of new tokens or the sampling settings, which are traced values. A prefill can also
score the prompts' own tokens (`Scores`: echo).

One sampler (`pick`) for every caller, with its settings in one record (zerolm.config.sampling.Sampling):
the repetition penalty on the tokens the row holds, greedy at temperature 0, else temperature, top-k,
top-p and typical sampling, in Hugging Face's order. Each row draws with its own key, folded with the
number of tokens it has drawn: a row's tokens do not depend on which rows decode beside it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerolm.config.sampling import Sampling
from zerolm.core.errors import UsageError
from zerolm.model.block import Decoding
from zerolm.model.decoder import GPT, init_cache, output_embedding, output_logits

MIN_BUCKET = 16
DRAWS = 4  # tokens each row draws per call of `step`
TOP_LOGPROBS = 5  # the most likely tokens' log-probabilities each step reports (OpenAI's logprobs: at most 5)


class Rule(NamedTuple):
    """Each row's sampling settings, (R,) arrays: a new value compiles nothing."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    typical_p: jax.Array
    penalty: jax.Array

    @staticmethod
    def of(sampling: Sampling) -> Rule:
        """One row's settings: scalars."""
        return jax.tree.map(lambda column: column[0], Rule.rows([sampling]))

    @staticmethod
    def rows(samplings: list[Sampling]) -> Rule:
        """One row's settings per sampling: (N,) arrays."""
        def column(field: str) -> jax.Array:
            return jnp.asarray([getattr(s, field) for s in samplings], jnp.float32)
        top_k = [min(s.top_k, np.iinfo(np.int32).max) for s in samplings]  # any k past the vocabulary keeps it all
        return Rule(column("temperature"), jnp.asarray(top_k, jnp.int32), column("top_p"), column("typical_p"),
                    column("repetition_penalty"))


def penalized(logits_V: jax.Array, seen_V: jax.Array, penalty: jax.Array) -> jax.Array:
    """The repetition penalty: a seen token's logit divided by the penalty when positive, multiplied when not."""
    return jnp.where(seen_V, jnp.where(logits_V > 0, logits_V / penalty, logits_V * penalty), logits_V)


def filtered(logits_V: jax.Array, rule: Rule) -> jax.Array:
    """A row's logits divided by the temperature, with -inf where top-k, top-p or typical sampling cuts (each
    keeps at least the most likely token; ties at a cut are kept, as Hugging Face's warpers keep them)."""
    V = logits_V.shape[-1]
    scaled_V = logits_V / jnp.maximum(rule.temperature, 1e-6)
    kth = jnp.sort(scaled_V)[::-1][jnp.clip(rule.top_k - 1, 0, V - 1)]
    scaled_V = jnp.where((rule.top_k > 0) & (scaled_V < kth), -jnp.inf, scaled_V)
    # top-p: the most likely tokens until their probability reaches top_p (the one that crosses it too).
    sorted_V = jnp.sort(scaled_V)[::-1]
    probs_V = jax.nn.softmax(sorted_V)
    before_V = jnp.cumsum(probs_V) - probs_V
    threshold = jnp.min(jnp.where(before_V < rule.top_p, sorted_V, jnp.inf))
    scaled_V = jnp.where((rule.top_p < 1) & (scaled_V < threshold), -jnp.inf, scaled_V)
    # typical: the tokens whose information (-log p) is nearest the entropy, until their probability
    # reaches typical_p (the one that crosses it too).
    logp_V = jax.nn.log_softmax(scaled_V)
    p_V = jnp.exp(logp_V)
    entropy = -jnp.sum(jnp.where(p_V > 0, p_V * logp_V, 0.0))
    distance_V = jnp.abs(-logp_V - entropy)
    order_V = jnp.argsort(distance_V)
    reach_V = jnp.cumsum(p_V[order_V])
    last = jnp.minimum(jnp.sum(reach_V < rule.typical_p), V - 1)
    keep_V = distance_V <= distance_V[order_V[last]]
    return jnp.where(keep_V | (rule.typical_p >= 1), scaled_V, -jnp.inf)


def pick(logits_RxV: jax.Array, seen_RxV: jax.Array, keys_R: jax.Array, rule: Rule) -> jax.Array:
    """Each row's next token: greedy at temperature 0, else drawn from the filtered distribution. The sorts
    the cuts need run only when a row asks for a cut. A row's draw is one uniform number against its
    distribution's cumulative sum (not a Gumbel number per vocabulary entry: 2048 draws where one does, a
    third of a small model's step)."""
    logits_RxV = jax.vmap(penalized)(logits_RxV, seen_RxV, rule.penalty)
    cuts = jnp.any((rule.top_k > 0) | (rule.top_p < 1) | (rule.typical_p < 1))
    scaled_RxV = lax.cond(cuts, jax.vmap(filtered), lambda x, r: x / jnp.maximum(r.temperature, 1e-6)[:, None],
                          logits_RxV, rule)
    drawn_R = jax.vmap(_draw)(keys_R, scaled_RxV)
    return jnp.where(rule.temperature > 0, drawn_R, jnp.argmax(logits_RxV, axis=-1)).astype(jnp.int32)


def _draw(key: jax.Array, logits_V: jax.Array) -> jax.Array:
    """A token drawn from softmax(logits_V): the first whose cumulative probability reaches u in (0, 1] (a token of
    probability 0 never does)."""
    cumulative_V = jnp.cumsum(jax.nn.softmax(logits_V))
    u = 1.0 - jax.random.uniform(key)
    return jnp.searchsorted(cumulative_V, u * cumulative_V[-1], side="left")


class Batch(NamedTuple):
    """R rows' decoding state on the device: the KV cache, each row's next-token logits and position (where the
    next token goes), the tokens it holds (for the repetition penalty), its settings, its key and draws."""

    cache: Any
    logits_RxV: jax.Array
    position_R: jax.Array
    seen_RxV: jax.Array
    rule: Rule
    key_R: jax.Array
    drawn_R: jax.Array


class Drawn(NamedTuple):
    """One step's tokens, their log-probabilities under the model (before any sampling setting), and each row's
    TOP_LOGPROBS most likely tokens with theirs."""

    token_R: jax.Array
    logprob_R: jax.Array
    top_ids_RxN: jax.Array
    top_logprobs_RxN: jax.Array


def empty(model: GPT, rows: int) -> Batch:
    """R free rows."""
    V = model.cfg.padded_vocab_size

    def full(value, dtype=jnp.float32):  # each its own buffer: a step donates them all
        return jnp.full(rows, value, dtype)
    return Batch(init_cache(model, rows), jnp.zeros((rows, V), jnp.float32), full(0, jnp.int32),
                 jnp.zeros((rows, V), bool), Rule(full(0), full(0, jnp.int32), full(1), full(1), full(1)),
                 jax.random.split(jax.random.key(0), rows), full(0, jnp.int32))


def _forward(model: GPT, params, cache, tokens_RxS, start_R):
    x_RxSxD, variables = model.apply({"params": params, "cache": cache}, tokens_RxS, decoding=Decoding(start_R),
                                     hidden_only=True, mutable=["cache"])
    return x_RxSxD, variables["cache"]


class Scores(NamedTuple):
    """N prompts' own tokens scored (echo): each position's log-probability of the token there given those
    before it (position 0: 0, nothing before it), and the TOP_LOGPROBS most likely tokens there with theirs."""

    logprob_NxP: jax.Array
    top_ids_NxPxK: jax.Array
    top_logprobs_NxPxK: jax.Array


class Prefilled(NamedTuple):
    """N prompts run through the model, each on a row of its own: their cache, each one's next-token logits,
    the tokens each holds, and (echo) their scores."""

    cache: Any
    logits_NxV: jax.Array
    seen_NxV: jax.Array
    scores: Scores | None


@functools.partial(jax.jit, static_argnames=("model", "echo"))
def prefill(model: GPT, params, prompts_NxP: jax.Array, lengths_N: jax.Array, echo: bool = False) -> Prefilled:
    """N prompts padded to one bucket (row n's first lengths_N[n] tokens count) run once, together: compiled
    per bucket and N, whatever the batch they join."""
    N, P = prompts_NxP.shape
    V = model.cfg.padded_vocab_size
    x_NxPxD, cache = _forward(model, params, init_cache(model, N), prompts_NxP, jnp.zeros(N, jnp.int32))
    embedding = output_embedding(params)
    logits_NxV = output_logits(x_NxPxD[jnp.arange(N), lengths_N - 1], embedding, model.cfg.vocab_size)
    counted_NxP = jnp.arange(P) < lengths_N[:, None]
    seen_NxV = jnp.zeros((N, V), bool).at[jnp.arange(N)[:, None], prompts_NxP].max(counted_NxP)
    scores = None
    if echo:
        logp_NxPxV = jax.nn.log_softmax(output_logits(x_NxPxD, embedding, model.cfg.vocab_size))
        top_logprobs, top_ids = lax.top_k(logp_NxPxV, TOP_LOGPROBS)
        # position p's token given those before it: row p - 1's distribution
        logprob_NxP = jnp.take_along_axis(logp_NxPxV[:, :-1], prompts_NxP[:, 1:, None], axis=2)[..., 0]
        scores = Scores(jnp.concatenate([jnp.zeros((N, 1)), logprob_NxP], axis=1),
                        jnp.concatenate([top_ids[:, :1], top_ids[:, :-1]], axis=1),
                        jnp.concatenate([top_logprobs[:, :1], top_logprobs[:, :-1]], axis=1))
    return Prefilled(cache, logits_NxV, seen_NxV, scores)


@functools.partial(jax.jit, donate_argnames=("batch",))
def insert(batch: Batch, rows_N: jax.Array, lengths_N: jax.Array, prefilled: Prefilled, rule: Rule,
           keys_N: jax.Array) -> Batch:
    """N prefilled prompts put in free rows `rows_N` (a row past the batch's: a prompt that only pads the
    prefill, dropped): each row's next step draws the token after its prompt."""
    def put(full, some, axis=0):
        index = (slice(None),) * axis + (rows_N,)
        return full.at[index].set(some, mode="drop")
    return Batch(jax.tree.map(lambda full, some: put(full, some, axis=1), batch.cache, prefilled.cache),
                 put(batch.logits_RxV, prefilled.logits_NxV), put(batch.position_R, lengths_N),
                 put(batch.seen_RxV, prefilled.seen_NxV), jax.tree.map(put, batch.rule, rule),
                 put(batch.key_R, keys_N), put(batch.drawn_R, jnp.zeros_like(lengths_N)))


class Arrival(NamedTuple):
    """A prompt for a free row: its tokens (at most seq_len - 1), how its tokens are drawn and with which key,
    and whether its own tokens are scored (echo)."""

    prompt: np.ndarray
    sampling: Sampling
    key: jax.Array
    echo: bool = False


def admit(model: GPT, params, batch: Batch, row: int, arrival: Arrival) -> tuple[Batch, Prefilled]:
    """A prompt prefilled into free row `row` of `batch`; the prefill (its scores with echo) beside."""
    return admit_together(model, params, batch, [row], [arrival])


def admit_together(model: GPT, params, batch: Batch, rows: list[int], arrivals: list[Arrival],
                   width: int | None = None) -> tuple[Batch, Prefilled]:
    """Prompts of one length bucket, all with echo or none, prefilled together into free rows `rows` of
    `batch`, in one call of each program (the prefill padded to `width` prompts, the count it is compiled
    for: default, as many as there are); the prefill beside (its first len(arrivals) rows are theirs)."""
    N, T = width or len(arrivals), model.cfg.seq_len
    P = bucket(max(a.prompt.size for a in arrivals), T)
    prompts_NxP, lengths_N = np.zeros((N, P), np.int32), np.ones(N, np.int32)
    rows_N = np.full(N, batch.position_R.shape[0], np.int32)  # past the batch's rows: dropped
    for n, (row, arrival) in enumerate(zip(rows, arrivals, strict=True)):
        assert bucket(arrival.prompt.size, T) == P and arrival.echo == arrivals[0].echo
        prompts_NxP[n, :arrival.prompt.size], lengths_N[n], rows_N[n] = arrival.prompt, arrival.prompt.size, row
    # echo by name, as every caller passes it: jit keys its compiled programs on how a static argument was
    # passed too, and a program compiled for one spelling is compiled again for another
    prefilled = prefill(model, params, prompts_NxP, lengths_N, echo=arrivals[0].echo)
    samplings = [a.sampling for a in arrivals]
    rule = Rule.rows(samplings + samplings[:1] * (N - len(arrivals)))
    keys_N = jnp.stack([a.key for a in arrivals] + [arrivals[0].key] * (N - len(arrivals)))
    return insert(batch, rows_N, lengths_N, prefilled._replace(scores=None), rule, keys_N), prefilled


@jax.jit
def regroup(batch: Batch, rows_N: jax.Array) -> Batch:
    """A batch of N rows: row i is `batch`'s row rows_N[i] (a row no one holds may be any)."""
    def rows(axis):
        return lambda a: jnp.take(a, rows_N, axis=axis)
    rest = {field: jax.tree.map(rows(0), getattr(batch, field)) for field in Batch._fields if field != "cache"}
    return Batch(cache=jax.tree.map(rows(1), batch.cache), **rest)  # the cache's rows are its axis 1


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("batch",))
def step(model: GPT, params, batch: Batch) -> tuple[Batch, Drawn]:
    """DRAWS steps (`one_step`) in one program, each row's draws with a leading (DRAWS,) axis: a call and the
    host's wait for its tokens are paid once for several, which a small model's step costs as much as. Past a
    row's end (its stop, the context's end) the caller leaves its extra tokens unread."""
    return lax.scan(lambda b, _: one_step(model, params, b), batch, None, length=DRAWS)


def one_step(model: GPT, params, batch: Batch) -> tuple[Batch, Drawn]:
    """Every row's next token drawn, then the model run one position further on all of them."""
    keys_R = jax.vmap(jax.random.fold_in)(batch.key_R, batch.drawn_R)
    token_R = pick(batch.logits_RxV, batch.seen_RxV, keys_R, batch.rule)
    logp_RxV = jax.nn.log_softmax(batch.logits_RxV)
    top_logprobs, top_ids = lax.top_k(logp_RxV, TOP_LOGPROBS)
    drawn = Drawn(token_R, jnp.take_along_axis(logp_RxV, token_R[:, None], axis=1)[:, 0], top_ids, top_logprobs)
    T = model.cfg.seq_len
    x_Rx1xD, cache = _forward(model, params, batch.cache, token_R[:, None], jnp.minimum(batch.position_R, T - 1))
    logits_RxV = output_logits(x_Rx1xD[:, 0], output_embedding(params), model.cfg.vocab_size)
    seen_RxV = batch.seen_RxV.at[jnp.arange(token_R.shape[0]), token_R].set(True)
    return batch._replace(cache=cache, logits_RxV=logits_RxV, position_R=batch.position_R + 1, seen_RxV=seen_RxV,
                          drawn_R=batch.drawn_R + 1), drawn


def bucket(n: int, seq_len: int) -> int:
    """The padded prompt length: the next power of two (at least MIN_BUCKET), at most seq_len."""
    return min(seq_len, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def generate(model: GPT, params, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None,
             eot_id: int = -1) -> np.ndarray:
    """The prompt followed by up to `max_new_tokens` new tokens (fewer at the end of the context or after
    `eot_id`, which is kept), drawn with `sampling` (its seed None: 0). The prompt must leave room for one
    token; an empty prompt starts at `eot_id`."""
    T = model.cfg.seq_len
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    if prompt.size == 0:
        prompt = np.asarray([max(eot_id, 0)], np.int32)
    if prompt.size >= T:
        raise UsageError(f"the prompt has {prompt.size} tokens; the model's context is {T} (model.seq_len), "
                         f"so at most {T - 1} leave room to generate")
    sampling = sampling or Sampling()
    batch, _ = admit(model, params, empty(model, 1), 0, Arrival(prompt, sampling, jax.random.key(sampling.seed or 0)))
    tokens, wanted = [int(t) for t in prompt], prompt.size + max(0, min(max_new_tokens, T - prompt.size))
    while len(tokens) < wanted:
        batch, drawn = step(model, params, batch)
        for token in np.asarray(drawn.token_R[:, 0]).tolist()[:wanted - len(tokens)]:
            tokens.append(token)
            if token == eot_id:
                return np.asarray(tokens, np.int32)
    return np.asarray(tokens, np.int32)
