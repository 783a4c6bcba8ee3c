"""`zerolm plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: a run's curves from its metrics.jsonl.

Four panels against tokens seen: train loss (lines) with validation loss (markers), tokens/s, MFU
(or model TFLOP/s per device where the device's peak is unknown) and the learning rate. Several runs
are overlaid, one colour each, labelled by their directory. Drawn with matplotlib's Agg backend, so
no display is needed.

The throughput and MFU panels leave out each run's first `--skip-steps` steps (default 1: the first
step's time includes compiling). Steps whose loss is not finite cannot be drawn on a loss axis: the
legend counts them, and each is marked by a red x on the loss panel's bottom edge. Each restart of a run (a
launch after its first, from launches.jsonl) is a dotted vertical line at the tokens seen where it started,
labelled on the loss panel with the step it resumed from, or "restarted from scratch" where there was no
checkpoint.

A decay branch (train.branch_from; its launches.jsonl records its source) is drawn with where it came from: a
dash-dot line at the step it branched at, labelled on the loss panel, and its source's loss and lr curves up to
that step in a lighter line of its colour (and the source's source's, for a branch of a branch), unless that run
is plotted itself. So `zerolm plot SOURCE BRANCH...` draws a run and its branches, and `zerolm plot BRANCH` a
branch with the run it continues.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zerolm.core.errors import ZerolmError
from zerolm.data.context import ContextPlan
from zerolm.observe import launches

METRICS = "metrics.jsonl"


class PlotError(ZerolmError):
    pass


def read_run(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS
    if not path.exists():
        raise PlotError(f"{run_dir}: no {METRICS} (a run's logging.dir, e.g. runs/tiny)")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if not isinstance(record, dict) or "step" not in record:
            raise PlotError(f"{path}: line {n} is not a metrics record")
        records.append(record)
    if not any("loss" in r for r in records):
        raise PlotError(f"{path}: no step has a loss yet")
    return records


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens seen, value) of every record that has `key`."""
    rows = [(r["tokens_seen"], r[key]) for r in records if key in r and "tokens_seen" in r]
    return np.asarray([x for x, _ in rows], float), np.asarray([y for _, y in rows], float)


def restarts(run_dir: Path) -> list[tuple[float, str]]:
    """(tokens seen, label) where each launch after the run's first started (none without launches.jsonl)."""
    marks = []
    for n, launch in enumerate(launches.read(run_dir)[1:], 2):
        how = f"resumed from step {launch.start_step}" if launch.start_step else "restarted from scratch"
        marks.append((float(_tokens_seen(launch.config, launch.start_step)), f"launch {n}: {how}"))
    return marks


def _tokens_seen(config: dict, step: int) -> int:
    """Tokens a run of `config` (a launch's record) trained on in its first `step` steps, each at its context."""
    train = config["train"]
    plan = ContextPlan([(s["steps"], s["seq_len"]) for s in train.get("context_stages", [])],
                       train.get("context_rows", "split"), config["model"]["seq_len"])
    return plan.tokens_seen(step, train["global_batch_size"])


def mark_restarts(axes, marks: list[tuple[float, str]], color: str, labelled) -> None:
    """A dotted vertical line per restart on every panel in `axes`, its label on the panel `labelled`."""
    for x, label in marks:
        for ax in axes:
            ax.axvline(x, color=color, ls=":", lw=1)
        labelled.text(x, 0.98, label, rotation=90, va="top", ha="right", fontsize=7, color=color,
                      transform=labelled.get_xaxis_transform())


def branch_points(run_dir: Path) -> list[dict]:
    """A decay branch's sources, nearest first (zerolm.checkpoint.branch.Source.record: checkpoint, step, name,
    log_dir, ...), from its first launch's record; [] for a run that is no branch (or recorded no launches)."""
    recorded = launches.read(run_dir)
    record = recorded[0].branched_from if recorded else None
    points = []
    while record is not None:
        points.append(record)
        record = record.get("from")
    return points


