"""`zerolm grow` and `train.init_from`: the layer map and its refusals; a function-preserving growth evaluates
exactly as its source; a run starts from the grown parameters through the real sharded step, refuses a
checkpoint of other shapes before compiling, and resumes from its own checkpoints, whatever init_from says; a
model without a learned position table starts from a checkpoint of another model.seq_len."""

from __future__ import annotations

import json

import numpy as np
import pytest

import runs
from conftest import TINY
from runs import zerolm
from zerolm.checkpoint.grow import GrowError, check_map, default_map, describe_map, grown_params

SMALL4 = [*runs.SMALL, "model.n_layer=4"]  # the trained_run's model (2 layers), twice as deep


def test_the_default_map_repeats_each_layer_in_order_spread_evenly():
    assert default_map(4, 8) == [0, 0, 1, 1, 2, 2, 3, 3]  # Gopher G.3.3
    assert default_map(4, 6) == [0, 0, 1, 2, 2, 3]
    assert default_map(3, 3) == [0, 1, 2]
    assert describe_map(default_map(4, 8), 4) == "0,0,1,1,2,2,3,3"
    assert check_map([0, 1, 0, 1, 2, 3], 4, 6, False) == [0, 1, 0, 1, 2, 3]  # any order without the promise
    assert check_map([0, 1, 0, 1, 2, 3], 4, 6, True) == [0, 1, 0, 1, 2, 3]  # first copies in order
    assert describe_map(default_map(4, 6), 4).endswith("as evenly as possible, 2 copies of layers 0, 2; 1 copy of "
                                                        "layers 1, 3)")


def test_a_given_map_is_described_as_given_not_as_the_default_spread():
    assert describe_map([0, 1, 2, 3, 2, 3], 4) == "0,1,2,3,2,3 (2 copies of layers 2, 3; 1 copy of layers 0, 1)"
    assert describe_map([0, 0, 2], 3) == "0,0,2 (2 copies of layer 0; 1 copy of layer 2; no copy of layer 1)"
    assert describe_map([0, 0, 1, 2, 2, 3], 4) == describe_map(default_map(4, 6), 4)  # the default, given


@pytest.mark.parametrize("layer_map, preserving, says", [
    (None, False, "model.n_layer: 3 is fewer than the source's 4 layers"),
    ([0, 1, 2, 3, 3], False, "--layer-map: 5 layers, but model.n_layer is 6"),
    ([0, 1, 2, 3, 4, 0], False, "--layer-map: names layer 4; the source has layers 0-3"),
    ([0, 0, 1, 1, 2, 2], True, "--function-preserving: the map leaves out layer 3"),
    ([0, 2, 1, 3, 3, 3], True, "--function-preserving: the map takes layer 2 before layer 1"),
])
def test_an_impossible_map_is_refused_in_one_line(layer_map, preserving, says):
    target = 3 if layer_map is None else 6
    with pytest.raises(GrowError) as e:
        check_map(layer_map, 4, target, preserving)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_each_repeat_has_its_output_projections_zeroed_and_nothing_else():
    rng = np.random.default_rng(0)
    block = {"attn": {"c_attn": {"kernel": rng.normal(size=(2, 3, 3))},
                      "c_proj": {"kernel": rng.normal(size=(2, 3, 3)), "bias": rng.normal(size=(2, 3))}},
             "mlp": {"c_proj": {"kernel": rng.normal(size=(2, 4, 3))}}}  # a bias-free layer: nothing to zero there
    params = {"wte": rng.normal(size=(5, 3)), "h": block}
    grown, zeroed = grown_params(params, [0, 0, 1, 1, 0], function_preserving=True)
    assert zeroed == [1, 3, 4]
    assert np.array_equal(grown["wte"], params["wte"])
    np.testing.assert_array_equal(grown["h"]["attn"]["c_attn"]["kernel"], block["attn"]["c_attn"]["kernel"][[0, 0, 1, 1, 0]])
    for leaf, source in ((grown["h"]["attn"]["c_proj"]["kernel"], block["attn"]["c_proj"]["kernel"]),
                         (grown["h"]["attn"]["c_proj"]["bias"], block["attn"]["c_proj"]["bias"]),
                         (grown["h"]["mlp"]["c_proj"]["kernel"], block["mlp"]["c_proj"]["kernel"])):
        assert not leaf[[1, 3, 4]].any()
        np.testing.assert_array_equal(leaf[[0, 2]], source[[0, 1]])
    assert grown_params(params, [0, 0, 1, 1, 0], function_preserving=False)[1] == []


def _sets(sets):
    return [a for s in sets for a in ("--set", s)]


def _loss(checkpoint) -> float:
    import jax

    from zerolm.checkpoint import trained_model as restored
    from zerolm.eval.heldout import evaluate_checkpoint

    return evaluate_checkpoint(restored.load(str(checkpoint), jax.local_devices()[:1]), None, "val", 64)["loss"]


def _params(checkpoint) -> np.ndarray:
    import jax

    from zerolm.checkpoint import trained_model as restored

    params = restored.load(str(checkpoint), jax.local_devices()[:1]).params
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])


