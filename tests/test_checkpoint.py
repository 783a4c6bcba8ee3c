"""Checkpoints, in real processes: exact resume after kill -9, SIGTERM and Ctrl-C, a crash mid-save,
elastic restore (dp 8 -> 4 -> 1), damaged checkpoints, one run per directory, and the refusals that keep
checkpoints safe. (Multi-process runs are in test_launch.py.)"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import runs
from conftest import REPO
from runs import (
    STEPS,
    command,
    env,
    kill_9_after,
    logged_steps,
    losses,
    release,
    shared_run,
    snapshot,
    start_and_wait,
    start_held,
    train,
)
from zerolm.checkpoint.listing import SIZES_ONLY
from zerolm.checkpoint.store import Checkpoints
from zerolm.core.exitcodes import (
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
)
from zerolm.data.prepare import prepare
from zerolm.observe import launches

pytestmark = pytest.mark.slow  # training runs in subprocesses


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run: 16 steps on dp = 8, checkpoints every 4 (test_launch compares with it too)."""
    run_dir = shared_run(tmp_path_factory, "straight")
    return run_dir, losses(run_dir)


def test_kill_9_then_resume_is_bit_identical(straight, tmp_path):
    _, reference = straight
    kill_before = int(np.random.default_rng().integers(6, 15))  # a random step after the first checkpoint
    kill_9_after(tmp_path, before_step=kill_before)
    latest = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    assert latest in (4, 8, 12)
    logged = logged_steps(tmp_path)
    train(tmp_path)
    assert losses(tmp_path) == reference, f"killed before step {kill_before}"
    first, second = launches.read(tmp_path / "log")  # the steps the kill lost, recorded by the next launch
    assert (first.start_step, second.start_step, second.last_logged_step, second.steps_lost) == \
        (0, latest, logged, logged - latest)


def test_crash_during_a_save_leaves_the_previous_checkpoint_latest(straight, tmp_path):
    _, reference = straight
    ckpt = tmp_path / "ckpt"
    cmd_env = env(ZEROLM_TEST_SLOW_FINALIZE_STEP="8")
    cmd_env["kw"] = {"script": "slow_save_train.py"}
    proc = start_and_wait(tmp_path, cmd_env, lambda: any(p.name.startswith("8.") for p in ckpt.glob("8*")))
    time.sleep(0.5)  # well inside the held-back finalize
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    unfinished = [p.name for p in ckpt.iterdir() if p.name.startswith("8")]
    assert len(unfinished) == 1 and ".orbax-checkpoint-tmp" in unfinished[0]  # only the temporary directory
    assert Checkpoints(ckpt, read_only=True).latest_step() == 4
    proc = train(tmp_path)
    assert f"checkpoints: removed 1 unfinished save(s) of an earlier run that died while saving: {unfinished[0]}" \
        in proc.stdout
    assert "resumed from" in proc.stdout and f"{ckpt}/4 " in proc.stdout
    assert not [p for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert losses(tmp_path) == reference


def test_elastic_restore_dp8_to_dp4_to_one_device(straight, tmp_path):
    run_dir, reference = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    for step in ("12", "16"):
        shutil.rmtree(tmp_path / "ckpt" / step)  # resume from the dp = 8 checkpoint at step 8
    four = train(tmp_path, devices=4, steps=12)
    assert "dp 8 -> 4; accumulation steps recomputed 2 -> 4 (same global batch of 16)" in four.stdout
    one = train(tmp_path, devices=1)
    assert "dp 4 -> 1; accumulation steps recomputed 4 -> 16 (same global batch of 16)" in one.stdout
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(9, 17))
    # Same samples in the same order: only the float32 summation order differs between device counts.
    np.testing.assert_allclose([resumed[s] for s in range(9, 17)], [reference[s] for s in range(9, 17)], rtol=2e-5)


