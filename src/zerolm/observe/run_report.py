"""A run's training log, `zerolm report RUN_DIR`: one markdown page with its figures, in `RUN_DIR/report/`.

Every figure on the page is read from the run's own files (zerolm.observe.run_files). A run of a zerolm that did
not record something says "not recorded by this run" where it would stand; nothing is filled in from a guess.

A decay branch (train.branch_from) says where it started, and its curves show its source up to that step
(zerolm.observe.plot.draw_sources). A run's own report draws the branches found beside it on its curves figure,
with a table of where each branched and ended.
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import Any

from zerolm.data import contamination
from zerolm.observe import launches, plot
from zerolm.observe.launches import Launch
from zerolm.observe.run_files import ReportError, RunFiles

OUT = "report"
PAGE = "README.md"  # GitHub shows a folder's README.md under its listing
NOT_RECORDED = "not recorded by this run"
# Time fields of metrics.jsonl rows that the page names; any other `*_s` field (not a rate, `*_per_s`) gets its
# own row, by its key.
NAMED_TIMES = {"step_time_s": "training steps", "data_wait_s": "waiting for data", "save_s": "saving checkpoints",
               "eval_s": "evaluating (validation loss)", "tasks_s": "evaluating downstream tasks (eval.tasks)"}
LOST = "lost to interruptions: steps, evaluations and saves done again"  # the time table's row of launches' lost_s


def write(files: RunFiles, out: Path | None = None) -> Path:
    """The page and its figures, into `out` (default RUN_DIR/report); returns the page's path."""
    out = out or files.run_dir / OUT
    out.mkdir(parents=True, exist_ok=True)
    plot.save(plot.figure([files.run_dir, *files.branches]), out / "curves.png")
    plot.save(plot.perplexity_figure(files.run_dir), out / "perplexity.png")
    page = out / PAGE
    page.write_text("\n".join(markdown(files)) + "\n")
    return page


def markdown(files: RunFiles) -> list[str]:
    cfg = files.config
    name = cfg["name"] if cfg else files.run_dir.name
    sources = ["metrics.jsonl", *(["launches.jsonl"] if files.launches else []),
               *([f"the checkpoint of step {files.checkpoint.step} in {files.checkpoint_dir}"] if files.checkpoint
                 else [])]
    return [f"# Training log: {name}", "",
            f"_Written by `zerolm report` from the run's own files: {', '.join(sources)}._", "",
            *model_section(files), *data_section(files), *hardware_section(files), *speed_section(files),
            *curves_section(files), *branches_section(files), *tasks_section(files), *time_section(files),
            *launches_section(files)]


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows), ""]


def model_section(files: RunFiles) -> list[str]:
    lines = ["## Model", ""]
    cfg = files.config
    if cfg is None:
        return [*lines, f"The model's config: {NOT_RECORDED} (no launches.jsonl; pass --checkpoints DIR).", ""]
    recorded = files.facts.get("params")
    held = files.checkpoint_params
    if recorded is not None:
        count = f"**{recorded:,} parameters** (the run's record)"
        if held is not None:
            count += f"; the checkpoint of step {files.checkpoint.step if files.checkpoint else '?'} holds {held:,}"
    elif held is not None:
        count = f"**{held:,} parameters** (counted in the newest checkpoint's arrays)"
    else:
        count = f"parameter count: {NOT_RECORDED}"
    lines += [count + ".", "", *_table(["setting", "value"], [[f"`model.{k}`", f"`{json.dumps(v)}`"]
                                                                  for k, v in cfg["model"].items()])]
    return lines


def tokens_seen(files: RunFiles) -> int:
    """The last training step's tokens seen, as metrics.jsonl has it (0: no step yet)."""
    steps = files.steps
    return int(steps[-1]["tokens_seen"]) if steps else 0