@pytest.fixture(scope="module")
def grown(trained_run, tmp_path_factory):
    """The trained run's model grown from 2 layers to 4, function-preserving, by `zerolm grow`."""
    out = tmp_path_factory.mktemp("grown") / "deeper"
    proc = zerolm("grow", "--from", trained_run / "ckpt", "--config", TINY, *_sets(SMALL4), "--out", out,
                  "--function-preserving")
    assert "by the layer map 0,0,1,1" in proc.stdout and "output projections of layers 1, 3 are zero" in proc.stdout
    return out


@pytest.mark.slow
def test_a_function_preserving_growth_evaluates_exactly_as_its_source(trained_run, grown, tmp_path):
    from zerolm.checkpoint.grow import Growth, grow
    from zerolm.config.load import load_config

    assert _loss(grown) == _loss(trained_run / "ckpt")
    plain = grow(Growth(str(trained_run / "ckpt"), load_config(TINY, SMALL4), str(tmp_path / "plain")))
    assert plain.zeroed == () and _loss(tmp_path / "plain") != _loss(trained_run / "ckpt")


@pytest.mark.slow
def test_grow_refuses_a_map_naming_a_layer_the_source_lacks(trained_run, tmp_path):
    proc = zerolm("grow", "--from", trained_run / "ckpt", "--config", TINY, *_sets(SMALL4), "--out", tmp_path / "g",
                  "--layer-map", "0,1,2,3", expect=2)
    assert proc.stderr == "error: --layer-map: names layer 2; the source has layers 0-1\n"
    assert not (tmp_path / "g").exists()


@pytest.fixture(scope="module")
def warm_run(grown, tmp_path_factory):
    """One step from the grown parameters at ZeRO-3, dp 4 x tp 2, with an lr too small to move them."""
    run_dir = tmp_path_factory.mktemp("warm")
    proc = runs.train(run_dir, "model.n_layer=4", f"train.init_from={grown}", "zero.stage=3", "mesh.tp=2",
                      "train.lr=1e-12", "checkpoint.every=1", steps=1)
    return run_dir, proc.stdout


@pytest.mark.slow
def test_a_run_starts_from_the_checkpoint_init_from_names(grown, warm_run):
    run_dir, stdout = warm_run
    assert f"parameters from {grown}/0 (train.init_from: step 0 of a run on dp=1 tp=1 ZeRO-1)" in stdout
    np.testing.assert_allclose(_params(run_dir / "ckpt" / "1"), _params(grown), rtol=0, atol=1e-9)


@pytest.mark.slow
def test_a_run_resumes_from_its_own_checkpoint_whatever_init_from_says(trained_run, warm_run):
    run_dir, _ = warm_run
    proc = runs.train(run_dir, "model.n_layer=4", f"train.init_from={trained_run / 'ckpt'}", "zero.stage=3",
                      "mesh.tp=2", "train.lr=1e-12", "checkpoint.every=1", steps=2)  # (2 layers there: not read)
    assert f"resumed from {run_dir / 'ckpt' / '1'}" in proc.stdout and "parameters from" not in proc.stdout


@pytest.mark.slow
def test_init_from_a_model_of_other_shapes_is_refused_before_compiling(trained_run, tmp_path):
    proc = runs.train(tmp_path, "model.n_layer=4", f"train.init_from={trained_run / 'ckpt'}", expect=2)
    assert proc.stderr.startswith(f"error: train.init_from: {trained_run / 'ckpt' / '16'}: model.n_layer is 2 there "
                                  "and 4 in the config") and proc.stderr.count("\n") == 1
    assert "compiled the step" not in proc.stdout


def _printed(stdout: str, prefix: str) -> list[str]:
    """The command a line of `stdout` starting with `prefix` prints, split as a shell splits it."""
    import shlex

    return shlex.split(next(line for line in stdout.splitlines() if line.startswith(prefix)).removeprefix(prefix))


