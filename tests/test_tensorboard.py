"""logging.tensorboard: the run's TensorBoard scalars, read back with TensorBoard's own reader, are metrics.jsonl
(every field, every step), after a kill -9 and a resume too, in a local directory and on gs://."""

import json
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from runs import kill_9_after, train
from zerolm.checkpoint.store import Checkpoints

pytestmark = pytest.mark.slow  # training runs in subprocesses

ON = ("logging.tensorboard=true", "train.eval_every=5")  # evaluations at 5, 10, 15 and 16: rows of their own


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) points as TensorBoard shows them: its reader, restarts purged (its default)."""
    reader = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def jsonl_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as TensorBoard's float32 scalars: a field's (step, value) points in the order written, a value
    repeated at its step (tokens_seen beside an evaluation) once."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            point = (record["step"], float(np.float32(value)))
            if key != "step" and point not in out.setdefault(key, []):
                out[key].append(point)
    return out


def same(got: dict, expected: dict) -> bool:
    """Equal, NaN equal to NaN (a skipped non-finite step's loss)."""
    return got.keys() == expected.keys() and all(
        len(got[k]) == len(expected[k]) and all(s == t and (v == w or math.isnan(v) and math.isnan(w))
                                                for (s, v), (t, w) in zip(got[k], expected[k], strict=True))
        for k in got)


def test_the_scalars_are_metrics_jsonl_after_a_kill_9_and_a_resume(tmp_path):
    """Killed before a step after an evaluation that is after any checkpoint the launch could have committed
    (checkpoints every 4 steps, evaluations every 5): its TensorBoard holds steps the resumed run trains again."""
    kill_before = int(np.random.default_rng().choice([7, 8, 11, 12]))
    kill_9_after(tmp_path, *ON, before_step=kill_before)
    latest = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    killed = {step for step, _ in tensorboard_scalars(tmp_path / "log" / "tensorboard").get("loss", [])}
    assert set(range(1, latest + 1)) <= killed and max(killed) > latest, (kill_before, latest, killed)
    train(tmp_path, *ON)
    scalars, expected = tensorboard_scalars(tmp_path / "log" / "tensorboard"), jsonl_scalars(tmp_path / "log")
    assert same(scalars, expected), f"killed before step {kill_before}: {scalars} != {expected}"
    assert [step for step, _ in scalars["loss"]] == list(range(1, 17))  # each step once: the resumed run's
    assert [step for step, _ in scalars["val_loss"]] == [5, 10, 15, 16]
    assert {"lr", "tokens_per_s", "step_time_s", "model_tflops_per_device", "save_s", "eval_s"} <= set(scalars)
    assert len(list((tmp_path / "log" / "tensorboard").glob("events.out.tfevents.*"))) == 2  # a file per launch


def test_the_scalars_go_to_gs_and_a_resumed_run_appends_there(gcs, tmp_path):
    """logging.tensorboard_dir on gs:// (TensorBoard reads it there too): 8 steps, then the run resumed to 16."""
    where = f"{gcs.url}/tensorboard/run"
    launches = [train(tmp_path, *ON, f"logging.tensorboard_dir={where}", steps=8),
                train(tmp_path, *ON, f"logging.tensorboard_dir={where}")]
    for proc in launches:
        assert "Traceback" not in proc.stdout + proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert not (tmp_path / "log" / "tensorboard").exists()
    assert len([name for name in gcs.objects("tensorboard/run/") if ".tfevents." in name]) == 2
    scalars = tensorboard_scalars(where)
    assert same(scalars, jsonl_scalars(tmp_path / "log"))
    assert [step for step, _ in scalars["loss"]] == list(range(1, 17))
