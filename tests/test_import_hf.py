"""Hugging Face in both directions for the Llama layout, and `zerolm import-hf` for GPT-2, MPT, Llama and GPT-NeoX: models
transformers makes from random weights (nothing is downloaded) import with logits and losses equal to transformers'
own forward pass; a Llama-layout zerolm model exports as LlamaForCausalLM with equal logits and greedy text; a run
continued from an imported checkpoint resumes bit-identical after kill -9; every config.json key transformers' forward
pass reads is understood or refused in one line naming it. (The tests on the trained run are `slow`, through its
fixture; the config.json checks are not.)"""

import json

import jax
import numpy as np
import pytest

import runs
from helpers import tiny_transformers_model
from runs import zerolm
from test_export import assert_same_greedy, assert_same_model, sharp
from zerolm.checkpoint import trained_model as restored
from zerolm.commands import main
from zerolm.config.load import DEFAULTS
from zerolm.hf import export
from zerolm.hf import layouts as hf_layouts

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
    ({**LLAMA, "norm": "layernorm"}, "model.norm: layernorm: a model with model.position: rope and model.mlp: swiglu "
     "exports to transformers' LlamaForCausalLM, which has RMSNorms; train with model.norm: rmsnorm"),
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
    if kind == "gpt_neox":  # the parallel residual block, whole heads rotated, the exact GELU, untied
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                         "partial_rotary_factor": 1.0}))
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


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mpt", "gpt_neox"])
def test_import_hf_gives_transformers_logits_and_loss(model_run, tmp_path, kind):
    hf = made(kind, model_run, tmp_path / "hf")
    proc = zerolm("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt", devices=1)
    assert f"continue it: zerolm train --config {DEFAULTS} --set model.n_layer=2 --set model.d_model=32 " \
        in proc.stdout and proc.stdout.rstrip().endswith(f"--set train.init_from={tmp_path / 'ckpt'}")
    imported = restored.load(str(tmp_path / "ckpt"), jax.local_devices()[:1])
    assert imported.tokenizer().sha256 == model_run.tokenizer().sha256  # found beside the checkpoint
    V = hf.config.vocab_size
    ids = np.random.default_rng(0).integers(0, V, (2, 32))
    ours = np.asarray(imported.model.apply({"params": imported.params}, ids))[..., :V]
    with torch.no_grad():
        out = hf(torch.tensor(ids), labels=torch.tensor(ids))
    np.testing.assert_allclose(ours, out.logits.numpy(), rtol=1e-4, atol=1e-4)
    from zerolm.model.losses import token_losses

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


