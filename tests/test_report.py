"""`zerolm report RUN_DIR`: a run's training log, every figure on it read from the run's own files."""

import json
import shutil
from pathlib import Path

import pytest

import runs
from runs import zerolm
from zerolm.checkpoint.store import Checkpoints
from zerolm.observe import launches, plot, run_files
from zerolm.observe import run_report as report

SECTIONS = ["## Model", "## Data", "## Hardware and mesh", "## Throughput and MFU",
            "## Loss, perplexity and learning rate", "## Downstream tasks", "## Where the time went", "## Launches"]


@pytest.fixture
def log_dir(trained_run, tmp_path):
    """The trained run's logging directory, copied (the report writes into it); its checkpoints stay where
    launches.jsonl says they are."""
    shutil.copytree(trained_run / "log", tmp_path / "log")
    return tmp_path / "log"


def rows(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_report_of_a_finished_run_has_every_section_with_the_runs_own_figures(trained_run, log_dir):
    out = zerolm("report", log_dir, devices=1).stdout
    page = log_dir / "report" / "README.md"
    assert out.strip() == str(page)
    text = page.read_text()
    assert [s for s in SECTIONS if s in text] == SECTIONS
    for png in ("curves.png", "perplexity.png"):
        assert f"]({png})" in text and (log_dir / "report" / png).read_bytes()[:4] == b"\x89PNG"

    steps = [r for r in rows(log_dir) if "loss" in r]
    assert f"**{int(steps[-1]['tokens_seen']):,} tokens seen** in 16 steps" in text
    ckpts = Checkpoints(trained_run / "ckpt", read_only=True)
    params = ckpts.param_count(16)
    assert params == launches.read(log_dir)[0].facts["params"]  # the launch's record and the arrays agree
    assert f"**{params:,} parameters** (the run's record); the checkpoint of step 16 holds {params:,}." in text
    location = Path(launches.read(log_dir)[0].data[0]["location"])
    dataset = json.loads((location / "manifest.json").read_text())["splits"]["train"]  # the dataset's own record
    epochs = 16 * 16 / dataset["samples"]  # 16 steps of 16 sequences
    assert f"| {dataset['tokens']:,} | {dataset['samples']:,} | {epochs:.3f} |" in text
    assert "- mesh dp = 8 × tp = 1; ZeRO-1" in text and "8 × `cpu` device(s) in 1 process(es)" in text
    assert "median MFU | not logged: the device's peak is unknown" in text  # a CPU has no peak in the table
    saves = sum(r.get("save_s", 0.0) for r in rows(log_dir))
    assert f"| saving checkpoints | {saves:,.1f} |" in text
    assert f"| compiling the training step | {launches.read(log_dir)[0].compile_s:,.1f} |" in text
    assert "No downstream tasks were evaluated" in text
    assert "1 launch(es): 0 resumed from a checkpoint; 0 step(s) lost to interruptions" in text
    assert "| lost to interruptions: steps, evaluations and saves done again | 0.0 |" in text


def test_the_downstream_tasks_logged_are_the_reports_table(log_dir):
    with (log_dir / "metrics.jsonl").open("a") as f:
        for step, acc in ((8, 0.25), (16, 0.5)):
            f.write(json.dumps({"step": step, "tasks/cloze/acc": acc, "tasks/choice/acc_norm": acc / 2}) + "\n")
    text = report.write(run_files.read(log_dir)).read_text()
    assert "| task | metric | step 8 | step 16 |" in text
    assert "| choice | acc_norm | 0.1250 | 0.2500 |" in text and "| cloze | acc | 0.2500 | 0.5000 |" in text
    assert "No downstream tasks" not in text


def test_a_run_without_launches_says_what_it_did_not_record(trained_run, log_dir):
    (log_dir / launches.NAME).unlink()  # as a run of a zerolm before launches.jsonl
    text = "\n".join(report.markdown(run_files.read(log_dir)))
    assert "| compiling the training step | not recorded by this run |" in text
    assert "Steps lost to interruptions: not recorded by this run." in text
    assert "The model's config: not recorded by this run" in text and "## Launches" not in text
    # its checkpoints named: the config, mesh and parameter count from the newest checkpoint's own record
    text = "\n".join(report.markdown(run_files.read(log_dir, str(trained_run / "ckpt"))))
    params = Checkpoints(trained_run / "ckpt", read_only=True).param_count(16)
    assert f"**{params:,} parameters** (counted in the newest checkpoint's arrays)" in text
    assert "mesh dp = 8 × tp = 1 in 1 process(es)" in text and "| `model.n_layer` | `2` |" in text


@pytest.mark.parametrize("where,message", [("{tmp}/nowhere", "{tmp}/nowhere: no such directory"),
                                           ("{run}/ckpt", "{run}/ckpt: no metrics.jsonl")])
def test_a_directory_that_is_not_a_run_is_one_line_and_exit_2(trained_run, tmp_path, where, message):
    proc = zerolm("report", where.format(tmp=tmp_path, run=trained_run), expect=2, devices=1)
    assert proc.stderr.startswith(f"error: {message.format(tmp=tmp_path, run=trained_run)}")
    assert proc.stderr.count("\n") == 1 and not (trained_run / "ckpt" / "report").exists()


def test_wandb_is_refused_for_a_run_that_did_not_log_to_it(log_dir):
    with pytest.raises(run_files.ReportError, match="the run did not log to wandb"):
        report.log_to_wandb(run_files.read(log_dir), log_dir / "report" / "README.md")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A run of three launches: the first killed (-9) before any checkpoint, after an evaluation; the second
    killed after a checkpoint and an evaluation past it; the third to the end. With metrics.jsonl as each kill
    left it (the next launch drops the rows it trains again)."""
    run_dir, sets = tmp_path_factory.mktemp("restarted"), ("train.eval_every=2",)
    proc = runs.start_held(run_dir, *sets, before_step=3)  # steps 1-2 and the evaluation of step 2 logged
    proc.kill()
    proc.wait()
    (run_dir / "held").unlink()
    left = [rows(run_dir / "log")]
    runs.kill_9_after(run_dir, *sets, before_step=11)  # an evaluation at step 10, after the checkpoint of 8 or 4
    left.append(rows(run_dir / "log"))
    runs.train(run_dir, *sets)
    return run_dir / "log", left


def seconds_after(rows, step):
    """The wall-clock seconds of metrics rows after `step` (a step's wait for data is within its time)."""
    return sum(v for r in rows if r["step"] > step for k, v in r.items()
               if k.endswith("_s") and not k.endswith("_per_s") and k != "data_wait_s")


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
def test_each_restart_records_the_work_it_dropped_and_the_report_counts_it(restarted):
    log_dir, left = restarted
    first, scratch, resumed = launches.read(log_dir)
    latest = resumed.start_step
    assert (first.start_step, scratch.start_step) == (0, 0) and latest in (4, 8)
    # the launch killed before any checkpoint: everything it logged (its evaluation of step 2 included) is lost
    assert scratch.last_logged_step == 2 and scratch.lost_s["eval_s"] > 0
    assert scratch.lost_seconds == pytest.approx(seconds_after(left[0], 0))
    # the launch killed after a checkpoint: its steps, evaluations (and a save of 8 not committed) after it
    assert resumed.last_logged_step == 10 and resumed.lost_s["eval_s"] > 0
    assert resumed.lost_seconds == pytest.approx(seconds_after(left[1], latest))
    lost = scratch.lost_seconds + resumed.lost_seconds
    text = "\n".join(report.markdown(run_files.read(log_dir)))
    assert ("3 launch(es): 1 resumed from a checkpoint, 1 restarted from scratch (there was no checkpoint to resume "
            f"from); {2 + 10 - latest} step(s) lost to interruptions") in text
    assert f", {lost:,.1f} s of work lost (training steps " in text and "evaluating (validation loss) " in text
    assert f"| lost to interruptions: steps, evaluations and saves done again | {lost:,.1f} |" in text
    assert "| a fresh state | 0 | 0 | 0.0 |" in text and "| scratch (no checkpoint to resume from) | 2 | 2 |" in text
    assert f"| the checkpoint of step {latest} | 10 | {10 - latest} | {resumed.lost_seconds:.1f} |" in text


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
def test_each_restart_is_a_labelled_line_on_the_reports_figures(restarted):
    log_dir, _ = restarted
    resumed = launches.read(log_dir)[2]
    at = [0, resumed.start_step * resumed.facts["tokens_per_step"]]
    labels = ["launch 2: restarted from scratch", f"launch 3: resumed from step {resumed.start_step}"]
    for fig in (plot.figure([log_dir]), plot.perplexity_figure(log_dir)):
        for ax in fig.axes:
            lines = [line.get_xdata() for line in ax.lines if line.get_linestyle() == ":"]
            assert [list(x) for x in lines] == [[x, x] for x in at]
        assert [t.get_text() for t in fig.axes[0].texts] == labels


def test_launches_recorded_before_the_lost_seconds_get_an_estimate_said_as_such(restarted, tmp_path):
    log_dir, _ = restarted
    shutil.copytree(log_dir, tmp_path / "log")
    recorded = [json.loads(line) for line in (tmp_path / "log" / launches.NAME).read_text().splitlines()]
    (tmp_path / "log" / launches.NAME).write_text("".join(
        json.dumps({k: v for k, v in x.items() if k != "lost_s"} | {"version": 1}) + "\n" for x in recorded))
    files = run_files.read(tmp_path / "log")
    text = "\n".join(report.markdown(files))
    steps = sum(x.steps_lost for x in files.launches)
    step_time = report._median(files.steps, "step_time_s")
    assert (f"{steps} step(s) lost to interruptions (logged by a launch, then trained again by the next), about "
            f"{steps * step_time:,.1f} s at the median step time (the evaluations and saves lost: not recorded by "
            "this run).") in text
    assert "| lost to interruptions: steps, evaluations and saves done again | not recorded by this run |" in text
