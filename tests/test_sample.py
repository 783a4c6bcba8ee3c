"""Sampling with the KV cache against decoding that recomputes the whole sequence per token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from zerolm.core.errors import UsageError
from zerolm.model import decoder as gpt_model
from zerolm.model import generate as sample
from zerolm.model.device_policy import for_device
from zerolm.model.generate import Sampling, generate


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
    sample._generate.clear_cache()
    for n, new, settings in [(3, 5, Sampling(0)), (9, 20, Sampling(0.7, top_k=5, seed=1)),
                             (16, 2, Sampling(1.0, top_p=0.5))]:
        generate(model, params, np.arange(n), new, settings)
    assert sample._generate._cache_size() == 1  # prompts of 3, 9 and 16 tokens share the 16 bucket
    generate(model, params, np.arange(17), 3, Sampling(0))
    assert sample._generate._cache_size() == 2


def test_top_k_1_and_a_tiny_top_p_are_greedy_and_sampling_follows_the_seed(model_and_params):
    model, params = model_and_params
    prompt = np.array([4, 8, 15, 16, 23, 42])
    greedy = generate(model, params, prompt, 20, Sampling(0))
    assert generate(model, params, prompt, 20, Sampling(1.5, top_k=1, seed=7)).tolist() == greedy.tolist()
    assert generate(model, params, prompt, 20, Sampling(1.5, top_p=1e-6, seed=7)).tolist() == greedy.tolist()
    a, b = (generate(model, params, prompt, 20, Sampling(1.5, seed=s)) for s in (1, 2))
    assert a.tolist() == generate(model, params, prompt, 20, Sampling(1.5, seed=1)).tolist()
    assert a.tolist() != b.tolist()


def test_pick_keeps_only_the_top_k_and_the_top_p_nucleus():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    keys = jax.random.split(jax.random.key(0), 2000)
    draws = lambda **kw: np.asarray(jax.vmap(lambda k: sample.pick(logits, k, 1.0, kw.get("k", 0),  # noqa: E731
                                                                  kw.get("p", 1.0)))(keys))
    assert set(draws(k=2)) == {0, 1}
    assert set(draws(p=0.7)) == {0, 1}  # 0.5 < 0.7: the second token crosses 0.7 and is kept
    assert set(draws(p=0.5)) == {0}
    assert set(draws()) == {0, 1, 2, 3}


def test_generation_stops_at_end_of_text_and_at_the_context(model_and_params):
    model, params = model_and_params
    prompt = np.array([4, 8, 15])
    greedy = generate(model, params, prompt, 30, Sampling(0))
    eot = int(greedy[6])
    stopped = generate(model, params, prompt, 30, Sampling(0), eot_id=eot)
    first = 3 + next(i for i, t in enumerate(greedy[3:]) if t == eot)
    assert stopped.tolist() == greedy[:first + 1].tolist()
    assert len(generate(model, params, np.arange(40), 100, Sampling(0))) == 48
    with pytest.raises(UsageError, match=r"the prompt has 48 tokens; the model's context is 48"):
        generate(model, params, np.arange(48), 1)


@pytest.mark.parametrize("kw, message", [({"top_p": 0.0}, "--top-p: 0.0 must be in (0, 1]"),
                                         ({"top_p": 1.5}, "--top-p: 1.5 must be in (0, 1]"),
                                         ({"top_k": -1}, "--top-k: -1 must be >= 0"),
                                         ({"temperature": -0.1}, "--temperature: -0.1 must be >= 0")])
def test_bad_sampling_settings_are_named(kw, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        Sampling(**kw)


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