def test_elastic_restore_across_tensor_parallel_layouts(straight, tmp_path):
    """(dp 8, tp 1) -> (4, 2) -> (2, 4) -> one device, with the same global batch and data order."""
    run_dir, reference = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    for step in ("12", "16"):
        shutil.rmtree(tmp_path / "ckpt" / step)
    tp2 = train(tmp_path, "mesh.tp=2", steps=11)
    assert "saved on dp=8 tp=1" in tp2.stdout and "tensor parallelism changed: tp 1 -> 2" in tp2.stdout
    tp4 = train(tmp_path, "mesh.tp=4", "checkpoint.every=1", steps=13)
    assert "saved on dp=4 tp=2" in tp4.stdout and "tp 2 -> 4" in tp4.stdout
    one = train(tmp_path, devices=1)
    assert "saved on dp=2 tp=4" in one.stdout
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(9, 17))
    np.testing.assert_allclose([resumed[s] for s in range(9, 17)], [reference[s] for s in range(9, 17)], rtol=2e-5)


def test_a_checkpoint_restores_at_another_zero_stage_and_layout(straight, tmp_path):
    """ZeRO-1 on (dp 8) -> ZeRO-3 on (dp 4, tp 2) -> ZeRO-2 on dp 2: the optimizer state (and at stage 3 the
    parameters) re-laid out each time, the same losses as the straight run to float32 summation order."""
    run_dir, reference = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    for step in ("12", "16"):
        shutil.rmtree(tmp_path / "ckpt" / step)
    three = train(tmp_path, "zero.stage=3", "mesh.tp=2", steps=12)
    assert "ZeRO-3" in three.stdout and "ZeRO stage changed: 1 -> 3" in three.stdout
    two = train(tmp_path, "zero.stage=2", devices=2)
    assert "saved on dp=4 tp=2" in two.stdout and "ZeRO stage changed: 3 -> 2" in two.stdout
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(9, 17))
    np.testing.assert_allclose([resumed[s] for s in range(9, 17)], [reference[s] for s in range(9, 17)], rtol=2e-5)


def test_kill_9_at_zero_stage_3_then_resume_is_bit_identical(straight, tmp_path):
    """Parameters split over dp (ZeRO-3) resume exactly as ZeRO-1's do; the run trains as ZeRO-1's (to float32
    summation order) and its checkpoint evaluates as ZeRO-1's."""
    stage_1, reference = straight
    straight_3 = tmp_path / "straight"
    train(straight_3, "zero.stage=3")
    killed = tmp_path / "killed"
    kill_9_after(killed, "zero.stage=3", before_step=10)
    train(killed, "zero.stage=3")
    assert losses(killed) == losses(straight_3)
    got = losses(straight_3)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [reference[s] for s in sorted(reference)], rtol=2e-5)
    evals = [json.loads(runs.zerolm("eval", "--checkpoint", run / "ckpt", "--json", devices=2).stdout)
             for run in (stage_1, killed)]
    assert evals[0]["step"] == evals[1]["step"] == STEPS
    assert evals[1]["loss"] == pytest.approx(evals[0]["loss"], rel=1e-5)


def test_a_checkpoint_of_an_older_format_is_refused_not_moved(straight, tmp_path):
    run_dir, _ = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "16" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["format"]
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "16" / "zerolm_files.json").unlink()  # as an older zerolm left it
    before = snapshot(tmp_path / "ckpt")
    proc = train(tmp_path, "train.steps=20", expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ckpt' / '16'}: checkpoint format 1, this zerolm reads format 2 (c_attn's kernel became "
        "(layers, d, 3, d) for tensor parallelism); use it with the zerolm that wrote it, or start over with "
        "--resume never --overwrite")
    assert snapshot(tmp_path / "ckpt") == before and not (tmp_path / "ckpt.damaged").exists()