def data_section(files: RunFiles) -> list[str]:
    seen = tokens_seen(files)
    points = plot.branch_points(files.run_dir)
    branched = f": the branch's own, after the {points[0]['step']} of the run it branched from" if points else ""
    lines = ["## Data", "", f"**{seen:,} tokens seen** in {len(files.steps)} steps{branched} (the last step's "
             "`tokens_seen`).", ""]
    if not files.launches:
        where = files.checkpoint.dataset_location if files.checkpoint else None
        return [*lines, f"Dataset{f' {where}' if where else ''}: its size and the epochs trained: {NOT_RECORDED}.", ""]
    launch = files.launches[-1]
    samples_seen = files.steps[-1]["step"] * launch.config["train"]["global_batch_size"] if files.steps else 0
    last_shares = next(({k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("mixture_share/")}
                        for r in reversed(files.steps) if any(k.startswith("mixture_share/") for k in r)), {})
    rows = []
    for d in launch.data:
        share = last_shares.get(d["name"], 1.0 if len(launch.data) == 1 else None)
        epochs = f"{samples_seen * share / d['samples']:.3f}" if share is not None else NOT_RECORDED
        rows.append([d["name"], f"`{d['location']}`", f"{d['weight']:g}",
                     f"{share:.4f}" if share is not None else NOT_RECORDED, f"{d['tokens']:,}", f"{d['samples']:,}",
                     epochs])
    lines += ["Unique tokens are the training split's; epochs are the samples read from it over its samples "
              "(how many times each token was seen, on average). The realised share is the last step's "
              "`mixture_share/<name>`.", "",
              *_table(["dataset", "location", "weight", "realised share", "unique tokens", "samples", "epochs"], rows)]
    return lines


def hardware_section(files: RunFiles) -> list[str]:
    lines = ["## Hardware and mesh", ""]
    facts, cfg = files.facts, files.config
    if facts and cfg:
        mesh, zero = facts["mesh"], cfg["zero"]
        lines += [f"- {facts['devices']} × `{facts['device_kind']}` device(s) in {facts['processes']} process(es)",
                  f"- mesh dp = {mesh['dp']} × tp = {mesh['tp']}; ZeRO-{zero['stage']}, precision {zero['precision']}, "
                  f"grad_reduce {zero['grad_reduce']}",
                  f"- {cfg['train']['global_batch_size']} sequences = {facts['tokens_per_step']:,} tokens per step: "
                  f"{facts['accum_steps']} accumulation step(s) of {cfg['train']['micro_batch_size']} sequence(s) per "
                  "device"]
    elif files.checkpoint:
        meta = files.checkpoint
        lines += [f"- mesh dp = {meta.dp} × tp = {meta.tp} in {meta.process_count} process(es), "
                  f"{meta.accum_steps} accumulation step(s) (the checkpoint's record)",
                  f"- device kind: {NOT_RECORDED}"]
    else:
        lines.append(f"- devices and mesh: {NOT_RECORDED}")
    return [*lines, ""]


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def speed_section(files: RunFiles) -> list[str]:
    timed = [r for r in files.steps if r["step"] not in files.first_steps]
    lines = ["## Throughput and MFU", "",
             "MFU = (6·N + 12·L·d·T) × tokens/s per device ÷ the peak FLOP/s of one device (`zerolm.observe.mfu`, after "
             "PaLM appendix B): N is the parameter count without the position table (and without an untied token "
             "embedding: a lookup), 12·L·d·T counts attention's matmuls over the full T×T scores; "
             "rematerialisation is not counted.", ""]
    if not timed:
        return [*lines, "No step was timed apart from a launch's first (it includes warming up).", ""]
    rows = [["median tokens/s", f"{_median(timed, 'tokens_per_s'):,.0f}"],
            ["median step time", f"{_median(timed, 'step_time_s'):.4f} s"]]
    tflops = _median(timed, "model_tflops_per_device")
    if tflops is not None:
        rows.append(["median model TFLOP/s per device", f"{tflops:.4g}"])
    mfu = _median(timed, "mfu")
    flops, peak = files.facts.get("flops_per_token"), files.facts.get("peak_flops")
    rows.append(["median MFU", f"{mfu:.1%}" if mfu is not None else "not logged: the device's peak is unknown"])
    rows.append(["model FLOPs per token (6·N + 12·L·d·T)", f"{flops:,.0f}" if flops else NOT_RECORDED])
    rows.append(["peak FLOP/s per device", f"{peak / 1e12:.1f} T" if peak else
                 ("unknown for this device" if files.facts else NOT_RECORDED)])
    return [*lines, f"Over {len(timed)} steps, each launch's first step left out (it includes warming up):", "",
            *_table(["", "value"], rows)]


