"""`zerolm plot`: the curves drawn are the runs' metrics; the PNG is written."""

import json
import shutil

import matplotlib.image
import numpy as np

from runs import zerolm
from zerolm.observe import plot


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]


def test_the_plotted_series_are_the_metrics_of_each_run(trained_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(trained_run / "log", other / "log")
    lines = [line for line in (other / "log" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["step"] <= 5]  # a shorter second run
    (other / "log" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    fig = plot.figure([trained_run / "log", other / "log"])
    loss_ax, speed_ax, flops_ax, lr_ax = fig.axes
    rec = records(trained_run)
    steps = [r for r in rec if "loss" in r]
    tokens = [r["tokens_seen"] for r in steps]
    assert tokens == [16 * 32 * s for s in range(1, 17)]
    train_line, val_line, other_line = loss_ax.get_lines()
    np.testing.assert_array_equal(train_line.get_xydata(), np.c_[tokens, [r["loss"] for r in steps]])
    np.testing.assert_array_equal(val_line.get_xydata(), [[r["tokens_seen"], r["val_loss"]] for r in rec
                                                          if "val_loss" in r])
    assert len(other_line.get_xydata()) == 5 and other_line.get_label() == f"{other / 'log'} train"
    timed = steps[1:]  # the first step (compiling) is left out of the throughput panels
    np.testing.assert_array_equal(speed_ax.get_lines()[0].get_ydata(), [r["tokens_per_s"] for r in timed])
    np.testing.assert_array_equal(lr_ax.get_lines()[0].get_ydata(), [r["lr"] for r in steps])
    # CPU has no peak in the table: the panel shows model TFLOP/s per device, and says why.
    assert "MFU: device peak unknown" in flops_ax.get_title()
    np.testing.assert_array_equal(flops_ax.get_lines()[0].get_ydata(), [r["model_tflops_per_device"] for r in timed])


def test_a_runs_ema_validation_is_drawn_beside_its_own_and_said_in_the_report(trained_run, tmp_path):
    """train.ema logs the moving average's validation loss and perplexity beside the run's (val_loss_ema,
    val_perplexity_ema): the loss and perplexity figures draw them, the report's curves section says the last."""
    from zerolm.observe import run_files, run_report

    rec = records(trained_run)
    for r in rec:
        if "val_loss" in r:
            r["val_loss_ema"], r["val_perplexity_ema"] = r["val_loss"] - 0.25, float(np.exp(r["val_loss"] - 0.25))
    shutil.copytree(trained_run / "log", tmp_path / "log")
    (tmp_path / "log" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rec))
    want = [[r["tokens_seen"], r["val_loss_ema"]] for r in rec if "val_loss_ema" in r]
    assert len(want) == 2  # steps 8 and 16
    ema = [line for line in plot.figure([tmp_path / "log"]).axes[0].get_lines() if line.get_label().endswith("val (EMA)")]
    assert len(ema) == 1 and np.array_equal(ema[0].get_xydata(), want)
    ppl = [line for line in plot.perplexity_figure(tmp_path / "log").axes[0].get_lines() if line.get_label() == "val (EMA)"]
    assert len(ppl) == 1 and np.allclose(ppl[0].get_ydata(), np.exp(np.asarray(want)[:, 1]))
    last = rec[[i for i, r in enumerate(rec) if "val_loss_ema" in r][-1]]
    text = "\n".join(run_report.markdown(run_files.read(tmp_path / "log", str(trained_run / "ckpt"))))
    assert (f"its moving average's (train.ema) {last['val_loss_ema']:.4f} (perplexity {last['val_perplexity_ema']:.2f})"
            in text)


def test_non_finite_steps_are_counted_and_marked(trained_run, tmp_path):
    rec = records(trained_run)
    for r in rec:
        if r.get("step") in (3, 7) and "loss" in r:
            r["loss"] = float("nan")
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rec))
    fig = plot.figure([tmp_path / "log"])
    loss_ax = fig.axes[0]
    train_line = loss_ax.get_lines()[0]
    assert train_line.get_label() == f"{tmp_path / 'log'} train (2 non-finite step(s))"
    marks = [line for line in loss_ax.get_lines() if line.get_marker() == "x"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [16 * 32 * 3, 16 * 32 * 7]


def test_step_time_is_the_step_not_the_host_work_between_steps(monkeypatch):
    """A save (or an evaluation) between two steps is logged as save_s; the next step's time is its own: from
    the end of that host work to the step's end on the device (here, when the clock says its outputs were ready)."""
    import time

    from zerolm.observe.metrics import StepMetrics, StepTokens
    from zerolm.observe.mfu import Accounting

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    written = []

    class Writer:
        def write(self, step, values):
            written.append((step, values))

    class Bar:
        def update(self, n):
            pass

    class Clock:  # each step's end on the device, as zerolm.observe.metrics.CompletionClock notes it
        ends = {1: 2.0, 2: 10.5}

        def watch(self, step, outputs):
            pass

        def done_at(self, step):
            return self.ends[step]

    tokens = lambda step: StepTokens(100, 100 * step, Accounting(1.0, 1, "cpu"))  # noqa: E731
    emitter = StepMetrics(Writer(), Bar(), tokens, every=1000, max_skips=None, clock=Clock())
    metrics = {"loss": np.float32(2.0), "grad_norm": np.float32(1.0)}
    emitter.push(1, metrics, 0.0)
    emitter.flush()  # step 1 (compiling) ended at 2.0
    now[0] = 10.0  # a checkpoint save took 8 s
    emitter.restart_clock()
    emitter.push(2, metrics, 0.0)
    emitter.flush()  # step 2 ended at 10.5
    times = {step: values["step_time_s"] for step, values in written}
    assert times == {1: 2.0, 2: 0.5}
    assert written[1][1]["tokens_per_s"] == 200 and written[1][1]["tokens_seen"] == 200


def test_the_cli_writes_a_png(trained_run, tmp_path):
    out = tmp_path / "curves.png"
    proc = zerolm("plot", trained_run / "log", "--out", out, devices=1)
    assert proc.stdout.strip() == str(out)
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (800, 1200) and image.std() > 0.05  # 12 × 8 inches at 100 dpi, not blank


def test_bad_input_is_one_line(tmp_path):
    proc = zerolm("plot", tmp_path, expect=2, devices=1)
    assert proc.stderr == f"error: {tmp_path}: no metrics.jsonl (a run's logging.dir, e.g. runs/tiny)\n"
    proc = zerolm("plot", tmp_path, "--out", tmp_path / "x.pdf", expect=2, devices=1)
    assert proc.stderr == f"error: --out: {tmp_path / 'x.pdf'}: expected a .png file\n"
