"""Hugging Face in both directions for the Llama layout, and `zerolm import-hf` for GPT-2, MPT and Llama: models
transformers makes from random weights (nothing is downloaded) import with logits and losses equal to transformers'
own forward pass; a Llama-layout zerolm model exports as LlamaForCausalLM with equal logits and greedy text; a run
continued from an imported checkpoint resumes bit-identical after kill -9."""

import jax
import numpy as np
import pytest

import runs
from runs import zerolm
from test_export import assert_same_greedy, assert_same_model, sharp
from zerolm import export, hf_layouts, restored

pytestmark = pytest.mark.slow  # PyTorch, transformers, trained and imported runs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The Llama layout on the trained run's shape (2 layers, d 32, 4 heads): 2 key/value heads, untied.
LLAMA = {"position": "rope", "rope_theta": 500.0, "norm": "rmsnorm", "mlp": "swiglu", "mlp_hidden": 48,
         "n_kv_head": 2, "tie_embeddings": False, "bias": False}
LLAMA_SETS = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in LLAMA.items()]


@pytest.fixture(scope="module")
def model_run(trained_run):
    return restored.load(str(trained_run / "ckpt"), jax.local_devices()[:1])


def test_a_llama_layout_model_exports_to_llama(model_run, tmp_path):
    tokenizer = model_run.tokenizer()
    model = sharp(model_run, **LLAMA)
    export.export(model, tokenizer, tmp_path / "llama")
    hf = assert_same_model(model, tmp_path / "llama", tokenizer, "LlamaForCausalLM")
    assert (hf.config.num_key_value_heads, hf.config.tie_word_embeddings) == (2, False)
    assert len(set(assert_same_greedy(model, hf, tokenizer, 20).tolist())) > 3
    # and back: the export's tensors read through the table's inverse are the model's parameters
    from safetensors.numpy import load_file

    read = hf_layouts.zerolm_params(load_file(tmp_path / "llama" / "model.safetensors"), model.model.cfg,
                                    hf_layouts.LLAMA)
    V = model.model.cfg.vocab_size
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(read), jax.tree.leaves(model.params), strict=True):
        rows = slice(None, V) if jax.tree_util.keystr(path) in ("['wte']", "['lm_head']") else slice(None)
        np.testing.assert_array_equal(got[rows], np.asarray(want)[rows], err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("settings, message", [
    ({**LLAMA, "norm": "layernorm"}, "model.norm: layernorm: a model with model.position: rope exports to "
     "transformers' LlamaForCausalLM, which has RMSNorms; train with model.norm: rmsnorm"),
    ({"n_kv_head": 2}, "model.n_kv_head: 2: a model with model.position: learned exports to transformers' "
     "GPT2LMHeadModel, which has as many key/value heads as query heads; train with model.n_kv_head: auto"),
])
def test_a_layout_transformers_cannot_hold_is_refused_in_one_line(model_run, tmp_path, settings, message):
    with pytest.raises(hf_layouts.ExportError, match=message):
        export.export(sharp(model_run, **settings), model_run.tokenizer(), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def hf_model(kind: str, vocab: int):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                                                    n_positions=32))
    config = transformers.MptConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    return transformers.MptForCausalLM(config)


def made(kind, model_run, directory):
    """A random transformers model of `kind` (its weights scaled up, so that its greedy text depends on the
    tokens), saved as safetensors with the trained run's tokenizer: the run's data is prepared with it."""
    hf = hf_model(kind, model_run.model.cfg.vocab_size).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim >= 2:
                p.mul_(5)
            elif not name.endswith("weight"):
                p.normal_(0, 0.1)  # biases (zeros at init) that matter
    hf.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes(model_run.tokenizer().file_bytes)
    return hf


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mpt"])
def test_import_hf_gives_transformers_logits_and_loss(model_run, tmp_path, kind):
    hf = made(kind, model_run, tmp_path / "hf")
    proc = zerolm("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt", devices=1)
    assert "continue it: zerolm train --config configs/defaults.yaml --set model.n_layer=2 --set model.d_model=32 " \
        in proc.stdout and proc.stdout.rstrip().endswith(f"--set train.init_from={tmp_path / 'ckpt'}")
    imported = restored.load(str(tmp_path / "ckpt"), jax.local_devices()[:1])
    assert imported.tokenizer().sha256 == model_run.tokenizer().sha256  # found beside the checkpoint
    V = hf.config.vocab_size
    ids = np.random.default_rng(0).integers(0, V, (2, 32))
    ours = np.asarray(imported.model.apply({"params": imported.params}, ids))[..., :V]
    with torch.no_grad():
        out = hf(torch.tensor(ids), labels=torch.tensor(ids))
    np.testing.assert_allclose(ours, out.logits.numpy(), rtol=1e-4, atol=1e-4)
    from zerolm.losses import token_losses

    loss = float(np.mean(token_losses(imported.model, imported.params, np.concatenate([ids, ids[:, :1]], 1))[:, :-1]))
    assert loss == pytest.approx(float(out.loss), rel=1e-5)


def test_import_hf_refuses_what_it_cannot_hold_in_one_line(model_run, tmp_path):
    made("llama", model_run, tmp_path / "hf")
    config = (tmp_path / "hf" / "config.json")
    config.write_text(config.read_text().replace('"silu"', '"gelu"'))
    proc = zerolm("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt", devices=1, expect=2)
    assert proc.stderr == (f"error: {tmp_path / 'hf' / 'config.json'}: hidden_act: 'gelu': zerolm's llama layout "
                           "computes SwiGLU (silu)\n")
    (tmp_path / "hf" / "tokenizer.json").unlink()
    proc = zerolm("import-hf", tmp_path / "nowhere", "--out", tmp_path / "ckpt", devices=1, expect=2)
    assert proc.stderr.startswith("error: DIR: ") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "ckpt").exists()


def test_a_run_continued_from_an_imported_llama_resumes_bit_identical_after_kill_9(model_run, tmp_path):
    made("llama", model_run, tmp_path / "hf")
    zerolm("import-hf", tmp_path / "hf", "--out", tmp_path / "imported", devices=1)
    sets = [*LLAMA_SETS, "model.rope_theta=500.0", f"train.init_from={tmp_path / 'imported'}"]
    straight = tmp_path / "straight"
    proc = runs.train(straight, *sets, steps=8, devices=2)  # (the layouts equal one device: test_model_options)
    assert f"parameters from {tmp_path / 'imported'}/0" in proc.stdout
    killed = tmp_path / "killed"
    runs.kill_9_after(killed, *sets, steps=8, before_step=6, extra_env={"XLA_FLAGS": runs.cpu_flags(2)})
    runs.train(killed, *sets, steps=8, devices=2)
    assert runs.losses(killed) == runs.losses(straight)