def draw_sources(run_dir: Path, plotted: set[Path], color: str, loss_ax, lr_ax, axes) -> None:
    """A branch's point (a dash-dot line on every panel in `axes`, labelled on `loss_ax`) and its sources' loss
    and lr up to the steps branched at, lighter, where they are not in `plotted` (resolved logging directories)
    and their metrics.jsonl is there."""
    points = branch_points(run_dir)
    if not points:
        return
    x = _tokens_seen(launches.read(run_dir)[0].config, points[0]["step"])
    for ax in axes:
        ax.axvline(x, color=color, ls="-.", lw=1)
    loss_ax.text(x, 0.02, f"branched from {points[0]['name']} at step {points[0]['step']}", rotation=90,
                 va="bottom", ha="right", fontsize=7, color=color, transform=loss_ax.get_xaxis_transform())
    for point in points:
        where = Path(point["log_dir"]) if point.get("log_dir") else None
        if where is None or where.resolve() in plotted or not (where / METRICS).exists():
            return
        records = [r for r in read_run(where) if r["step"] <= point["step"]]
        label = f"{where} to step {point['step']} (source of {run_dir})"
        loss_ax.plot(*series(records, "loss"), color=color, lw=1, alpha=0.35, label=label)
        lr_ax.plot(*series(records, "lr"), color=color, lw=1, alpha=0.35, label=label)


def skip_first(records: list[dict], n: int) -> list[dict]:
    """The records of steps after the run's first `n` steps (their times include compiling)."""
    steps = sorted({r["step"] for r in records if "loss" in r})
    first = steps[n] if n < len(steps) else float("inf")
    return [r for r in records if r["step"] >= first]


def figure(run_dirs: list[Path], skip_steps: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_run(d) for d in run_dirs}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    (loss_ax, speed_ax), (mfu_ax, lr_ax) = axes
    use_mfu = all(any("mfu" in r for r in records) for records in runs.values())
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i}"
        x, y = series(records, "loss")
        bad = ~np.isfinite(y)
        loss_ax.plot(x, y, color=color, lw=1, label=f"{name} train" + (f" ({bad.sum()} non-finite step(s))" if bad.any() else ""))
        if bad.any():
            loss_ax.plot(x[bad], np.zeros(bad.sum()), "x", color="red", ms=7, clip_on=False,
                         transform=loss_ax.get_xaxis_transform())
        timed = skip_first(records, skip_steps)
        x, y = series(records, "val_loss")
        if len(x):
            loss_ax.plot(x, y, "o--", color=color, ms=4, label=f"{name} val")
        x, y = series(records, "val_loss_ema")  # train.ema: the moving average's own validation loss
        if len(x):
            loss_ax.plot(x, y, "s:", color=color, ms=4, label=f"{name} val (EMA)")
        speed_ax.plot(*series(timed, "tokens_per_s"), color=color, lw=1, label=name)
        if use_mfu:
            x, y = series(timed, "mfu")
            mfu_ax.plot(x, 100 * y, color=color, lw=1, label=name)
        else:
            mfu_ax.plot(*series(timed, "model_tflops_per_device"), color=color, lw=1, label=name)
        lr_ax.plot(*series(records, "lr"), color=color, lw=1, label=name)
        mark_restarts(list(axes.flat), restarts(Path(name)), color, loss_ax)
        draw_sources(Path(name), {d.resolve() for d in run_dirs}, color, loss_ax, lr_ax, list(axes.flat))
    loss_ax.set(title="loss", ylabel="nats/token")
    speed_ax.set(title="throughput", ylabel="tokens/s")
    mfu_ax.set(title="MFU" if use_mfu else "model TFLOP/s per device (MFU: device peak unknown)",
               ylabel="%" if use_mfu else "TFLOP/s")
    lr_ax.set(title="learning rate", ylabel="lr")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("tokens seen")
    fig.tight_layout()
    return fig


def perplexity_figure(run_dir: Path):
    """One run's train perplexity (line) and validation perplexity (markers) against tokens seen, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_run(run_dir)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x, y = series(records, "perplexity")
    ax.plot(x[np.isfinite(y)], y[np.isfinite(y)], lw=1, label="train")
    x, y = series(records, "val_perplexity")
    if len(x):
        ax.plot(x, y, "o--", ms=4, label="val")
    x, y = series(records, "val_perplexity_ema")
    if len(x):
        ax.plot(x, y, "s:", ms=4, label="val (EMA)")
    mark_restarts([ax], restarts(run_dir), "grey", ax)
    ax.set(title="perplexity", xlabel="tokens seen", ylabel="exp(loss)", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write(run_dirs: list[Path], out: Path, skip_steps: int = 1) -> Path:
    return save(figure(run_dirs, skip_steps), out)


def save(fig, out: Path) -> Path:
    """`fig` as the PNG `out` (its directory made), closed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out
