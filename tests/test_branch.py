"""Decay branches (`train.branch_from`), in real processes: a wsd decay branched off a constant-lr run's checkpoint
is, step for step and bit for bit, the wsd run of the same length decided in advance; the branch writes only its
own directories (the source's files stay byte-identical), resumes after kill -9 from its own checkpoints
bit-identically, and may be branched from again; what cannot be a branch is refused in one line before compiling;
the plots and reports draw a run with its branches. (The schedules themselves, through the sharded step:
test_schedules.py.)"""

import json

import numpy as np
import pytest

from conftest import TINY
from runs import STEPS, kill_9_after, losses, snapshot, train
from zerolm.checkpoint.store import Checkpoints
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.observe import launches, plot, run_files
from zerolm.observe import run_report as report

DECAY = 8  # the last half of the 16 steps
WSD = ("train.schedule=wsd", f"train.decay_steps={DECAY}")


def rows(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The wsd run decided in advance: 16 steps, the last 8 a linear decay."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(run_dir, *WSD)
    return {r["step"]: r for r in rows(run_dir / "log") if "loss" in r}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Where the source and its branch keep their checkpoints (<root>/<name>/ckpt) and, side by side as
    runs/<name> are, their logs (<root>/logs/<name>)."""
    return tmp_path_factory.mktemp("runs")


def files_of(root, name) -> dict:
    """Every file of a run's checkpoints and logs: their sizes and hashes."""
    return {"ckpt": snapshot(root / name / "ckpt"), "logs": snapshot(root / "logs" / name)}


@pytest.fixture(scope="module")
def source(root):
    """A constant-lr run of 8 steps (checkpoints 4 and 8), and its files as they were when it ended."""
    train(root / "source", "train.schedule=constant", f"logging.dir={root / 'logs' / 'source'}", steps=8)
    return root / "source", files_of(root, "source")


@pytest.fixture(scope="module")
def branch(root, source):
    """A decay branch of the source's newest checkpoint (step 8): steps 9..16, the decay."""
    proc = train(root / "branch", *WSD, f"train.branch_from={source[0] / 'ckpt'}",
                 f"logging.dir={root / 'logs' / 'branch'}")
    return root / "branch", proc


@pytest.mark.slow
def test_a_decay_branch_is_the_wsd_run_decided_in_advance(root, straight, source, branch):
    run_dir, proc = branch
    source_dir, before = source
    assert f"branched from {source_dir / 'ckpt' / '8'} (train.branch_from: step 8 of the run tiny, saved on dp=8 " \
           "tp=1): its parameters, optimizer state and data position" in proc.stdout
    assert "lr schedule: constant -> wsd, its decay over steps 9..16" in proc.stdout
    logged = {r["step"]: r for r in rows(root / "logs" / "branch") if "loss" in r}
    assert sorted(logged) == list(range(9, STEPS + 1))  # the source's numbering, from its step + 1
    for step, row in logged.items():  # same samples, same optimizer state, same lr: bit for bit
        assert (row["loss"], row["lr"], row["tokens_seen"]) == \
            (straight[step]["loss"], straight[step]["lr"], straight[step]["tokens_seen"])
    assert files_of(root, "source") == before  # the source is read, never written
    ckpts = Checkpoints(run_dir / "ckpt", read_only=True)
    assert ckpts.steps() == [12, 16]
    record = {"checkpoint": str(source_dir / "ckpt" / "8"), "step": 8, "name": "tiny",
              "wandb_id": Checkpoints(source_dir / "ckpt", read_only=True).meta(8).wandb_id,
              "log_dir": str(root / "logs" / "source"), "from": None}
    assert ckpts.meta(16).branched_from == record
    (launch,) = launches.read(root / "logs" / "branch")
    assert (launch.start_step, launch.branched_from, launch.steps_lost) == (8, record, 0)
    assert ckpts.meta(16).wandb_id not in (record["wandb_id"], "")  # a wandb run of its own


@pytest.mark.slow
def test_kill_9_inside_a_branch_resumes_from_its_own_checkpoint_bit_identically(root, straight, source, tmp_path):
    """Killed after its checkpoint of step 12: the restart resumes from that (the source is not read again; it is
    not even there), and every step is the uninterrupted branch's; the source's files stay byte-identical."""
    source_dir, before = source
    sets = (*WSD, f"train.branch_from={source_dir / 'ckpt'}")
    kill_9_after(tmp_path, *sets, before_step=15)
    assert Checkpoints(tmp_path / "ckpt", read_only=True).latest_step() == 12
    assert files_of(root, "source") == before
    hidden = source_dir.with_name(source_dir.name + ".hidden")
    source_dir.rename(hidden)
    try:
        proc = train(tmp_path, *sets)
    finally:
        hidden.rename(source_dir)
    assert f"resumed from {tmp_path / 'ckpt' / '12'} " in proc.stdout
    assert losses(tmp_path) == {step: straight[step]["loss"] for step in range(9, STEPS + 1)}
    first, second = launches.read(tmp_path / "log")
    assert (first.start_step, second.start_step) == (8, 12)
    assert first.branched_from == second.branched_from and first.branched_from["step"] == 8
    assert files_of(root, "source") == before


@pytest.mark.slow
def test_a_branch_of_a_branch_records_both(root, straight, source, branch, tmp_path):
    """A branch's checkpoint is a checkpoint: branched again at its step 12, the same decay goes on bit for bit,
    and the new branch's record holds the first branch's."""
    branch_dir, _ = branch
    before = files_of(root, "branch")
    train(tmp_path, *WSD, f"train.branch_from={branch_dir / 'ckpt' / '12'}")
    assert losses(tmp_path) == {step: straight[step]["loss"] for step in range(13, STEPS + 1)}
    record = Checkpoints(tmp_path / "ckpt", read_only=True).meta(16).branched_from
    assert (record["checkpoint"], record["step"], record["log_dir"]) == \
        (str(branch_dir / "ckpt" / "12"), 12, str(root / "logs" / "branch"))
    assert record["from"] == Checkpoints(branch_dir / "ckpt", read_only=True).meta(12).branched_from
    assert record["from"]["checkpoint"] == str(source[0] / "ckpt" / "8")
    assert files_of(root, "branch") == before
    # A branch that only moves the decay says so in its first lines.
    shorter = train(tmp_path / "shorter", "train.schedule=wsd", "train.decay_steps=2",
                    f"train.branch_from={branch_dir / 'ckpt' / '12'}")
    assert "  lr schedule: wsd, its decay over steps 9..16 -> wsd, its decay over steps 15..16\n" in shorter.stdout


@pytest.mark.slow
def test_what_cannot_be_a_branch_is_refused_in_one_line_before_compiling(root, source, tmp_path):
    source_dir, before = source
    at = source_dir / "ckpt" / "8"
    branch_from = f"train.branch_from={source_dir / 'ckpt'}"
    refusals = {
        # the source's logs: refused before anything is written there
        (branch_from, f"logging.dir={root / 'logs' / 'source'}"):
            f"train.branch_from: {at}: logging.dir {root / 'logs' / 'source'} is the source run's: a branch writes its own "
            "logs; give it its own (set name, or logging.dir)",
        (branch_from, "logging.tensorboard=true", f"logging.tensorboard_dir={root / 'logs' / 'source' / 'tensorboard'}"):
            f"train.branch_from: {at}: logging.tensorboard_dir {root / 'logs' / 'source' / 'tensorboard'} is the source "
            "run's: a branch writes its own logs (and would hide the source's steps after its own first there); give it "
            "its own, or null for <logging.dir>/tensorboard",
        (branch_from, "train.steps=8"):
            f"train.branch_from: {at}: step 8 is not before train.steps 8: a branch trains the steps after its "
            "source's (9..train.steps)",
        (branch_from, "model.n_layer=3"):
            f"train.branch_from: {at}: the checkpoint's model differs from the config: model.n_layer: checkpoint 2, "
            "config 3",
        (branch_from, "train.global_batch_size=32"):
            f"train.branch_from: {at}: train.global_batch_size was 16; resuming with 32 would change the data order",
        (f"train.branch_from={source_dir / 'ckpt' / '5'}",):
            f"train.branch_from: {source_dir / 'ckpt' / '5'}: no step 5 in {source_dir / 'ckpt'} (its steps: 4, 8)",
    }
    for sets, line in refusals.items():
        proc = train(tmp_path, *sets, expect=2)
        assert proc.stderr.strip().splitlines()[-1] == f"error: {line}", sets
        assert "collectives per step" not in proc.stdout
    assert files_of(root, "source") == before


def test_a_branch_into_its_own_checkpoint_dir_or_from_two_places_is_refused_at_load(tmp_path):
    """Before the run would lock the source's directory or remove its unfinished saves."""
    own = tmp_path / "ckpt"
    for source in (own, own / "8"):
        with pytest.raises(ConfigError) as e:
            load_config(TINY, [f"checkpoint.dir={own}", f"train.branch_from={source}"])
        assert str(e.value) == (
            f"{TINY} (--set checkpoint.dir): train.branch_from: {source} is in this run's own checkpoint.dir {own}: a "
            "branch writes its checkpoints and logs apart from its source's; give it its own (set name, or "
            "checkpoint.dir and logging.dir)")
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["train.branch_from=checkpoints/a", "train.init_from=checkpoints/b"])
    assert str(e.value) == (
        f"{TINY} (--set train.branch_from): train.branch_from: set beside train.init_from: a run starts from another "
        "run's whole state (branch_from) or from its parameters alone (init_from), not both")
    assert load_config(TINY, [f"checkpoint.dir={own}", f"train.branch_from={tmp_path / 'other'}"]).train.branch_from


