"""`zerolm export-hf`: the exported directory loads in transformers without missing or unexpected weights
and gives zerolm's logits, greedy continuation and tokens (PyTorch CPU, from the test extra)."""

import base64
import json
import os

import jax
import numpy as np
import pytest

from runs import snapshot, train, zerolm
from zerolm import export, restored
from zerolm import model as gpt_model
from zerolm.data.tokenizer import EOT, from_file, train_bpe
from zerolm.sample import Sampling, generate

pytestmark = pytest.mark.slow  # a trained run, PyTorch and transformers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = "And God said, Let there be light: and there was light.\n\n  Ünïcode — 123 tabs\tand  spaces!"


def load_hf(out):
    model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched weights
    return model.eval(), transformers.AutoTokenizer.from_pretrained(out)


def hf_logits(model, ids_BxT):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids_BxT), dtype=torch.long)).logits.numpy()


def assert_same_model(model_run, out, tokenizer):
    hf, hf_tok = load_hf(out)
    V = model_run.model.cfg.vocab_size
    assert hf.config.vocab_size == V and hf.config.n_positions == model_run.model.cfg.seq_len
    ids = np.random.default_rng(0).integers(0, V, (2, model_run.model.cfg.seq_len))
    ours = np.asarray(model_run.model.apply({"params": model_run.params}, ids))[..., :V]
    np.testing.assert_allclose(hf_logits(hf, ids), ours, rtol=1e-4, atol=1e-4)
    assert hf_tok(TEXT)["input_ids"] == tokenizer.encode(TEXT).tolist()
    assert hf_tok.decode(tokenizer.encode(TEXT)) == TEXT and hf_tok.eos_token == EOT
    return hf


def test_export_round_trip_in_transformers(trained_run, tmp_path):
    zerolm("export-hf", "--checkpoint", trained_run / "ckpt", "--out", tmp_path / "hf", devices=1)
    model_run = restored.load(str(trained_run / "ckpt"), jax.local_devices()[:1])
    tokenizer = model_run.tokenizer()
    hf = assert_same_model(model_run, tmp_path / "hf", tokenizer)
    prompt = tokenizer.encode("And God said")
    ours = generate(model_run.model, model_run.params, prompt, 12, Sampling(temperature=0))
    theirs = hf.generate(torch.tensor([prompt.tolist()]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=tokenizer.eot_id)[0].tolist()
    assert theirs == ours.tolist()

    # 16 steps of training continue with one token; a random model with large weights (as in test_sample)
    # continues with tokens that depend on the ones before them.
    sharp_params = jax.tree.map(lambda p: p * 30 if p.ndim >= 2 else p,
                                gpt_model.init_params(model_run.model, jax.random.key(3)))
    sharp = restored.Restored(model_run.model, sharp_params, model_run.meta, model_run.step, model_run.where,
                            model_run.mesh)
    export.export(sharp, tokenizer, tmp_path / "sharp")
    hf = assert_same_model(sharp, tmp_path / "sharp", tokenizer)
    ours = generate(sharp.model, sharp.params, prompt, 20, Sampling(temperature=0))
    theirs = hf.generate(torch.tensor([prompt.tolist()]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                         pad_token_id=tokenizer.eot_id)[0].tolist()
    assert len(set(ours[len(prompt):].tolist())) > 3 and theirs == ours.tolist()


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