def curves_section(files: RunFiles) -> list[str]:
    last = files.steps[-1] if files.steps else {}
    val = next((r for r in reversed(files.records) if "val_loss" in r), None)
    said = [f"last train loss {last['loss']:.4f} (perplexity {last['perplexity']:.2f}) at step {last['step']}"
            if last else "no training step logged"]
    if val:
        said.append(f"last validation loss {val['val_loss']:.4f} (perplexity {val['val_perplexity']:.2f}) at step "
                    f"{val['step']}" + (f", its moving average's (train.ema) {val['val_loss_ema']:.4f} (perplexity "
                                        f"{val['val_perplexity_ema']:.2f})" if "val_loss_ema" in val else ""))
    return ["## Loss, perplexity and learning rate", "", "; ".join(said) + ".", "",
            "![loss, throughput, MFU and learning rate against tokens seen](curves.png)", "",
            "![train and validation perplexity against tokens seen](perplexity.png)", ""]


def branches_section(files: RunFiles) -> list[str]:
    """Where a branch started (and its source, for a branch of a branch); the run's own branches, if any."""
    points = plot.branch_points(files.run_dir)
    if not points and not files.branches:
        return []
    lines = ["## Branches", ""]
    if points:
        said = [f"the checkpoint of step {p['step']} of the run {p['name']} (`{p['checkpoint']}`)" for p in points]
        drawn = (f"its logs, `{points[0]['log_dir']}`, are drawn lighter on the curves up to that step"
                 if points[0].get("log_dir") else "its logs were not found when the branch started, so the curves "
                 "begin at the branch point")
        lines += [f"This run is a decay branch (`train.branch_from`): it started from {said[0]}, with its parameters, "
                  "optimizer state and data position" + "".join(f", which started from {s}" for s in said[1:])
                  + f"; {drawn}.", ""]
    if files.branches:
        rows = [_branch_row(b) for b in files.branches]
        lines += ["Its decay branches beside it (runs whose launches.jsonl records a start from this run's "
                  "checkpoints), drawn on the curves figure in colours of their own from the step each branched at:",
                  "", *_table(["branch", "branched at step", "last step", "last validation loss", "lr schedule"], rows)]
    return lines


def _branch_row(branch: Path) -> list[Any]:
    records, train = plot.read_run(branch), launches.read(branch)[-1].config["train"]
    val = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
    schedule = train["schedule"] + (f", decay_steps {train['decay_steps']} ({train['decay_shape']})"
                                    if train.get("decay_steps") else "")
    return [f"`{branch}`", plot.branch_points(branch)[0]["step"], max(r["step"] for r in records if "loss" in r),
            f"{val:.4f}" if val is not None else "", schedule]


def task_results(records: list[dict[str, Any]]) -> dict[int, dict[tuple[str, str], float]]:
    """step -> (task, metric) -> value, from the rows' `tasks/<task>/<metric>` keys."""
    results: dict[int, dict[tuple[str, str], float]] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("tasks/") and key.count("/") >= 2:
                task, metric = key.split("/", 2)[1:]
                results.setdefault(r["step"], {})[(task, metric)] = value
    return results


def tasks_section(files: RunFiles, columns: int = 4) -> list[str]:
    lines = ["## Downstream tasks", ""]
    results = task_results(files.records)
    if not results:
        return [*lines, "No downstream tasks were evaluated (no `tasks/<task>/<metric>` rows in metrics.jsonl).", ""]
    steps = sorted(results)[-columns:]
    keys = sorted({k for step in steps for k in results[step]})
    rows = [[task, metric, *(f"{results[s][(task, metric)]:.4f}" if (task, metric) in results[s] else ""
                             for s in steps)] for task, metric in keys]
    shown = "" if len(results) <= columns else f" (the last {columns} of {len(results)} evaluations)"
    return [*lines, f"Each task's metrics at the steps it was evaluated{shown}:", "",
            *_table(["task", "metric", *(f"step {s}" for s in steps)], rows),
            *contamination_lines(files, sorted({task for task, _ in keys}))]


