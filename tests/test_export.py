"""`zerolm export-hf`: the exported directory loads in transformers without missing or unexpected weights
and gives zerolm's logits, greedy continuation and tokens (PyTorch CPU, from the test extra); an ALiBi model's
export generates past its trained context, as zerolm does. (The tests on the trained run are `slow`, through its
fixture.)"""

import base64
import json
import os

import jax
import numpy as np
import pytest

from runs import snapshot, train, zerolm
from zerolm.checkpoint import trained_model as restored
from zerolm.config.model import ModelConfig
from zerolm.config.sampling import Sampling
from zerolm.data.tokenizer import EOT, from_file, train_bpe
from zerolm.hf import export
from zerolm.hf import layouts as hf_layouts
from zerolm.model import decoder as gpt_model
from zerolm.model.generate import generate
from zerolm.parallel.auto import for_device

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = "And God said, Let there be light: and there was light.\n\n  Ünïcode — 123 tabs\tand  spaces!"


def load_hf(out, architecture):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched weights
    assert type(model).__name__ == architecture
    return model.eval(), transformers.AutoTokenizer.from_pretrained(out)


def hf_logits(model, ids_BxT):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids_BxT), dtype=torch.long)).logits.numpy()


def assert_same_model(model_run, out, tokenizer, architecture="GPT2LMHeadModel"):
    hf, hf_tok = load_hf(out, architecture)
    V = model_run.model.cfg.vocab_size
    assert hf.config.vocab_size == V
    ids = np.random.default_rng(0).integers(0, V, (2, model_run.model.cfg.seq_len))
    ours = np.asarray(model_run.model.apply({"params": model_run.params}, ids))[..., :V]
    np.testing.assert_allclose(hf_logits(hf, ids), ours, rtol=1e-4, atol=1e-4)
    assert hf_tok(TEXT)["input_ids"] == tokenizer.encode(TEXT).tolist()
    assert hf_tok.decode(tokenizer.encode(TEXT)) == TEXT and hf_tok.eos_token == EOT
    return hf


