"""Sampling with the KV cache against decoding that recomputes the whole sequence per token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from zerolm.config.sampling import Sampling, checked
from zerolm.core.errors import UsageError
from zerolm.model import decoder as gpt_model
from zerolm.model import generate as sample
from zerolm.model.generate import generate
from zerolm.parallel.auto import for_device


@pytest.fixture(scope="module")
def model_and_params():
    cfg = small_config("model.seq_len=48", "model.vocab_size=100")
    model = gpt_model.GPT(for_device(cfg.model))
    params = gpt_model.init_params(model, jax.random.key(3))
    # A random init at GPT-2's scale predicts nearly the same token everywhere; larger weights make each
    # position's argmax depend on the tokens and positions before it, which is what is compared.
    return model, jax.tree.map(lambda p: p * 30 if p.ndim >= 2 else p, params)


def recompute_greedy(model, params, prompt, n_new):
    """The reference: a full forward pass over the whole sequence for every new token (over a fixed
    seq_len buffer, compiled once: causal attention makes the positions after the last token irrelevant)."""
    forward = jax.jit(lambda buf: model.apply({"params": params}, buf[None])[0])
    ids = list(prompt)
    for _ in range(n_new):
        buf = np.zeros(model.cfg.seq_len, np.int32)
        buf[:len(ids)] = ids
        ids.append(int(jnp.argmax(forward(buf)[len(ids) - 1])))
    return ids


@pytest.mark.parametrize("prompt_len", [1, 5, 16, 17, 40])  # inside, at and past a bucket edge
def test_greedy_with_the_kv_cache_equals_recomputing_the_sequence(model_and_params, prompt_len):
    model, params = model_and_params
    prompt = np.random.default_rng(prompt_len).integers(0, 100, prompt_len)
    n_new = 48 - prompt_len
    want = recompute_greedy(model, params, prompt, n_new)
    assert len(set(want[prompt_len:])) > 3  # the continuation is not one repeated token
    got = generate(model, params, prompt, n_new, Sampling(temperature=0))
    assert got.tolist() == want


def test_compiled_once_per_prompt_bucket(model_and_params):
    model, params = model_and_params
    sample.prefill.clear_cache()
    sample.insert.clear_cache()
    sample.step.clear_cache()
    for n, new, settings in [(3, 5, Sampling(temperature=0)), (9, 20, Sampling(temperature=0.7, top_k=5, seed=1)),
                             (16, 2, Sampling(temperature=1.0, top_p=0.5, typical_p=0.9, repetition_penalty=1.3))]:
        generate(model, params, np.arange(n), new, settings)
    assert sample.prefill._cache_size() == 1  # prompts of 3, 9 and 16 tokens share the 16 bucket
    assert sample.step._cache_size() == sample.insert._cache_size() == 1
    generate(model, params, np.arange(17), 3, Sampling(temperature=0))
    assert sample.prefill._cache_size() == 2
    assert sample.step._cache_size() == sample.insert._cache_size() == 1


def test_top_k_1_and_a_tiny_top_p_are_greedy_and_sampling_follows_the_seed(model_and_params):
    model, params = model_and_params
    prompt = np.array([4, 8, 15, 16, 23, 42])
    greedy = generate(model, params, prompt, 20, Sampling(temperature=0))
    assert generate(model, params, prompt, 20, Sampling(temperature=1.5, top_k=1, seed=7)).tolist() == greedy.tolist()
    assert generate(model, params, prompt, 20, Sampling(temperature=1.5, top_p=1e-6, seed=7)).tolist() == greedy.tolist()
    a, b = (generate(model, params, prompt, 20, Sampling(temperature=1.5, seed=s)) for s in (1, 2))
    assert a.tolist() == generate(model, params, prompt, 20, Sampling(temperature=1.5, seed=1)).tolist()
    assert a.tolist() != b.tolist()


def test_rows_decode_as_they_would_alone_joining_leaving_and_regrouped(model_and_params):
    """Continuous batching: rows admitted at different steps, with their own settings and seeds, moved into
    a batch of another size midway, draw the tokens each draws alone."""
    model, params = model_and_params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, n) for n in (3, 20, 7)]
    settings = [Sampling(temperature=0), Sampling(temperature=1.2, top_k=30, seed=5),
                Sampling(temperature=0.9, top_p=0.8, repetition_penalty=1.2, seed=9)]
    alone = [generate(model, params, p, 12, s)[p.size:].tolist() for p, s in zip(prompts, settings, strict=True)]
    batch, got = sample.empty(model, 4), [[], [], []]  # each call of step draws sample.DRAWS tokens a row
    joins = {0: [(0, 2)], 1: [(1, 0)], 2: [(2, 3)]}  # call of step: (prompt, row)
    where = {}
    for t in range(6):
        for i, row in joins.get(t, []):
            arrival = sample.Arrival(prompts[i], settings[i], jax.random.key(settings[i].seed or 0))
            batch, _ = sample.admit(model, params, batch, row, arrival)
            where[i] = row
        if t == 3:  # the three rows held move into a batch of 8, in another order
            order = [where[2], where[0], where[1]]
            batch = sample.regroup(batch, jnp.array(order + [0] * 5))
            where = {2: 0, 0: 1, 1: 2}
        batch, drawn = sample.step(model, params, batch)
        for i, row in where.items():
            got[i] = (got[i] + np.asarray(drawn.token_R[:, row]).tolist())[:12]
    assert got == alone


def test_prompts_prefilled_together_decode_as_each_would_alone(model_and_params):
    """Prompts of one bucket admitted in one prefill of 8 (5 of them padding, dropped), into rows of a batch in
    any order, draw the tokens each draws alone; the rows no prompt was given stay free."""
    model, params = model_and_params
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 100, n) for n in (3, 11, 16)]  # one bucket: 16
    settings = [Sampling(temperature=0), Sampling(temperature=1.1, top_k=20, seed=4),
                Sampling(temperature=0.8, typical_p=0.9, repetition_penalty=1.3, seed=6)]
    alone = [generate(model, params, p, 12, s)[p.size:].tolist() for p, s in zip(prompts, settings, strict=True)]
    arrivals = [sample.Arrival(p, s, jax.random.key(s.seed or 0)) for p, s in zip(prompts, settings, strict=True)]
    rows = [5, 0, 2]
    batch, _ = sample.admit_together(model, params, sample.empty(model, 8), rows, arrivals, width=8)
    assert np.asarray(batch.position_R).tolist() == [11, 0, 16, 0, 0, 3, 0, 0]
    got = [[], [], []]
    for _ in range(3):
        batch, drawn = sample.step(model, params, batch)
        for i, row in enumerate(rows):
            got[i] += np.asarray(drawn.token_R[:, row]).tolist()
    assert got == alone


def test_a_prefill_scores_the_prompt_as_the_full_forward_does(model_and_params):
    model, params = model_and_params
    prompt = np.random.default_rng(1).integers(0, 100, 11)
    prompts_2xP = np.zeros((2, sample.bucket(11, model.cfg.seq_len)), np.int32)  # with another, shorter prompt
    prompts_2xP[0, :11], prompts_2xP[1, :4] = prompt, [7, 7, 7, 7]
    scores = sample.prefill(model, params, prompts_2xP, np.int32([11, 4]), echo=True).scores
    logp_TxV = jax.nn.log_softmax(model.apply({"params": params}, prompt[None])[0].astype(jnp.float32))
    want = [0.0] + [float(logp_TxV[p - 1, prompt[p]]) for p in range(1, 11)]
    np.testing.assert_allclose(np.asarray(scores.logprob_NxP[0, :11]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(scores.top_ids_NxPxK[0, 1:11, 0]), np.argmax(logp_TxV[:10], -1))
    np.testing.assert_allclose(np.asarray(scores.top_logprobs_NxPxK[0, 1:11, 0]), np.max(logp_TxV[:10], -1),
                               rtol=1e-5)


def rule(**kw):
    return sample.Rule.of(Sampling(temperature=kw.pop("temperature", 1.0), **kw))


def test_pick_keeps_only_the_top_k_and_the_top_p_nucleus():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    keys = jax.random.split(jax.random.key(0), 2000)
    seen = jnp.zeros((2000, 4), bool)

    def draws(**kw):
        r = jax.tree.map(lambda x: jnp.full(2000, x), rule(**kw))
        return set(np.asarray(sample.pick(jnp.broadcast_to(logits, (2000, 4)), seen, keys, r)).tolist())
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.7) == {0, 1}  # 0.5 < 0.7: the second token crosses 0.7 and is kept
    assert draws(top_p=0.5) == {0}
    assert draws() == {0, 1, 2, 3}
    # The entropy is 1.14 nats: the tokens' information -log p is 0.69, 1.20, 1.90, 3.00, so the most typical
    # is the second (0.06 from the entropy), then the first (0.45), then the third (0.76).
    assert draws(typical_p=0.3) == {1}
    assert draws(typical_p=0.7) == {0, 1}
    assert draws(typical_p=0.9) == {0, 1, 2}


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.6),
                                      dict(temperature=1.0, typical_p=0.5), dict(temperature=0.8, repetition_penalty=1.5),
                                      dict(temperature=0.9, top_k=40, top_p=0.9, typical_p=0.8, repetition_penalty=1.2)])
def test_the_sampler_cuts_the_distribution_as_hugging_face_generate_does(settings):
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as hf

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 500)) * 3).astype(np.float32)
    seen = rng.random((4, 500)) < 0.05
    r = rule(**settings)
    ours = jax.vmap(sample.filtered, (0, None))(jax.vmap(sample.penalized, (0, 0, None))(logits, seen, r.penalty), r)
    processors = [hf.RepetitionPenaltyLogitsProcessor(settings.get("repetition_penalty", 1.0)),
                  hf.TemperatureLogitsWarper(settings["temperature"])]
    if settings.get("top_k"):
        processors.append(hf.TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p"):
        processors.append(hf.TopPLogitsWarper(settings["top_p"]))
    if settings.get("typical_p"):
        processors.append(hf.TypicalLogitsWarper(settings["typical_p"]))
    # HF's penalty reads the ids the text holds; one of each seen token gives the same set.
    ids = torch.tensor([np.flatnonzero(row).tolist() + [np.flatnonzero(row)[0]] * (seen.sum(1).max() - row.sum())
                        for row in seen])
    theirs = torch.tensor(logits)
    for processor in processors:
        theirs = processor(ids, theirs)
    theirs = theirs.numpy()
    np.testing.assert_array_equal(np.isinf(np.asarray(ours)), np.isinf(theirs))
    kept = ~np.isinf(theirs)
    np.testing.assert_allclose(np.asarray(ours)[kept], theirs[kept], rtol=1e-5)
    cuts = {"top_k", "top_p", "typical_p"} & set(settings)
    assert (kept.sum() < kept.size) == bool(cuts)


def test_the_repetition_penalty_steers_greedy_decoding_off_repeats(model_and_params):
    model, params = model_and_params
    prompt = np.array([4, 8, 15, 16, 23, 42])
    plain = generate(model, params, prompt, 40, Sampling(temperature=0))[6:]
    penalized = generate(model, params, prompt, 40, Sampling(temperature=0, repetition_penalty=50.0))[6:]
    assert len(set(plain.tolist())) < 40  # greedy repeats itself
    assert len(set(penalized.tolist())) > len(set(plain.tolist()))


def test_generation_stops_at_end_of_text_and_at_the_context(model_and_params):
    model, params = model_and_params
    prompt = np.array([4, 8, 15])
    greedy = generate(model, params, prompt, 30, Sampling(temperature=0))
    eot = int(greedy[6])
    stopped = generate(model, params, prompt, 30, Sampling(temperature=0), eot_id=eot)
    first = 3 + next(i for i, t in enumerate(greedy[3:]) if t == eot)
    assert stopped.tolist() == greedy[:first + 1].tolist()
    assert len(generate(model, params, np.arange(40), 100, Sampling(temperature=0))) == 48
    with pytest.raises(UsageError, match=r"the prompt has 48 tokens; the model's context is 48"):
        generate(model, params, np.arange(48), 1)


@pytest.mark.parametrize("kw, message", [({"top_p": 0.0}, "--top-p: 0.0 must be in (0, 1]"),
                                         ({"top_p": 1.5}, "--top-p: 1.5 must be in (0, 1]"),
                                         ({"typical_p": 0}, "--typical-p: 0.0 must be in (0, 1]"),
                                         ({"repetition_penalty": 0}, "--repetition-penalty: 0.0 must be > 0"),
                                         ({"top_k": -1}, "--top-k: -1 must be >= 0"),
                                         ({"temperature": -0.1}, "--temperature: -0.1 must be >= 0")])
def test_bad_sampling_settings_are_named(kw, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        checked(kw, lambda field: "--" + field.replace("_", "-"))


def test_the_cli_continues_a_prompt_with_a_checkpoint(trained_run):
    from runs import zerolm

    proc = zerolm("sample", "--checkpoint", trained_run / "ckpt", "--prompt", "And God said", "--max-new-tokens", "8",
                  "--temperature", "0", devices=1)
    assert proc.stdout.startswith("And God said") and len(proc.stdout.strip()) > len("And God said")
    again = zerolm("sample", "--checkpoint", trained_run / "ckpt" / "16", "--prompt", "And God said",
                   "--max-new-tokens", "8", "--temperature", "0", devices=1)
    assert again.stdout == proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--prompt", "word " * 40], "--prompt: {n} tokens, but the model's context is 32 tokens (model.seq_len), so a "
                                 "prompt may have at most 31"),
    (["--top-p", "0"], "--top-p: 0.0 must be in (0, 1] (1: no cut)"),
    (["--top-p", "1.01"], "--top-p: 1.01 must be in (0, 1] (1: no cut)"),
    (["--tokenizer", "{run}/missing.json"], "--tokenizer: {run}/missing.json: cannot read tokenizer (No such file "
                                            "or directory)"),
])
def test_bad_input_is_one_line_and_exit_2(trained_run, args, message):
    from runs import snapshot, zerolm

    before = snapshot(trained_run)
    proc = zerolm("sample", "--checkpoint", trained_run / "ckpt", *[a.format(run=trained_run) for a in args],
                  expect=2, devices=1)
    import re

    pattern = re.escape(f"error: {message.format(run=trained_run, n='{n}')}\n").replace(r"\{n\}", r"\d+")
    assert re.fullmatch(pattern, proc.stderr), proc.stderr
    assert snapshot(trained_run) == before


def test_a_tokenizer_that_is_not_the_runs_is_refused_and_a_lost_one_is_asked_for(trained_run, tmp_path):
    import json
    import shutil

    from runs import zerolm
    from zerolm.data.tokenizer import train_bpe

    other = tmp_path / "other.json"
    train_bpe(["some other text entirely"] * 10, 300).save(str(other))
    proc = zerolm("sample", "--checkpoint", trained_run / "ckpt", "--tokenizer", other, expect=2, devices=1)
    assert proc.stderr.startswith(f"error: --tokenizer: {other} (sha256 ") and "is not the tokenizer this model was " \
        "trained with" in proc.stderr
    # A checkpoint whose dataset is gone: the tokenizer is unknown until given.
    shutil.copytree(trained_run / "ckpt", tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "16" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["dataset_location"] = str(tmp_path / "gone")
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "16" / "zerolm_files.json").unlink()  # the edit changed a recorded size
    proc = zerolm("sample", "--checkpoint", tmp_path / "ckpt" / "16", expect=2, devices=1)
    assert proc.stderr.startswith(f"error: {tmp_path / 'ckpt' / '16'}: unknown tokenizer: the run's dataset "
                                  f"{tmp_path / 'gone'} cannot give it (") and proc.stderr.endswith(
        "pass the tokenizer file with --tokenizer\n")
