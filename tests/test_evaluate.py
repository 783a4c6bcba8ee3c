"""`zerolm eval`: a checkpoint's held-out loss, equal to what training logged; bad input in one line."""

import json
import math
import shutil

import pytest

from runs import snapshot, zerolm


def val_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "val_loss" in r}


def test_eval_of_a_run_and_of_a_step_equals_the_logged_validation_loss(trained_run):
    logged = val_losses(trained_run)
    assert sorted(logged) == [8, 16]
    assert logged[16]["val_perplexity"] == pytest.approx(math.exp(logged[16]["val_loss"]))
    latest = json.loads(zerolm("eval", "--checkpoint", trained_run / "ckpt", "--json", devices=2).stdout)
    assert latest["step"] == 16 and latest["sequences"] == 128  # the run's train.eval_sequences
    assert latest["loss"] == pytest.approx(logged[16]["val_loss"], rel=1e-5)  # 2 devices here, 8 in training
    assert latest["perplexity"] == pytest.approx(math.exp(latest["loss"]))
    step12 = zerolm("eval", "--checkpoint", trained_run / "ckpt" / "12", "--sequences", "37", devices=1).stdout
    assert step12.startswith(f"step 12 of {trained_run / 'ckpt'}: val loss ") and "on 37 sequences of 32 tokens (1,184 tokens)" in step12
    on_train = json.loads(zerolm("eval", "--checkpoint", trained_run / "ckpt", "--split", "train", "--sequences", "16",
                                 "--json").stdout)
    assert on_train["split"] == "train" and on_train["sequences"] == 16 and on_train["loss"] != latest["loss"]


def copy_with_config(trained_run, tmp_path, section: str, **settings) -> None:
    """The run's step 16 copied to tmp_path/ckpt/16, its recorded config changed as a run with `settings`
    in `section` would have recorded it."""
    step = tmp_path / "ckpt" / "16"
    shutil.copytree(trained_run / "ckpt" / "16", step)
    meta_file, record_file = step / "meta" / "metadata", step / "zerolm_files.json"
    meta = json.loads(meta_file.read_text())
    meta["config"][section].update(settings)
    meta_file.write_text(json.dumps(meta))
    record = json.loads(record_file.read_text())
    record["files"]["meta/metadata"] = meta_file.stat().st_size  # as that run recorded it
    record_file.write_text(json.dumps(record))


def test_a_run_trained_with_a_kernel_this_machine_lacks_is_evaluated_with_auto(trained_run, tmp_path):
    """A checkpoint written on a GPU with model.attention: cudnn (or on a TPU v4+ with pallas): on CPU eval
    switches to auto (the attention is compute only, the parameters are the same) and gets the same loss."""
    copy_with_config(trained_run, tmp_path, "model", attention="cudnn")
    got = json.loads(zerolm("eval", "--checkpoint", tmp_path / "ckpt", "--json", "--sequences", "16").stdout)
    want = json.loads(zerolm("eval", "--checkpoint", trained_run / "ckpt", "--json", "--sequences", "16").stdout)
    assert got["step"] == 16 and got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_a_run_that_evaluated_nothing_while_training_is_evaluated_on_the_default_sequences(trained_run, tmp_path):
    """train.eval_sequences 0 turned evaluation off during training; eval still reads the run's validation
    split, on configs/defaults.yaml's train.eval_sequences (the same sequences as --sequences 256)."""
    import yaml

    from conftest import REPO
    from zerolm.eval.heldout import DEFAULT_SEQUENCES

    defaults = yaml.safe_load((REPO / "configs" / "defaults.yaml").read_text())
    assert DEFAULT_SEQUENCES == defaults["train"]["eval_sequences"]
    copy_with_config(trained_run, tmp_path, "train", eval_sequences=0)
    got = json.loads(zerolm("eval", "--checkpoint", tmp_path / "ckpt", "--json", devices=1).stdout)
    want = json.loads(zerolm("eval", "--checkpoint", trained_run / "ckpt", "--json", "--sequences", "256",
                             devices=1).stdout)
    assert got["sequences"] == DEFAULT_SEQUENCES and got["loss"] == pytest.approx(want["loss"], rel=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{run}/nope"], "{run}/nope: no such checkpoint directory"),
    (["--checkpoint", "{run}/ckpt/8"], "{run}/ckpt/8: no step 8 in {run}/ckpt (its steps: 12, 16)"),
    (["--checkpoint", "{run}/log"], "{run}/log: no checkpoint here (a run's checkpoint directory"),
    (["--checkpoint", "{run}/ckpt", "--data", "{run}/log"], "--data: {run}/log/manifest.json: no manifest"),
    (["--checkpoint", "{run}/ckpt", "--sequences", "0"], "--sequences: 0 must be > 0"),
    (["--checkpoint", "{run}/ckpt", "--seq-len", "64"], "--seq-len: 64 tokens is past the model's trained context "
     "of 32 (model.seq_len): its learned position table has 32 rows and ends there; models with model.position "
     "alibi or rope have no table and run past it"),
])
def test_bad_input_is_one_line_and_exit_2(trained_run, args, message):
    before = snapshot(trained_run)
    proc = zerolm("eval", *[a.format(run=trained_run) for a in args], expect=2, devices=1)
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"error: {message.format(run=trained_run)}")
    assert snapshot(trained_run) == before


@pytest.mark.slow
@pytest.mark.parametrize("sets, says", [
    (["model.position=alibi", "model.bias=false", "model.activation=gelu"], "ALiBi extrapolates"),
    (["model.position=rope"], "rotary positions past it were never trained on")])
def test_a_model_without_a_position_table_evaluates_and_samples_past_its_trained_context(tmp_path, sets, says):
    """ALiBi and rotary positions have no table: the same checkpoint evaluates at 2x its seq_len (consecutive
    samples joined) and samples past it; at 1x it gives what training logged."""
    from runs import train

    train(tmp_path, *sets, "train.eval_every=4", "train.schedule_steps=4", "checkpoint.every=4", steps=4)
    logged = val_losses(tmp_path)[4]["val_loss"]
    at = {n: json.loads(zerolm("eval", "--checkpoint", tmp_path / "ckpt", "--json", "--seq-len", str(n),
                               "--sequences", "32", devices=1).stdout) for n in (32, 64)}
    assert at[64]["seq_len"] == 64 and at[64]["tokens"] == 32 * 64 and math.isfinite(at[64]["loss"])
    full = json.loads(zerolm("eval", "--checkpoint", tmp_path / "ckpt", "--json", devices=1).stdout)
    assert full["loss"] == pytest.approx(logged, rel=1e-5) and at[64]["loss"] != at[32]["loss"]
    sampled = zerolm("sample", "--checkpoint", tmp_path / "ckpt", "--prompt", "And God said", "--max-new-tokens", "40",
                     "--temperature", "0", devices=1)
    assert f"past the trained context of 32 tokens ({says})" in sampled.stderr
    assert len(sampled.stdout) > len("And God said")