def assert_same_greedy(model_run, hf, tokenizer, n):
    prompt = tokenizer.encode("And God said")
    ours = generate(model_run.model, model_run.params, prompt, n, Sampling(temperature=0))
    theirs = hf.generate(torch.tensor([prompt.tolist()]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=tokenizer.eot_id)[0].tolist()
    assert theirs == ours.tolist()
    return ours[len(prompt):]


def sharp(model_run, scale=5, **settings):
    """The run's model with `settings` changed and random parameters with large weights (as in test_sample):
    it continues with tokens that depend on the ones before them (16 steps of training repeat one token).
    ×5 keeps float32's rounding (about 1e-5 in the logits) well under the tolerance; ×30 can reach it."""
    asked = {**model_run.model.cfg.model_dump(), "n_kv_head": "auto", "mlp_hidden": "auto", **settings}
    model = gpt_model.GPT(for_device(ModelConfig.model_validate(asked)))  # its auto shapes follow the new settings
    params = jax.tree.map(lambda p: p * scale if p.ndim >= 2 else p, gpt_model.init_params(model, jax.random.key(3)))
    return restored.Restored(model, params, model_run.meta, model_run.step, model_run.where, model_run.mesh)


def assert_table_reads_back(model_run, layout, out):
    """Each tensor of the export, read back through its table entry's inverse, is zerolm's parameter (the
    vocabulary's padding rows, which the export drops, aside); a bias the model lacks was written as zeros, and a
    tensor the layout fixes (GPT-J's output bias) as its value; nothing else was written."""
    from safetensors.numpy import load_file

    tensors, cfg = load_file(out / "model.safetensors"), model_run.model.cfg
    params = hf_layouts.flatten(model_run.params)
    entries = [(t, [t.hf], False) for t in layout.globals] + \
        [(t, [t.hf.format(i=i) for i in range(cfg.n_layer)], True) for t in layout.layers]
    entries = [e for e in entries if e[0].zerolm in params or e[1][0] in tensors]  # a tied model has no lm_head
    fixed = layout.fixed(cfg)
    assert sorted(tensors) == sorted([name for _, names, _ in entries for name in names] + list(fixed))
    for name, value in fixed.items():
        np.testing.assert_array_equal(tensors[name], value)
    for t, names, layered in entries:
        if t.zerolm not in params:
            assert not cfg.bias and t.zerolm.endswith(".bias") and not any(tensors[n].any() for n in names)
            continue
        stacked = np.asarray(params[t.zerolm]) if layered else np.asarray(params[t.zerolm])[None]
        if t.op.part is not None:  # the tensor is one part of zerolm's axis 1 (q, k or v of c_attn)
            stacked = stacked[:, :, t.op.part]
        read = np.stack([t.op.from_hf(tensors[n], stacked.shape[1:], cfg) for n in names])
        rows = slice(None, cfg.vocab_size) if t.op is hf_layouts.VOCAB else slice(None)
        np.testing.assert_array_equal(read[:, rows], stacked[:, rows], err_msg=t.zerolm)


def test_export_round_trip_in_transformers(trained_run, tmp_path):
    zerolm("export-hf", "--checkpoint", trained_run / "ckpt", "--out", tmp_path / "hf", devices=1)
    model_run = restored.load(str(trained_run / "ckpt"), jax.local_devices()[:1])
    tokenizer = model_run.tokenizer()
    hf = assert_same_model(model_run, tmp_path / "hf", tokenizer)
    assert hf.config.n_positions == model_run.model.cfg.seq_len
    assert_same_greedy(model_run, hf, tokenizer, 12)

    model = sharp(model_run, scale=30)
    export.export(model, tokenizer, tmp_path / "sharp")
    hf = assert_same_model(model, tmp_path / "sharp", tokenizer)
    assert len(set(assert_same_greedy(model, hf, tokenizer, 20).tolist())) > 3
    assert_table_reads_back(model, hf_layouts.GPT2, tmp_path / "sharp")


@pytest.fixture(scope="module")
def model_run(trained_run):
    return restored.load(str(trained_run / "ckpt"), jax.local_devices()[:1])


def test_an_alibi_bias_free_model_exports_to_mpt(model_run, tmp_path):
    """ALiBi, no biases, exact GELU: transformers' MptForCausalLM; 6 heads, not a power of two, whose slopes
    MPT's rule and Press's agree on (as for every head count, checked below)."""
    tokenizer = model_run.tokenizer()
    model = sharp(model_run, position="alibi", bias=False, activation="gelu", d_model=48, n_head=6)
    export.export(model, tokenizer, tmp_path / "mpt")
    hf = assert_same_model(model, tmp_path / "mpt", tokenizer, "MptForCausalLM")
    assert (hf.config.max_seq_len, hf.config.n_heads, hf.config.attn_config.alibi) == (4 * 32, 6, True)
    assert len(set(assert_same_greedy(model, hf, tokenizer, 20).tolist())) > 3
    longer = model.at_context(4 * 32, "--max-seq-len")  # past the trained context of 32, as `zerolm sample` goes
    assert len(assert_same_greedy(longer, hf, tokenizer, 60)) == 60
    assert_table_reads_back(model, hf_layouts.MPT, tmp_path / "mpt")


def test_mpts_alibi_slopes_are_zerolms_for_every_head_count():
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from zerolm.model.attention import alibi_slopes

    for n in range(1, 65):
        bias_Hx1xT = build_mpt_alibi_tensor(n, 2).numpy()  # slope · (key − 1) for keys 0 and 1
        np.testing.assert_allclose(bias_Hx1xT[:, 0, 1] - bias_Hx1xT[:, 0, 0], alibi_slopes(n), rtol=1e-6, err_msg=n)


def test_a_bias_free_learned_position_model_exports_to_gpt2_with_zero_biases(model_run, tmp_path):
    tokenizer = model_run.tokenizer()
    model = sharp(model_run, bias=False)
    export.export(model, tokenizer, tmp_path / "hf")
    hf = assert_same_model(model, tmp_path / "hf", tokenizer)
    biases = [p for name, p in hf.named_parameters() if name.endswith(".bias")]
    assert len(biases) == 1 + 6 * model.model.cfg.n_layer and not any(p.any() for p in biases)
    assert len(set(assert_same_greedy(model, hf, tokenizer, 20).tolist())) > 3
    assert_table_reads_back(model, hf_layouts.GPT2, tmp_path / "hf")


# GPT-NeoX's layout: rotary positions, a LayerNorm before each branch of the parallel block, biases, the exact GELU,
# an MLP of its own width, the output layer its own; and GPT-J's: one norm, no biases in the attention.
NEOX = {"position": "rope", "rope_theta": 500.0, "parallel_residual": True, "activation": "gelu", "mlp_hidden": 48,
        "tie_embeddings": False}
GPTJ = {"position": "rope", "parallel_residual": True, "shared_norm": True, "bias": False, "mlp_hidden": 48,
        "tie_embeddings": False}


@pytest.mark.parametrize("settings, architecture", [
    (NEOX, "GPTNeoXForCausalLM"),
    ({**NEOX, "parallel_residual": False, "activation": "gelu_tanh", "tie_embeddings": True}, "GPTNeoXForCausalLM"),
    (GPTJ, "GPTJForCausalLM"), ({**GPTJ, "activation": "gelu", "tie_embeddings": True}, "GPTJForCausalLM")],
    ids=["neox-parallel", "neox-sequential-tanh-tied", "gptj", "gptj-exact-tied"])
def test_a_rotary_layernorm_model_exports_to_gpt_neox_or_with_one_norm_to_gpt_j(model_run, tmp_path, settings,
                                                                                 architecture):
    """The parallel residual block (and GPT-NeoX's sequential one) in transformers' classes that compute it: the
    same logits and greedy text, each tensor read back through its table."""
    tokenizer = model_run.tokenizer()
    model = sharp(model_run, **settings)
    export.export(model, tokenizer, tmp_path / "hf")
    hf = assert_same_model(model, tmp_path / "hf", tokenizer, architecture)
    assert hf.config.tie_word_embeddings == settings["tie_embeddings"]
    assert len(set(assert_same_greedy(model, hf, tokenizer, 20).tolist())) > 3
    assert_table_reads_back(model, hf_layouts.layout_for(model.model.cfg), tmp_path / "hf")


@pytest.mark.parametrize(("settings", "message"), [
    ({"activation": "gelu"}, "model.activation: gelu: a model with model.position: learned exports to transformers' "
     "GPT2LMHeadModel, whose MLP is the tanh GELU (gelu_new); train with model.activation: gelu_tanh"),
    ({"parallel_residual": True}, "model.parallel_residual: true: a model with model.position: learned exports to "
     "transformers' GPT2LMHeadModel, which has a sequential block (the MLP reads the attention's output); train with "
     "model.parallel_residual: false"),
    ({**GPTJ, "bias": True}, "model.bias: true: a model with model.position: rope and model.shared_norm: true exports "
     "to transformers' GPTJForCausalLM, which has no biases in its attention; train with model.bias: false"),
    ({**GPTJ, "rope_theta": 500.0}, "model.rope_theta: 500.0: a model with model.position: rope and model.shared_norm: "
     "true exports to transformers' GPTJForCausalLM, which has rotary embeddings of base 10000; train with "
     "model.rope_theta: 10000.0"),
    ({**NEOX, "n_kv_head": 2}, "model.n_kv_head: 2: a model with model.position: rope, LayerNorms and a GELU MLP "
     "exports to transformers' GPTNeoXForCausalLM, which has as many key/value heads as query heads; train with "
     "model.n_kv_head: auto"),
    ({**NEOX, "norm": "rmsnorm", "mlp": "swiglu", "bias": False}, "model.parallel_residual: true: a model with model.position: rope "
     "and model.norm: rmsnorm exports to transformers' LlamaForCausalLM, which has a sequential block (the MLP reads "
     "the attention's output); train with model.parallel_residual: false"),
    ({"position": "alibi", "bias": False}, "model.activation: gelu_tanh: a model with model.position: alibi exports "
     "to transformers' MptForCausalLM, whose MLP is the exact GELU; train with model.activation: gelu"),
    ({"position": "alibi", "activation": "gelu"}, "model.bias: true: a model with model.position: alibi exports to "
     "transformers' MptForCausalLM, which has no biases; train with model.bias: false")])
def test_a_model_no_layout_holds_is_refused_in_one_line_and_nothing_is_written(model_run, tmp_path, settings, message):
    with pytest.raises(hf_layouts.ExportError) as refused:
        export.export(sharp(model_run, **settings), model_run.tokenizer(), tmp_path / "hf")
    assert str(refused.value) == message and refused.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_model_trained_with_tensor_parallelism_exports(tmp_path, stage):
    """tp = 2 (the parameters split over tp), and at ZeRO-3 also over dp: the export reads them whole."""
    train(tmp_path, "mesh.tp=2", f"zero.stage={stage}", steps=4)
    zerolm("export-hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf", devices=1)
    model_run = restored.load(str(tmp_path / "ckpt"), jax.local_devices()[:1])
    assert (model_run.meta.tp, model_run.meta.stage) == (2, stage)
    assert_same_model(model_run, tmp_path / "hf", model_run.tokenizer())


def test_a_tiktoken_tokenizer_is_converted_to_an_equal_tokenizer_json(tmp_path):
    # A tiktoken file made from a trained byte-level BPE: ranks in merge order, end-of-text after them.
    bpe = train_bpe([TEXT * 3, "In the beginning God created the heaven and the earth."] * 20, 400)
    unicode_to_byte = {c: b for b, c in export._bytes_to_unicode().items()}
    tokens = sorted((i, t) for t, i in bpe.get_vocab().items() if t != EOT)
    lines = [f"{base64.b64encode(bytes(unicode_to_byte[c] for c in t)).decode()} {rank}"
             for rank, (_, t) in enumerate(tokens)]
    (tmp_path / "small.tiktoken").write_text("\n".join(lines) + "\n")
    tok = from_file(tmp_path / "small.tiktoken")
    converted = export.hf_tokenizer(tok)
    for text in (TEXT, "the heaven and the earth", " leading space", "x" * 50, "new\nlines\r\n"):
        assert converted.encode(text).ids == tok.encode(text).tolist(), text
    assert converted.token_to_id(EOT) == tok.eot_id == len(lines)


def test_an_existing_output_is_refused_and_replaced_only_with_overwrite(trained_run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    proc = zerolm("export-hf", "--checkpoint", trained_run / "ckpt", "--out", out, expect=2, devices=1)
    assert proc.stderr == f"error: --out: {out} already exists (pass --overwrite to replace it)\n"
    assert snapshot(tmp_path) == before
    zerolm("export-hf", "--checkpoint", trained_run / "ckpt" / "12", "--out", out, "--overwrite", devices=1)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    umask = os.umask(0o022)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == \
        {p.name: 0o666 & ~umask for p in out.iterdir()}  # safetensors' own file as readable as the rest
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no partial or old directory left beside it


def test_an_alibi_export_declares_a_longer_context_and_generates_past_the_trained_one(tmp_path, capsys):
    """An imported MPT (context 32) exported by `zerolm export-hf`: max_seq_len 4 × 32 (or --max-seq-len), which
    the command says; transformers' greedy text past 32 tokens is zerolm's. A learned-position model's is its
    trained context: a longer one is refused in one line."""
    from helpers import tiny_transformers_model
    from zerolm.commands import main

    tiny_transformers_model(tmp_path / "hf", kind="mpt")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "mpt")]) == 0
    assert "its context: 128 tokens (4 × the trained 32): ALiBi runs past the trained context" in capsys.readouterr().out
    assert json.loads((tmp_path / "mpt" / "tokenizer_config.json").read_text())["model_max_length"] == 128
    model_run = restored.load(str(tmp_path / "ckpt"), jax.local_devices()[:1])
    hf, _ = load_hf(tmp_path / "mpt", "MptForCausalLM")
    assert hf.config.max_seq_len == 128
    assert len(assert_same_greedy(model_run.at_context(128, "--max-seq-len"), hf, model_run.tokenizer(), 60)) == 60

    assert "document_mask" not in capsys.readouterr().out
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "masked"), "--set",
                 "model.document_mask=true"]) == 0
    capsys.readouterr()
    assert main(["export-hf", "--checkpoint", str(tmp_path / "masked"), "--out", str(tmp_path / "mpt100"),
                 "--max-seq-len", "100"]) == 0
    out = capsys.readouterr().out
    assert "its context: 100 tokens (--max-seq-len; the trained context is 32)" in out
    assert "model.document_mask: true: transformers attends across documents in a sequence" in out
    assert json.loads((tmp_path / "mpt100" / "config.json").read_text())["max_seq_len"] == 100

    tiny_transformers_model(tmp_path / "gpt2", kind="gpt2")
    assert main(["import-hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "gpt2-ckpt")]) == 0
    capsys.readouterr()
    assert main(["export-hf", "--checkpoint", str(tmp_path / "gpt2-ckpt"), "--out", str(tmp_path / "out"),
                 "--max-seq-len", "64"]) == 2
    assert capsys.readouterr().err == ("error: --max-seq-len: 64: a model with model.position: learned runs only within "
                                       "its trained context of 32 (model.seq_len); only an ALiBi model's runs past it\n")
    assert not (tmp_path / "out").exists()