def test_resume_follows_the_data_not_its_location(straight, tmp_path):
    run_dir, reference = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    for step in ("12", "16"):
        shutil.rmtree(tmp_path / "ckpt" / step)
    default = Path(os.environ["ZEROLM_CACHE"]) / "datasets" / "kjv-bpe2048-seq32"  # what the runs trained on
    resharded = tmp_path / "resharded"
    prepare("default", resharded, seq_len=32, samples_per_shard=1000, progress=False)  # same text, other order
    refused = train(tmp_path, f"data.dataset={resharded}", expect=2)
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'ckpt' / '8'}: the data differs from the checkpoint's, so the data order cannot "
        "continue: train_shards_sha256: ")
    shutil.copytree(default, tmp_path / "copy")  # the same dataset somewhere else resumes, exactly
    train(tmp_path, f"data.dataset={tmp_path / 'copy'}")
    resumed = losses(tmp_path)
    assert [resumed[s] for s in range(9, 17)] == [reference[s] for s in range(9, 17)]


def test_refusals_leave_checkpoints_untouched(straight, tmp_path):
    run_dir, _ = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    before = snapshot(tmp_path / "ckpt")

    fresh = train(tmp_path, expect=2, args=["--resume", "never"])
    assert fresh.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ckpt'}: already holds checkpoints (latest step 16); resume with --resume auto, "
        "or pass --overwrite to start over (the old checkpoints are moved aside, not deleted)")
    other_model = train(tmp_path, "model.d_model=64", "train.steps=20", expect=2)
    assert other_model.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ckpt' / '16'}: the checkpoint's model differs from the config: "
        "model.d_model: checkpoint 32, config 64")
    other_precision = train(tmp_path, "zero.precision=mixed", "train.steps=20", expect=2)
    assert other_precision.stderr.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'ckpt' / '16'}: the checkpoint was trained with zero.precision=fp32, the config says "
        "mixed; resume with --set zero.precision=fp32")
    assert snapshot(tmp_path / "ckpt") == before
    done = train(tmp_path)
    assert done.stdout.strip().splitlines()[-1].startswith(f"nothing to do: {tmp_path / 'ckpt'} is at step 16 and ")
    for refused in (fresh, other_model, other_precision, done):  # said before the step is built and compiled
        assert "collectives per step" not in refused.stdout and "zerolm: tiny:" not in refused.stdout

    # A damaged checkpoint, under --resume strict: the largest array-data file is gone.
    data = max((tmp_path / "ckpt" / "16" / "state").rglob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    data.unlink()
    before = snapshot(tmp_path / "ckpt")
    broken = train(tmp_path, "train.steps=20", expect=2, args=["--resume", "strict"])
    assert broken.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ckpt' / '16'}: damaged checkpoint: {data.relative_to(tmp_path / 'ckpt' / '16')} is "
        "missing (--resume strict; --resume auto moves it aside and takes the newest intact checkpoint before it)")
    assert snapshot(tmp_path / "ckpt") == before

    overwritten = train(tmp_path, steps=4, args=["--resume", "never", "--overwrite"])
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.replaced-")]
    assert len(aside) == 1 and snapshot(aside[0]) == before  # moved, not deleted
    assert "moved the old run aside" in overwritten.stdout
    assert Checkpoints(tmp_path / "ckpt", read_only=True).steps() == [4]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    proc = train(tmp_path, "train.lr=1e6", "train.grad_clip=1e9", "checkpoint.every=1", steps=30, expect=EXIT_NONFINITE)
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: step ") and "is not finite; stopping without saving it" in message
    bad_step = int(message.split()[2].rstrip(":"))
    ckpts = Checkpoints(tmp_path / "ckpt", read_only=True)
    assert ckpts.latest_step() < bad_step and np.isfinite(ckpts.meta(ckpts.latest_step()).loss)

    skipping = tmp_path / "skip"
    blown = ["train.lr=1e6", "train.grad_clip=1e9", "train.skip_nonfinite=true"]
    train(skipping, *blown, "train.max_consecutive_skips=1000", steps=30)
    records = [json.loads(line) for line in (skipping / "log" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 30 and steps[-1]["skipped_updates"] > 0

    # Skipping every update is no way to train: after max_consecutive_skips in a row the run stops.
    stuck = train(tmp_path / "stuck", *blown, "train.max_consecutive_skips=5", steps=30, expect=EXIT_NONFINITE)
    message = stuck.stderr.strip().splitlines()[-1]
    assert message.startswith("error: step ") and message.endswith(
        ": the last 5 updates were all skipped (non-finite gradients; train.max_consecutive_skips is 5); stopping "
        "without saving: lower train.lr, or check the data")


def test_checkpoints_command_lists_the_run(straight):
    run_dir, _ = straight
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "checkpoints", str(run_dir / "ckpt")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["step", "saved"]
    assert [line.split()[0] for line in lines[1:-2]] == ["8", "12", "16"]  # keep: 3
    assert "4,096" in lines[1]  # tokens seen at step 8: 8 steps x 16 sequences x 32 tokens
    assert lines[-2] == "`--resume auto` would take step 16"
    assert lines[-1].startswith("(a step marked ok has every file with the size it had when saved, and its metadata "
                                "reads; the arrays' contents are checked only by a restore")
    one = subprocess.run([sys.executable, "-m", "zerolm.cli", "checkpoints", str(run_dir / "ckpt" / "12")],
                         capture_output=True, text=True, cwd=REPO)
    assert one.returncode == 0, one.stderr
    rows = one.stdout.strip().splitlines()
    assert rows[0] == lines[0] and rows[1] == lines[2] and rows[2] == lines[-1]  # that step, described alike


def _lock_line(err: str, ckpt) -> str:
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {ckpt}: in use by another run (host ") and ", pid " in line and \
        "; wait for it to end or stop it (one run per checkpoint directory)" in line, err[-2000:]
    return line


def test_two_runs_racing_into_one_directory(straight, tmp_path):
    _, reference = straight
    # Both held before step 2: the winner is certainly alive when the loser asks for the directory.
    hold_env = env(ZEROLM_TEST_HOLD=str(tmp_path / "held"), ZEROLM_TEST_HOLD_BEFORE_STEP="2")
    procs = [subprocess.Popen(command(tmp_path, script="held_train.py"), env=hold_env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.time() + 240
    while not (any(p.poll() is not None for p in procs) and (tmp_path / "held").exists()):
        assert not all(p.poll() is not None for p in procs), [p.communicate()[1][-1500:] for p in procs]
        assert time.time() < deadline, "timed out waiting for the runs"
        time.sleep(0.02)
    release(tmp_path)
    results = [(p.returncode, out, err) for p in procs for out, err in [p.communicate(timeout=300)]]
    assert sorted(code for code, _, _ in results) == [0, 2], [err[-1500:] for _, _, err in results]
    loser = next(err for code, _, err in results if code == 2)
    winner = next(p for p, (code, _, _) in zip(procs, results, strict=True) if code == 0)
    assert f"pid {winner.pid}," in _lock_line(loser, tmp_path / "ckpt")
    assert Checkpoints(tmp_path / "ckpt", read_only=True).steps() == [8, 12, 16]
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert losses(tmp_path) == reference


def test_overwrite_is_refused_while_a_run_is_live(tmp_path):
    ckpt = tmp_path / "ckpt"
    live = start_held(tmp_path, before_step=6, until=lambda: Checkpoints(ckpt, read_only=True).latest_step() is not None)
    refused = train(tmp_path, expect=2, args=["--resume", "never", "--overwrite"])
    assert f"pid {live.pid}," in _lock_line(refused.stderr, ckpt)
    assert "collectives per step" not in refused.stdout  # refused before its step was built and compiled
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.")] == []  # nothing moved aside
    live.send_signal(signal.SIGTERM)
    release(tmp_path)
    _, err = live.communicate(timeout=120)
    assert live.returncode == EXIT_PREEMPTED, err[-2000:]  # the live run was untouched and saved its step
    assert Checkpoints(ckpt, read_only=True).latest_step() == int(err.split("checkpoint saved at step ")[1].split(";")[0])


def test_damaged_latest_checkpoint_resumes_from_the_one_before(straight, tmp_path):
    run_dir, reference = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    shutil.copytree(run_dir / "log", tmp_path / "log")
    data = max((tmp_path / "ckpt" / "16" / "state").rglob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    saved_size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:1000])  # truncated
    damaged = snapshot(tmp_path / "ckpt" / "16")
    rel = data.relative_to(tmp_path / "ckpt" / "16")

    listing = subprocess.run([sys.executable, "-m", "zerolm.cli", "checkpoints", str(tmp_path / "ckpt")],
                             capture_output=True, text=True, cwd=REPO)
    assert listing.returncode == 0 and listing.stderr == ""  # no library noise
    rows = listing.stdout.strip().splitlines()
    assert rows[-3].startswith("16 ") and rows[-3].endswith(f"DAMAGED: {rel} has 1000 bytes, {saved_size} when it was saved")
    assert rows[-2] == "`--resume auto` would take step 12 (the newer damaged ones are moved aside)"
    assert rows[-1] == SIZES_ONLY

    proc = train(tmp_path)
    moved = next((tmp_path / "ckpt.damaged").iterdir())
    assert f"checkpoints: step 16 is damaged ({rel} has 1000 bytes, {saved_size} when it was saved); moved it aside " \
           f"to {moved}; resuming from step 12" in proc.stdout
    assert snapshot(moved) == damaged  # moved aside, never deleted
    assert losses(tmp_path) == reference  # steps 13..16 again, bit-identical, each logged once

    # A damaged metadata file is one marked row, not a failed listing.
    (tmp_path / "ckpt" / "12" / "meta" / "metadata").write_text("{not json")
    listing = subprocess.run([sys.executable, "-m", "zerolm.cli", "checkpoints", str(tmp_path / "ckpt")],
                             capture_output=True, text=True, cwd=REPO)
    rows = listing.stdout.strip().splitlines()
    assert listing.returncode == 0 and listing.stderr == ""
    assert [r.split()[0] for r in rows[1:-2]] == ["8", "12", "16"] and "DAMAGED: meta/metadata has" in rows[2]
    assert rows[1].endswith(" ok") and rows[3].endswith(" ok") and rows[-2] == "`--resume auto` would take step 16"


def test_a_restore_that_fails_without_damage_moves_nothing_and_the_next_launch_resumes(straight, tmp_path):
    """The device out of memory, storage that stopped answering, no permission, a bug in the restore path (each
    injected where orbax reads the arrays: tests/faulty_restore_train.py): none of them is damage. The run stops
    with the cause and its exit code, every checkpoint stays where it was, and a launch without the fault resumes
    from the newest, bit-identical to the straight run."""
    run_dir, reference = straight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    shutil.copytree(run_dir / "log", tmp_path / "log")
    shutil.rmtree(tmp_path / "ckpt" / "16")  # the newest is step 12: a resume has steps to train
    where, kept = tmp_path / "ckpt" / "12", "the checkpoint is kept as it is"
    before = snapshot(tmp_path / "ckpt")
    said = {
        "oom": (EXIT_USAGE, f"error: {where}: the device ran out of memory to restore it (JaxRuntimeError: "
                            f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.0GiB); {kept}; restore it "
                            "where its state fits: more devices, zero.stage 3"),
        "storage": (EXIT_STORAGE, f"error: {where}: the storage failed as zerolm tried to restore it (ValueError: "
                                  'UNAVAILABLE: Error reading "params.wte/0.0"'),
        "permission": (EXIT_USAGE, f"error: {where}: no permission to restore it (ValueError: PERMISSION_DENIED: "),
        "bug": (EXIT_BUG, "zerolm: this is a bug in zerolm, not a mistake in your input"),
    }
    for fault, (code, line) in said.items():
        proc = train(tmp_path, expect=code, script="faulty_restore_train.py",
                     extra_env={"ZEROLM_TEST_RESTORE_FAULT": fault})
        assert proc.stderr.strip().splitlines()[-1].startswith(line), (fault, proc.stderr[-2000:])
        assert "is damaged" not in proc.stdout + proc.stderr and "resumed from" not in proc.stdout, fault
        assert snapshot(tmp_path / "ckpt") == before, fault  # nothing moved aside, nothing written
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.")] == [], fault
        if fault == "bug":  # its traceback, and what became of the checkpoint
            assert "Traceback" in proc.stderr and \
                f"zerolm: {where}: raised while trying to restore it; {kept} (not taken for damaged)" in proc.stderr
    resumed = train(tmp_path)
    assert f"resumed from {where} (step 12" in resumed.stdout
    assert losses(tmp_path) == reference

    # Damage that only a restore finds (every file its recorded size, the bytes of one changed) is still damage.
    data = max((tmp_path / "ckpt" / "16" / "state").rglob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))
    corrupt = train(tmp_path, steps=17)
    assert re.search(r"checkpoints: step 16 is damaged \(cannot restore it \(ValueError: [A-Z_]+: Error reading .*\); "
                     r"moved it aside to .*; resuming from step 12", corrupt.stdout), corrupt.stdout[-2000:]


@pytest.mark.parametrize("sig, why", [(signal.SIGTERM, "preempted"), (signal.SIGINT, "interrupted")],
                         ids=["sigterm", "ctrl-c"])
def test_a_stop_signal_saves_the_step_reached_and_exits_75(straight, tmp_path, sig, why):
    """SIGTERM (a preemption) and Ctrl-C alike: the step reached is saved, exit 75, resume is exact."""
    _, reference = straight
    stop_before = int(np.random.default_rng().integers(3, 14))
    proc = start_held(tmp_path, before_step=stop_before)
    proc.send_signal(sig)
    release(tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    saved = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    assert err.strip().splitlines()[-1] == f"zerolm: {why}: checkpoint saved at step {saved}; exiting with code 75"
    assert "Traceback" not in err
    assert saved == stop_before  # the step it had reached, not the last periodic one
    if why == "interrupted":  # said when Ctrl-C is pressed, while the bar still shows an earlier step
        assert f"zerolm: interrupted: stopping after step {saved} (the step in flight" in err
    wandb_id = Checkpoints(tmp_path / "ckpt", read_only=True).meta(saved).wandb_id
    train(tmp_path)
    assert losses(tmp_path) == reference
    assert Checkpoints(tmp_path / "ckpt", read_only=True).meta(STEPS).wandb_id == wandb_id  # same wandb run


def test_second_ctrl_c_abandons_the_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd_env = env(ZEROLM_TEST_SLOW_FINALIZE_STEP="8")
    cmd_env["kw"] = {"script": "slow_save_train.py"}
    proc = start_and_wait(tmp_path, cmd_env, lambda: any(p.name.startswith("8.") for p in ckpt.glob("8*")))
    proc.send_signal(signal.SIGINT)  # saves the step reached: waits behind the held-back save of step 8
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert err.strip().splitlines()[-1] == ("zerolm: interrupted again: abandoned the save; the latest complete "
                                            "checkpoint stays the latest; exiting with code 130")
    assert Checkpoints(ckpt, read_only=True).latest_step() == 4


def test_overwrite_moves_the_old_runs_logs_aside_with_its_checkpoints(straight, tmp_path):
    """--resume never --overwrite: the old metrics (and everything else of the run's logging dir) go aside with the
    checkpoints, byte for byte, and the line that reports the move names where."""
    shutil.copytree(straight[0] / "ckpt", tmp_path / "ckpt")
    shutil.copytree(straight[0] / "log", tmp_path / "log")
    (tmp_path / "log" / "wandb").mkdir()
    (tmp_path / "log" / "wandb" / "run.wandb").write_text("old wandb run")
    old_logs = runs.snapshot(tmp_path / "log")
    proc = runs.train(tmp_path, steps=4, args=("--resume", "never", "--overwrite"))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("checkpoints: moved the old run aside to "))
    aside = Path(re.search(r"; its metrics and logs \(launches\.jsonl, metrics\.jsonl, wandb\) to (\S+)$", line).group(1))
    assert aside.parent == tmp_path and aside.name.startswith("log.replaced-")
    assert runs.snapshot(aside) == old_logs
    assert sorted(runs.losses(tmp_path)) == [1, 2, 3, 4]  # the new run's own lines only


def test_two_runs_sharing_a_logging_dir(tmp_path):
    """Different checkpoint directories, one logging.dir: the second run is refused with one line while the
    first runs, and the first run's metrics are whole."""
    first = start_held(tmp_path, "checkpoint.every=1000", before_step=5)  # alive until the second has answered
    second = subprocess.run(runs.command(tmp_path, f"checkpoint.dir={tmp_path / 'other'}", steps=4), env=runs.env(),
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    release(tmp_path)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert second.returncode == 2, second.stderr[-2000:]
    assert "collectives per step" not in second.stdout  # refused before its step was built and compiled
    assert not list((tmp_path / "other").glob("[0-9]*"))
    assert re.fullmatch(rf"error: {tmp_path / 'log'}: in use by another run \(host \S+, pid {first.pid}, since .+\); "
                        r"wait for it to end or stop it \(one run per logging directory\)", second.stderr.strip())
    steps = sorted(runs.losses(tmp_path))  # each step once: nothing of the second run's
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3


def test_a_checkpoint_directory_where_no_lock_can_be_made_is_one_line(tmp_path):
    """A checkpoint.dir that cannot be written (here: below a file; a read-only disk alike) is one line, exit 2."""
    (tmp_path / "file").write_text("x")
    proc = runs.train(tmp_path, f"checkpoint.dir={tmp_path / 'file' / 'ckpt'}", steps=2, expect=2)
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'file' / 'ckpt'}: cannot take the run lock of this checkpoint directory (Not a directory: "
        f"{tmp_path / 'file' / 'ckpt'}); is it writable?"]


def test_a_full_disk_stops_the_run_at_the_failed_save(tmp_path):
    """The checkpoint directory on a 3 MiB tmpfs: the first save fits, the second does not. The run stops at
    once with one line naming the directory and its free space (exit 74), and the first checkpoint stays the latest."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3000k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        proc = train(tmp_path, f"checkpoint.dir={disk / 'ckpt'}", "checkpoint.every=2", steps=40, expect=74)
        last = proc.stderr.strip().splitlines()[-1]
        # Which save finds the disk full depends on when orbax's background cleanup of older steps ran.
        m = re.fullmatch(rf"error: {disk / 'ckpt'}: saving the checkpoint of step (\d+) failed \(.+\); [\d.,]+ MiB "
                         r"free there; the checkpoint of step (\d+) stays the latest; stopping the run", last)
        assert m and int(m[1]) == int(m[2]) + 2, proc.stderr[-3000:]
        # Stopped at the first step after the background save reported its failure, not at the end of the run (how
        # many steps that takes depends on the machine's load, so no tighter bound is asserted).
        assert max(losses(tmp_path)) < 40
        ckpts = Checkpoints(disk / "ckpt", read_only=True)
        assert ckpts.latest_step() == int(m[2])
        ckpts.verify(int(m[2]))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_mixed_precision_resumes_exactly_from_its_master_weights(tmp_path):
    """zero.precision=mixed: the checkpoint holds the float32 master weights (in the optimizer state) and
    the bfloat16 working params; 8 steps straight equal 4 steps, a restart, and 4 more, bit for bit."""
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    train(straight_dir, "zero.precision=mixed", steps=8)
    train(resumed_dir, "zero.precision=mixed", steps=4)
    train(resumed_dir, "zero.precision=mixed", steps=8)
    reference, resumed = losses(straight_dir), losses(resumed_dir)
    assert [resumed[s] for s in range(5, 9)] == [reference[s] for s in range(5, 9)]
    meta = Checkpoints(resumed_dir / "ckpt", read_only=True).meta(8)
    assert meta.config["zero"]["precision"] == "mixed"