def contamination_lines(files: RunFiles, tasks: list[str]) -> list[str]:
    """The tasks' dirty fractions against the run's training data, where `zerolm contamination` measured them."""
    if files.launches:
        locations = [d["location"] for d in files.launches[-1].data]
    else:
        recorded = files.checkpoint.dataset_location if files.checkpoint else None
        locations = contamination.training_locations(files.config, recorded)
    dirty = {name: t for name, t in contamination.dirty_fractions(locations).items() if name in tasks}
    if not dirty:
        return []
    rows = [[name, t["documents"], t["dirty"], f"{t['dirty_fraction']:.1%}"] for name, t in dirty.items()]
    return ["", f"How much of each task the training data holds (`zerolm contamination`: documents sharing a "
            f"{next(iter(dirty.values()))['ngram']}-gram with it):", "",
            *_table(["task", "documents", "dirty", "dirty fraction"], rows)]


def time_rows(files: RunFiles) -> list[tuple[str, float | None]]:
    """(what, seconds) of the run's wall-clock time, None where this run did not record it."""
    total = {key: sum(r.get(key, 0.0) for r in files.records) for key in
             sorted({k for r in files.records for k in r if k.endswith("_s") and not k.endswith("_per_s")})}
    recorded = bool(files.launches)
    steps = total.pop("step_time_s", 0.0)
    wait = total.pop("data_wait_s", 0.0)
    started = [(x.start_s, x.start_step > 0) for x in files.launches]
    rows: list[tuple[str, float | None]] = [
        ("compiling the training step", sum(x.compile_s for x in files.launches) if recorded else None),
        ("restoring checkpoints", sum(s for s, resumed in started if resumed) if recorded else None),
        ("initialising a fresh state (or train.init_from's)",
         sum(s for s, resumed in started if not resumed) if recorded else None),
        ("training steps (computing)", steps - wait), (NAMED_TIMES["data_wait_s"], wait)]
    rows += [(NAMED_TIMES.get(key, f"`{key}`"), seconds) for key, seconds in total.items()]
    return [*rows, (LOST, lost_seconds(files.launches) if recorded else None)]


def lost_seconds(recorded: list[Launch]) -> float | None:
    """The seconds of the work the run's restarts dropped (zerolm.observe.launches.Launch.lost_s); None where a launch
    of the run did not record it."""
    seconds = [x.lost_seconds for x in recorded]
    return None if None in seconds else sum(s for s in seconds if s is not None)


def lost_parts(recorded: list[Launch]) -> dict[str, float]:
    """The lost seconds by what they were spent on (NAMED_TIMES' words, a step's wait for data within its time)."""
    parts: dict[str, float] = {}
    for launch in recorded:
        for key, seconds in (launch.lost_s or {}).items():
            if key != "data_wait_s":
                what = NAMED_TIMES.get(key, f"`{key}`")
                parts[what] = parts.get(what, 0.0) + seconds
    return parts


def time_section(files: RunFiles) -> list[str]:
    rows = time_rows(files)
    counted = sum(s for _, s in rows if s is not None)
    table = [[what, f"{s:,.1f}" if s is not None else NOT_RECORDED,
              f"{s / counted:.1%}" if s is not None and counted else ""] for what, s in rows]
    lines = ["## Where the time went", "",
             "Summed over the run's launches from metrics.jsonl's `*_s` fields and launches.jsonl. A step's time "
             "runs from the previous step's end to its own (its wait for data included, shown apart); saves and "
             "evaluations are timed between steps, an evaluation's first compile included.", "",
             *_table(["what", "seconds", "share"], table)]
    if not files.launches:
        return [*lines, f"Steps lost to interruptions: {NOT_RECORDED}.", ""]
    return [*lines, restarts_said(files.launches) + "; " + losses_said(files), ""]