@pytest.fixture
def grown_import(tmp_path, capsys):
    """A tiny transformers GPT-2 with its tokenizer, imported (zerolm import-hf), then grown from 2 layers to 3 by
    `zerolm grow --layer-map 0,1,1` with the import's printed model settings: (its directory, what grow printed)."""
    pytest.importorskip("transformers")
    from helpers import tiny_transformers_model
    from zerolm.commands import main
    from zerolm.config.load import DEFAULTS

    tiny_transformers_model(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    model_sets = [a for a in _printed(capsys.readouterr().out, "continue it: ") if a.startswith("model.")]
    sets = [*(s for s in model_sets if not s.startswith("model.n_layer=")), "model.n_layer=3"]
    assert main(["grow", "--from", str(tmp_path / "imported"), "--config", str(DEFAULTS), *_sets(sets),
                 "--out", str(tmp_path / "grown"), "--layer-map", "0,1,1"]) == 0
    return tmp_path / "grown", capsys.readouterr().out


def test_a_grown_import_keeps_its_tokenizer_for_sample_and_export(grown_import, tmp_path, capsys):
    import json

    from zerolm.commands import main

    grown, _ = grown_import
    assert (grown / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert main(["sample", "--checkpoint", str(grown), "--prompt", "In the", "--max-new-tokens", "4"]) == 0
    assert main(["export-hf", "--checkpoint", str(grown), "--out", str(tmp_path / "exported")]) == 0
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["n_layer"] == 3
    assert (tmp_path / "exported" / "tokenizer.json").exists()


def test_grow_describes_the_map_given_and_its_start_line_names_the_data_and_vocabulary(grown_import):
    from zerolm.checkpoint import trained_model as restored
    from zerolm.checkpoint.compatible import parameter_differences
    from zerolm.config.load import load_config

    grown, stdout = grown_import
    assert "by the layer map 0,1,1 (2 copies of layer 1; 1 copy of layer 0)" in stdout
    assert _printed(stdout, "prepare data with its tokenizer: ") == [
        "zerolm", "prepare", "--source", "...", "--tokenizer", str(grown / "tokenizer.json"), "--seq-len", "32",
        "--out", "DATA"]
    start = _printed(stdout, "start a run from it: ")
    assert start[:3] == ["zerolm", "train", "--config"] and start[-2:] == ["--set", f"train.init_from={grown}"]
    sets = start[5::2]
    assert "data.dataset=DATA" in sets
    cfg = load_config(start[3], sets)  # the run's config, as the printed line makes it: its model is the grown one
    model = restored.load(str(grown)).meta.model
    assert parameter_differences(model, cfg.model.model_dump()) == []
    assert f"model.vocab_size={model['vocab_size']}" in sets and cfg.data.dataset == "DATA"


@pytest.mark.slow
def test_the_printed_lines_prepare_data_and_start_a_run_from_a_grown_import(grown_import, tmp_path):
    """Run as printed, with the data and `...` filled in (and a one-step run of the config's size kept small): the
    run starts from the grown parameters, with data prepared by the tokenizer beside them."""
    import json

    grown, stdout = grown_import
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"In the beginning God created the heaven and the earth, {i} times."})
                            + "\n" for i in range(3000)))
    filled = {"...": f"jsonl:{docs}", "DATA": str(tmp_path / "data"), "data.dataset=DATA": f"data.dataset={tmp_path / 'data'}"}
    zerolm(*[filled.get(a, a) for a in _printed(stdout, "prepare data with its tokenizer: ")][1:], "--workers", "1")
    start = [filled.get(a, a) for a in _printed(stdout, "start a run from it: ")][1:]
    proc = zerolm(*start, *_sets(["train.steps=1", "train.schedule_steps=1000", "train.global_batch_size=8",
                                  "train.micro_batch_size=1", "train.eval_sequences=8", "sample.tokens=0",
                                  f"checkpoint.dir={tmp_path / 'run'}", f"logging.dir={tmp_path / 'log'}"]))
    assert f"parameters from {grown}/0 (train.init_from: step 0" in proc.stdout


@pytest.mark.slow
def test_init_from_a_learned_position_model_of_another_seq_len_is_refused_in_one_line(trained_run, tmp_path):
    proc = runs.train(tmp_path, "model.seq_len=64", f"train.init_from={trained_run / 'ckpt'}", expect=2)
    assert proc.stderr == (f"error: train.init_from: {trained_run / 'ckpt' / '16'}: model.seq_len is 32 there and 64 "
                           "in the config (a run starts from parameters of the same shapes: its learned position "
                           "table has model.seq_len rows; ALiBi and rotary positions have no such table and take any "
                           "seq_len)\n")


POSITION_FREE = {"alibi": ["model.position=alibi", "model.bias=false", "model.activation=gelu"],
                 "rope": ["model.position=rope"]}


@pytest.mark.slow
@pytest.mark.parametrize("position", sorted(POSITION_FREE))
def test_init_from_another_seq_len_starts_a_model_without_a_position_table(position, tmp_path):
    """Short, then long: a run at seq_len 32 continued at 64 from its parameters (ALiBi's and rotary positions
    have no parameter of the context's length), through the real sharded step."""
    sets = POSITION_FREE[position]
    runs.train(tmp_path / "short", *sets, "checkpoint.every=2", steps=2)
    long = runs.train(tmp_path / "long", *sets, "model.seq_len=64", f"train.init_from={tmp_path / 'short' / 'ckpt'}",
                      "train.lr=1e-12", "checkpoint.every=1", steps=1)
    assert f"parameters from {tmp_path / 'short' / 'ckpt' / '2'} (train.init_from: step 2" in long.stdout
    np.testing.assert_allclose(_params(tmp_path / "long" / "ckpt" / "1"), _params(tmp_path / "short" / "ckpt" / "2"),
                               rtol=0, atol=1e-9)
    assert json.loads((tmp_path / "long" / "log" / "metrics.jsonl").read_text().splitlines()[0])["tokens_seen"] == \
        16 * 64  # a step of 16 sequences of 64 tokens