@pytest.mark.slow
def test_a_runs_report_draws_its_branches_and_a_branchs_its_source(root, source, branch, tmp_path):
    """The source's report finds its branch beside it (logs/<name>) and draws it from the step it branched at;
    `zerolm plot BRANCH` (and the branch's report) draws the source, lighter, up to that step."""
    source_logs, branch_logs = root / "logs" / "source", root / "logs" / "branch"
    at = 8 * 16 * 32  # step 8 of 16 sequences of 32 tokens

    files = run_files.read(source_logs)
    assert files.branches == [branch_logs]
    fig = plot.figure([source_logs, *files.branches])
    loss_ax = fig.axes[0]
    branch_train = [line for line in loss_ax.get_lines() if line.get_label() == f"{branch_logs} train"]
    assert [x for x, _ in branch_train[0].get_xydata()] == [s * 16 * 32 for s in range(9, 17)]
    for ax in fig.axes:  # the branch point on every panel; the source is plotted, so not drawn again
        assert [list(line.get_xdata()) for line in ax.lines if line.get_linestyle() == "-."] == [[at, at]]
    assert [t.get_text() for t in loss_ax.texts] == ["branched from tiny at step 8"]
    assert not [line for line in loss_ax.get_lines() if "source of" in line.get_label()]
    text = "\n".join(report.markdown(files))
    val = [r for r in rows(branch_logs) if "val_loss" in r][-1]["val_loss"]
    assert f"| `{branch_logs}` | 8 | 16 | {val:.4f} | wsd, decay_steps 8 (linear) |" in text

    source_rows = [r for r in rows(source_logs) if "loss" in r]
    fig = plot.figure([branch_logs])
    loss_ax, lr_ax = fig.axes[0], fig.axes[3]
    for ax, key in ((loss_ax, "loss"), (lr_ax, "lr")):
        (drawn,) = [line for line in ax.get_lines() if line.get_label() == f"{source_logs} to step 8 (source of "
                    f"{branch_logs})"]
        np.testing.assert_array_equal(drawn.get_xydata(), [[r["tokens_seen"], r[key]] for r in source_rows])
    text = "\n".join(report.markdown(run_files.read(branch_logs)))
    assert ("This run is a decay branch (`train.branch_from`): it started from the checkpoint of step 8 of the run "
            f"tiny (`{source[0] / 'ckpt' / '8'}`), with its parameters, optimizer state and data position; its logs, "
            f"`{source_logs}`, are drawn lighter on the curves up to that step.") in text
    assert "| a branch of step 8 of tiny |" in text
    assert "tokens seen** in 8 steps: the branch's own, after the 8 of the run it branched from" in text
    page = report.write(run_files.read(branch_logs), tmp_path / "report")
    assert (page.parent / "curves.png").read_bytes()[:4] == b"\x89PNG"