def restarts_said(recorded: list[Launch]) -> str:
    """How many launches, and how each after the first started: from a checkpoint, or from scratch."""
    later = recorded[1:]
    scratch = sum(x.start_step == 0 for x in later)
    said = f"{len(recorded)} launch(es): {len(later) - scratch} resumed from a checkpoint"
    if scratch:
        said += f", {scratch} restarted from scratch (there was no checkpoint to resume from)"
    return said


def losses_said(files: RunFiles) -> str:
    """The steps the restarts lost, and the time: the dropped rows' own seconds, or (launches recorded before
    those were) an estimate at the median step time."""
    steps = sum(x.steps_lost for x in files.launches)
    said = f"{steps} step(s) lost to interruptions (logged by a launch, then trained again by the next)"
    seconds = lost_seconds(files.launches)
    if seconds is not None:
        parts = ", ".join(f"{what} {s:,.1f} s" for what, s in lost_parts(files.launches).items() if s)
        return said + f", {seconds:,.1f} s of work lost" + (f" ({parts})" if parts else "") + (
            ": the rows of metrics.jsonl after the step each launch started from, which it dropped.")
    step_time = _median(files.steps, "step_time_s")
    cost = f", about {steps * step_time:,.1f} s at the median step time" if steps and step_time else ""
    return said + cost + f" (the evaluations and saves lost: {NOT_RECORDED})."


def launches_section(files: RunFiles) -> list[str]:
    if not files.launches:
        return []
    rows = [[i, datetime.datetime.fromtimestamp(x.time, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
             _how_started(i, x), x.last_logged_step, x.steps_lost,
             f"{x.lost_seconds:.1f}" if x.lost_seconds is not None else NOT_RECORDED, f"{x.compile_s:.1f}",
             f"{x.start_s:.1f}", x.facts.get("zerolm_version", "")] for i, x in enumerate(files.launches, 1)]
    return ["## Launches", "", "Each launch after the first is a dotted line on the figures, at the tokens seen where "
            "it started.", "",
            *_table(["launch", "started", "started from", "metrics.jsonl held up to step", "steps lost", "lost s",
                     "compile s", "restore/init s", "zerolm"], rows)]


def _how_started(n: int, launch: Launch) -> str:
    if n == 1 and launch.branched_from is not None:
        return f"a branch of step {launch.start_step} of {launch.branched_from['name']}"
    if launch.start_step:
        return f"the checkpoint of step {launch.start_step}"
    return "a fresh state" if n == 1 else "scratch (no checkpoint to resume from)"


def log_to_wandb(files: RunFiles, page: Path, say=print) -> str:
    """The report's folder as an artifact of the run's wandb run (logging.wandb offline or online, and the
    WANDB_MODE variable not `disabled`); returns what happened, in one line."""
    cfg, wandb_id = files.config, (files.launches[-1].wandb_id if files.launches else
                                   files.checkpoint.wandb_id if files.checkpoint else None)
    if cfg is None or wandb_id is None or cfg["logging"]["wandb"] == "disabled":
        raise ReportError(f"{files.run_dir}: the run did not log to wandb (logging.wandb: disabled, or "
                          f"{NOT_RECORDED}); the report is in {page.parent}")
    from zerolm.observe.metrics import WandbRun, finish_wandb, start_wandb

    run, env_before = start_wandb(files.run_dir, WandbRun(cfg["logging"]["wandb_project"], cfg["name"], wandb_id,
                                                          cfg["logging"]["wandb"], {}), say)
    if run is None:
        return "wandb: disabled here (WANDB_MODE=disabled): the report was not logged"
    try:
        import wandb

        artifact = wandb.Artifact(f"report-{wandb_id}", type="report")
        artifact.add_dir(str(page.parent))
        run.log_artifact(artifact)
    finally:
        finish_wandb(run, env_before)
    return f"wandb: logged {page.parent} as the artifact report-{wandb_id} of run {wandb_id}"