def tiny_config(kind: str, **settings):
    """transformers' config of a one-layer model of `kind` (vocabulary 64, d 32, 4 heads) with `settings`."""
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, **settings)
    if kind == "mpt":
        attn = {"attn_config": {**settings.pop("attn_config")}} if "attn_config" in settings else {}
        return transformers.MptConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32, **attn, **settings)
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(**{
            "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "max_position_embeddings": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}, **settings})
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, max_position_embeddings=32, **settings)


def saved(config, directory):
    """A model of `config` saved by transformers itself (random weights): config.json is transformers' own."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory / "config.json"


def refused(directory, out, capsys) -> str:
    """`zerolm import-hf DIR --out OUT`, in this process: its one line on stderr (exit code 2, nothing at OUT)."""
    capsys.readouterr()
    assert main(["import-hf", str(directory), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists(), err
    return err


@pytest.mark.parametrize("kind, settings, line", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx: True: zerolm's gpt2 layout "
     "computes the same score scale in every layer"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights: False: zerolm's gpt2 layout computes scores scaled by "
     "1/√head_dim"),
    ("gpt2", {"activation_function": "relu"}, "activation_function: 'relu': zerolm's gpt2 layout computes the tanh "
     "GELU (gelu_new)"),
    ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings: False: zerolm's gpt2 layout computes its output "
     "layer tied to the token embedding"),
    ("mpt", {"attn_config": {"clip_qkv": 6.0}}, "attn_config.clip_qkv: 6.0: zerolm's mpt layout computes queries, keys "
     "and values unclipped"),
    ("mpt", {"attn_config": {"softmax_scale": 0.5}}, "attn_config.softmax_scale: 0.5: zerolm's mpt layout computes "
     "scores scaled by 1/√head_dim"),
    ("mpt", {"attn_config": {"alibi_bias_max": 16}}, "attn_config.alibi_bias_max: 16: zerolm's mpt layout computes "
     "ALiBi's slopes of bias max 8"),
    ("mpt", {"logit_scale": 0.5}, "logit_scale: 0.5: zerolm's mpt layout computes unscaled logits"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters: {'factor': 2.0, "
     "'rope_theta': 10000.0, 'rope_type': 'linear'}: zerolm's llama layout computes rotary positions without scaling "
     "(rope_type default)"),
    ("llama", {"attention_bias": True}, "attention_bias: True: zerolm's llama layout computes attention without biases"),
    ("llama", {"mlp_bias": True}, "mlp_bias: True: zerolm's llama layout computes an MLP without biases"),
    ("llama", {"head_dim": 16}, "head_dim: 16: zerolm's llama layout computes heads of hidden_size / "
     "num_attention_heads"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
     "rope_parameters: {'partial_rotary_factor': 0.25, 'rope_theta': 10000.0, 'rope_type': 'default'}: zerolm's "
     "gpt_neox layout computes rotary positions over each whole head (rotary_pct 1; transformers' default 0.25)"),
    ("gpt_neox", {"attention_bias": False}, "attention_bias: False: zerolm's gpt_neox layout computes attention with "
     "biases"),
    ("gpt_neox", {"hidden_act": "relu"}, "hidden_act: 'relu': zerolm's gpt_neox layout computes the exact or the tanh "
     "GELU"),
])
def test_a_setting_transformers_computes_otherwise_with_is_refused_naming_it(tmp_path, capsys, kind, settings, line):
    config = saved(tiny_config(kind, **settings), tmp_path / "hf")
    assert refused(tmp_path / "hf", tmp_path / "ckpt", capsys).startswith(f"error: {config}: {line}")


def test_rope_scaling_is_read_as_transformers_reads_it_and_refused_by_its_own_name(tmp_path, capsys):
    """An older file's `rope_scaling` (transformers 4 wrote it beside `rope_theta`), alone or beside a default
    `rope_parameters`: transformers 5 takes it over rope_parameters, so zerolm does too."""
    config = saved(tiny_config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0}), tmp_path / "hf")
    hf = json.loads(config.read_text())
    old = {**{k: v for k, v in hf.items() if k != "rope_parameters"}, "rope_theta": 10000.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}}
    both = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"type": "linear", "factor": 2.0}}
    for written in (old, both):
        config.write_text(json.dumps(written))
        assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").rope_parameters["rope_type"] == "linear"
        assert refused(tmp_path / "hf", tmp_path / "ckpt", capsys) == (
            f"error: {config}: rope_scaling: {{'type': 'linear', 'factor': 2.0}}: zerolm's llama layout computes "
            "rotary positions without scaling (rope_type default)\n")


def test_a_key_zerolm_does_not_know_is_refused_naming_it(tmp_path, capsys):
    config = saved(tiny_config("llama"), tmp_path / "hf")
    config.write_text(json.dumps({**json.loads(config.read_text()), "quantization_config": {"quant_method": "fp8"}}))
    assert refused(tmp_path / "hf", tmp_path / "ckpt", capsys) == (
        f"error: {config}: quantization_config: {{'quant_method': 'fp8'}}: a key zerolm's llama import does not know, "
        "so it cannot tell whether its model would compute what transformers' does\n")


# config.json as published: GPT-2's (openai-community/gpt2), TinyLlama-1.1B's (transformers 4.35), MPT-7B's.
PUBLISHED = {
    "gpt2": {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
             "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
             "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
             "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
             "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
             "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
             "vocab_size": 50257},
    "llama": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
              "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
              "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.35.0", "use_cache": True, "vocab_size": 32000},
    "mpt": {"architectures": ["MPTForCausalLM"], "attn_config": {
                "alibi": True, "alibi_bias_max": 8, "attn_impl": "torch", "attn_pdrop": 0, "attn_type":
                "multihead_attention", "attn_uses_sequence_id": False, "clip_qkv": None, "prefix_lm": False,
                "qk_ln": False, "softmax_scale": None},
            "auto_map": {"AutoConfig": "configuration_mpt.MPTConfig",
                         "AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM"},
            "d_model": 4096, "emb_pdrop": 0, "embedding_fraction": 1.0, "expansion_ratio": 4,
            "init_config": {"emb_init_std": None, "init_div_is_residual": True, "init_gain": 0, "init_nonlinearity":
                            "relu", "init_std": 0.02, "name": "kaiming_normal_", "verbose": 0},
            "init_device": "cpu", "learned_pos_emb": True, "logit_scale": None, "max_seq_len": 2048,
            "model_type": "mpt", "n_heads": 32, "n_layers": 32, "no_bias": True, "norm_type": "low_precision_layernorm",
            "resid_pdrop": 0, "tokenizer_name": "EleutherAI/gpt-neox-20b", "torch_dtype": "bfloat16",
            "transformers_version": "4.28.1", "use_cache": False, "verbose": 0, "vocab_size": 50432},
}


@pytest.mark.parametrize("kind", ["gpt2", "mpt", "llama"])
def test_transformers_own_config_and_a_published_one_are_accepted(tmp_path, kind):
    from zerolm.hf.importer import model_settings

    own = json.loads(saved(tiny_config(kind), tmp_path / "hf").read_text())
    assert model_settings(own, "config.json")[1]["d_model"] == 32
    every_key = json.loads(tiny_config(kind).to_json_string(use_diff=False))  # each default too, base class's included
    assert model_settings(every_key, "config.json")[1]["d_model"] == 32
    layout, settings = model_settings(PUBLISHED[kind], "config.json")
    assert (layout.architecture, settings["vocab_size"]) == (
        {"gpt2": "GPT2LMHeadModel", "mpt": "MptForCausalLM", "llama": "LlamaForCausalLM"}[kind],
        PUBLISHED[kind]["vocab_size"])


# Pythia-160m's config.json (EleutherAI, transformers 4.24): GPT-NeoX rotating a quarter of each head.
PYTHIA = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
          "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
          "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12,
          "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
          "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}


def test_gpt_neox_imports_with_whole_heads_rotated_and_a_partial_rotary_is_refused_naming_its_key(tmp_path):
    """transformers' own GPT-NeoX config (every key, defaults too) and Pythia's with rotary_pct 1 read as zerolm's
    GPT-NeoX layout; Pythia's as published (a quarter of each head rotated) and a file that leaves the factor out
    (transformers' default, a quarter) are refused in one line naming the key."""
    from zerolm.hf.importer import HFImportError, model_settings

    own = json.loads(saved(tiny_config("gpt_neox", use_parallel_residual=False), tmp_path / "hf").read_text())
    layout, settings = model_settings(own, "config.json")
    assert (layout.architecture, settings["parallel_residual"], settings["tie_embeddings"], settings["mlp_hidden"]) == \
        ("GPTNeoXForCausalLM", False, False, 48)
    every_key = json.loads(tiny_config("gpt_neox").to_json_string(use_diff=False))
    assert model_settings(every_key, "config.json")[1]["parallel_residual"] is True
    whole = model_settings({**PYTHIA, "rotary_pct": 1.0}, "config.json")[1]
    assert (whole["rope_theta"], whole["activation"], whole["n_head"]) == (10000.0, "gelu", 12)
    quarter = "zerolm's gpt_neox layout computes rotary positions over each whole head (rotary_pct 1; transformers' " \
              "default 0.25)"
    for hf, key in ((PYTHIA, "rotary_pct: 0.25"), ({k: v for k, v in PYTHIA.items() if k != "rotary_pct"},
                                                    "rotary_pct: 0.25")):
        with pytest.raises(HFImportError) as refusal:
            model_settings(hf, "config.json")
        assert str(refusal.value) == f"config.json: {key}: {quarter}"


def test_import_hf_outside_the_repository_takes_the_packaged_defaults(tmp_path, monkeypatch, capsys):
    """No configs/ in the working directory: the default --config is the package's copy of configs/defaults.yaml,
    which the printed line names; a --set of a model key at the imported value is no conflict."""
    tiny_transformers_model(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert main(["import-hf", "hf", "--out", "ckpt", "--set", "model.n_layer=2", "--set", "name=my run"]) == 0
    out = capsys.readouterr().out
    assert f"--tokenizer {tmp_path / 'ckpt' / 'tokenizer.json'} --seq-len 32 --out DATA" in out
    assert f"continue it: zerolm train --config {DEFAULTS} --set model.n_layer=2 --set 'name=my run' " in out
    assert restored.load("ckpt", jax.local_devices()[:1]).tokenizer().eot_text == "<|endoftext|>"


def test_a_set_of_a_model_key_the_import_takes_is_refused(tmp_path, capsys):
    tiny_transformers_model(tmp_path / "hf")
    capsys.readouterr()
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--set", "model.n_layer=4"]) == 2
    assert capsys.readouterr().err == (f"error: --set model.n_layer=4: the import takes model.n_layer from "
                                       f"{tmp_path / 'hf' / 'config.json'} (2): leave it out; `zerolm grow` makes a "
                                       "deeper model from the imported one\n")
    assert not (tmp_path / "ckpt").exists()


def test_a_tokenizer_without_an_end_of_text_it_knows_is_refused_naming_the_file(tmp_path, capsys):
    tiny_transformers_model(tmp_path / "eos", end_of_text="<eos>")
    assert refused(tmp_path / "eos", tmp_path / "ckpt", capsys) == (
        f"error: {tmp_path / 'eos' / 'tokenizer.json'}: has no end-of-text token (none of <|endoftext|>, "
        "<|end_of_text|>, </s>)\n")
