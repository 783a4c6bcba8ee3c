"""gs:// end to end, on a real GCS server (fake-gcs-server, benchmarks/lib/gcs.py) that the clients find only through
their standard variables: checkpoints (kill -9 and an exact resume, two processes, another mesh), a
dataset prepared into a bucket and trained from, the compilation cache, the commands on a gs:// run, the
run lease's races, storage faults (the server stopped mid-run; injected 503s and dropped connections),
and every bad location's one line."""

import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import runs
from benchmarks.lib.gcs import FaultyProxy, GCSServer, environment
from conftest import REPO, TINY, Bucket
from runs import command, env, losses, start_held, train, zerolm
from zerolm.checkpoint.run_lock import LEASE_FILE, LockHeld, RunLock
from zerolm.core import storage
from zerolm.core.exitcodes import EXIT_STORAGE, EXIT_USAGE

pytestmark = pytest.mark.slow  # training runs against a real GCS server


def quiet(proc) -> None:
    """A normal gs:// run or command: no traceback, no warning lines, zerolm's one line saying where gs:// goes
    at most, and none of TensorStore's about credentials (the emulator needs none)."""
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text and "WARNING" not in text, text[-3000:]
    assert text.count("storage: gs:// goes to the emulator") <= 1
    assert "google_auth_provider" not in text, text[-3000:]


@pytest.fixture(scope="module")
def reference(trained_run):
    return losses(trained_run)


@pytest.fixture(scope="module")
def gs_run(gcs_module, tmp_path_factory, reference):
    """16 steps with checkpoints on gs:// (every 4): the same losses as the local run, quietly."""
    run_dir = tmp_path_factory.mktemp("gs-run")
    proc = train(run_dir, f"checkpoint.dir={gcs_module.url}/run")
    assert losses(run_dir) == reference
    quiet(proc)
    assert "storage: gs:// goes to the emulator at http://127.0.0.1:" in proc.stdout
    steps = {name.split("/")[1] for name in gcs_module.objects("run/") if name.endswith("/commit_success.txt")}
    assert steps == {"8", "12", "16"}  # checkpoint.keep 3 (4 was deleted)
    return gcs_module, f"{gcs_module.url}/run", run_dir


def test_kill_9_then_resume_is_bit_identical_on_gs(gcs, reference, tmp_path):
    url = f"{gcs.url}/run"
    committed = lambda: any(n.endswith("/commit_success.txt") and n.count("/") == 2 for n in gcs.objects("run/"))  # noqa: E731
    kill_before = int(np.random.default_rng().integers(6, 15))
    proc = start_held(tmp_path, f"checkpoint.dir={url}", before_step=kill_before, until=committed)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gcs.objects(f"run/{LEASE_FILE}")  # the dead run's lease is still there ...
    resumed = train(tmp_path, f"checkpoint.dir={url}")  # ... and taken over at once: its holder is gone from here
    assert f"resumed from {url}/" in resumed.stdout
    assert losses(tmp_path) == reference, f"killed before step {kill_before}"
    quiet(resumed)
    assert not gcs.objects(f"run/{LEASE_FILE}")  # released at the end
    # Starting over moves the old run aside (server-side copies: GCS has no rename), never deletes it.
    fresh = train(tmp_path, f"checkpoint.dir={url}", steps=4, args=("--resume", "never", "--overwrite"))
    aside = {n.split("/")[1] for n in gcs.objects() if n.startswith("run.replaced-") and n.endswith("commit_success.txt")
             and n.count("/") == 2}
    assert f"checkpoints: moved the old run aside to {gcs.url}/run.replaced-" in fresh.stdout
    assert aside == {"8", "12", "16"} and {n.split("/")[1] for n in gcs.objects("run/") if n.count("/") == 2} == {"4"}


def test_two_processes_to_gs_then_one_process_on_another_mesh(gcs, reference, tmp_path):
    """2 processes × 4 devices checkpoint to gs://; one process resumes from it at (dp 4, tp 2)."""
    url = f"{gcs.url}/run"
    sets = [*runs.SMALL, "train.steps=8", f"checkpoint.dir={url}", f"logging.dir={tmp_path / 'log'}"]
    launch = subprocess.run([sys.executable, "-m", "zerolm.cli", "launch-local", "--processes", "2",
                             "--devices-per-process", "4", "--", "--config", str(TINY),
                             *[a for s in sets for a in ("--set", s)]], env=env(), cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert launch.returncode == 0, launch.stderr[-3000:]
    assert "in 2 process(es)" in launch.stdout
    one = train(tmp_path, f"checkpoint.dir={url}", "mesh.tp=2")
    assert f"resumed from {url}/8 (step 8, saved on dp=8 tp=1)" in one.stdout
    assert "tensor parallelism changed: tp 1 -> 2" in one.stdout
    resumed = losses(tmp_path)
    np.testing.assert_allclose([resumed[s] for s in range(1, 17)], [reference[s] for s in range(1, 17)], rtol=2e-5)


def test_prepare_into_gs_then_train_from_it_with_the_compilation_cache_there(gcs, tmp_path):
    docs = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 60))}) + "\n" for _ in range(400)))
    flags = ["--source", f"jsonl:{docs}", "--seq-len", "32", "--vocab-size", "300", "--samples-per-shard", "100"]
    zerolm("prepare", *flags, "--out", f"{gcs.url}/ds")
    zerolm("prepare", *flags, "--out", tmp_path / "local")
    assert not (REPO / "gs:").exists()  # not a local directory named after the URL
    manifest = json.loads((tmp_path / "local" / "manifest.json").read_text())
    shards = [s["name"] for split in manifest["splits"].values() for s in split["shards"]]
    objects = gcs.objects("ds/")
    build = {n.split("/")[1] for n in objects if n != "ds/manifest.json"}
    assert len(build) == 1 and build.pop().startswith("build-")  # one build's prefix, then the manifest
    import urllib.parse

    for name in shards:  # the same bytes as the local prepare of the same source
        remote = next(n for n in objects if n.endswith("/" + name))
        data = gcs.server.read(f"/download/storage/v1/b/{gcs.name}/o/{urllib.parse.quote(remote, safe='')}?alt=media")
        assert data == (tmp_path / "local" / name).read_bytes(), name

    cache = f"{gcs.url}/xla"
    runs_ = [train(tmp_path, f"data.dataset={gcs.url}/ds", "model.seq_len=32", f"train.compilation_cache={cache}",
                   f"checkpoint.dir={gcs.url}/run{i}", "train.eval_sequences=8", steps=4) for i in range(2)]
    assert f"data: {gcs.url}/ds: " in runs_[0].stdout
    assert "loaded from the compilation cache" not in runs_[0].stdout
    assert f"program(s) loaded from the compilation cache {cache}" in runs_[1].stdout
    assert any(name.startswith("xla/jit_grad_step") for name in gcs.objects("xla/"))
    for proc in runs_:
        quiet(proc)


def test_prepare_over_a_gs_dataset_replaces_it_only_when_the_new_one_is_complete(gcs, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(300)))
    flags = ["--source", f"jsonl:{docs}", "--vocab-size", "300", "--samples-per-shard", "50"]
    zerolm("prepare", *flags, "--seq-len", "32", "--out", f"{gcs.url}/ds")
    before = gcs.objects("ds/")
    err = zerolm("prepare", *flags, "--seq-len", "16", "--out", f"{gcs.url}/ds", expect=EXIT_USAGE).stderr
    assert err.strip() == f"error: {gcs.url}/ds: already holds a prepared dataset; pass --overwrite to replace it"
    assert gcs.objects("ds/") == before
    zerolm("prepare", *flags, "--seq-len", "16", "--out", f"{gcs.url}/ds", "--overwrite")
    after = gcs.objects("ds/")
    assert not set(before) - {"ds/manifest.json"} & set(after)  # the old build is gone, the new one is all there
    from zerolm.data.shards import PreparedDataset

    dataset = PreparedDataset(f"{gcs.url}/ds")
    assert dataset.seq_len == 16
    dataset.split("train").verify()
    rows = dataset.split("train").read(np.arange(5))
    assert rows.shape == (5, 17)


def test_ctrl_c_of_a_prepare_into_gs_is_one_line(gcs, tmp_path):
    """Ctrl-C while shards are uploading: the interrupt's line alone, no "Exception ignored" traceback from a
    shard's tar stream flushing into an upload already abandoned, and the bucket left as it was."""
    import signal

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(40000)))
    proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{docs}", "--vocab-size",
                             "300", "--seq-len", "16", "--samples-per-shard", "200", "--workers", "1", "--out",
                             f"{gcs.url}/ds"], env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while not [n for n in gcs.objects() if n.endswith(".tar")]:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"prepare: interrupted; {gcs.url}/ds is unchanged")
    assert not gcs.objects()


def test_commands_on_a_gs_run(gs_run, tmp_path):
    bucket, url, run_dir = gs_run
    listing = zerolm("checkpoints", url).stdout
    assert "`--resume auto` would take step 16" in listing and "DAMAGED" not in listing
    evaluated = zerolm("eval", "--checkpoint", url, "--json")
    result = json.loads(evaluated.stdout)
    assert result["step"] == 16 and result["checkpoint"] == url
    quiet(evaluated)
    text = zerolm("sample", "--checkpoint", f"{url}/12", "--prompt", "And God", "--max-new-tokens", "8",
                  "--temperature", "0").stdout
    assert text.startswith("And God")
    out = zerolm("export-hf", "--checkpoint", url, "--out", f"{bucket.url}/hf").stdout
    assert f"exported step 16 of {url} to {bucket.url}/hf" in out
    assert "from_pretrained('LOCAL_DIR') after copying it to a local directory" in out  # transformers reads no gs://
    assert set(bucket.objects("hf/")) == {f"hf/{n}" for n in ("config.json", "generation_config.json",
                                                                "model.safetensors", "tokenizer.json",
                                                                "tokenizer_config.json")}
    err = zerolm("export-hf", "--checkpoint", url, "--out", f"{bucket.url}/hf", expect=EXIT_USAGE).stderr
    assert err.strip() == f"error: --out: {bucket.url}/hf already exists (pass --overwrite to replace it)"


def test_a_branch_of_a_gs_checkpoint_continues_it_exactly_and_writes_nothing_there(gs_run, reference, tmp_path):
    """train.branch_from a step on gs://, into local directories of the branch's own: the run's steps 9..16 again,
    bit for bit (the same schedule: a branch that changes nothing is the run itself); the bucket as it was."""
    bucket, url, _ = gs_run
    before = bucket.objects()
    proc = train(tmp_path, f"train.branch_from={url}/8")
    assert f"branched from {url}/8 (train.branch_from: step 8 of the run tiny" in proc.stdout
    assert losses(tmp_path) == {step: reference[step] for step in range(9, 17)}
    assert bucket.objects() == before
    quiet(proc)


@pytest.mark.parametrize("case", ["no bucket", "invalid bucket", "missing bucket", "no permission", "unreachable"])
def test_a_bad_gs_location_is_one_line_before_any_work(case, gcs, tmp_path):
    proxy = None
    extra_env = {}
    location = {"no bucket": "gs:///run", "invalid bucket": "gs://Not_A_Bucket/run",
                "missing bucket": "gs://no-such-bucket-here/run"}.get(case, f"{gcs.url}/run")
    if case == "no permission":
        proxy = FaultyProxy(gcs.server.port, forbid=True)
        extra_env = environment(proxy.url)
    if case == "unreachable":
        extra_env = environment(f"http://127.0.0.1:{_closed_port()}")
    cmd = command(tmp_path, f"checkpoint.dir={location}")
    start = time.time()
    proc = subprocess.run(cmd, env={**env(), **extra_env}, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proxy is not None:
        proxy.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_USAGE and len(lines) == 1, proc.stderr[-2000:]
    expected = {"no bucket": "no bucket in the URL (expected gs://BUCKET/PATH)",
                "invalid bucket": "'Not_A_Bucket' is not a valid bucket name",
                "missing bucket": "bucket no-such-bucket-here does not exist",
                "no permission": f"no permission to list bucket {gcs.name} (HTTP 403",
                "unreachable": "cannot reach the storage endpoint http://127.0.0.1:"}[case]
    assert lines[0].startswith(f"error: checkpoint.dir: {location}: ") and expected in lines[0], lines[0]
    assert time.time() - start < 60
    assert not (tmp_path / "log").exists() and not gcs.objects()  # nothing written, here or there


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_location_that_must_be_local_says_so():
    proc = zerolm("train", "--config", TINY, "--set", "logging.dir=gs://bucket/logs", expect=EXIT_USAGE)
    assert proc.stderr.strip().startswith("error: logging.dir: gs://bucket/logs: must be a local path (metrics.jsonl "
                                          "is appended every step")
    assert not (REPO / "gs:").exists()


def _race(n: int, attempt) -> tuple[list, list]:
    barrier = threading.Barrier(n)
    won, refused = [], []

    def one():
        barrier.wait()
        try:
            won.append(attempt())
        except LockHeld as e:
            refused.append(str(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused


def test_lease_races_have_exactly_one_winner(gcs):
    url = f"{gcs.url}/run"
    for _ in range(5):
        won, refused = _race(8, lambda: RunLock.acquire(url, heartbeat_s=60))
        assert len(won) == 1 and len(refused) == 7, refused
        assert all("in use by another run (host " in r for r in refused)
        won[0].release()
        assert not gcs.objects(f"run/{LEASE_FILE}")
    # A stale lease (a dead run on another host) found by eight runs at once: exactly one takes it over.
    stale = {"host": "other-host", "pid": 1, "since": "then", "heartbeat": time.time() - 3600, "token": "dead"}
    for _ in range(3):
        lease = storage.Versioned(f"{url}/{LEASE_FILE}")
        assert lease.write(json.dumps(stale).encode(), 0) is not None
        won, refused = _race(8, lambda: RunLock.acquire(url, heartbeat_s=60))
        assert len(won) == 1 and len(refused) == 7 and won[0].taken_over["host"] == "other-host"
        won[0].release()


HOLDER = """
import socket, sys, time
host = sys.argv[2]
if host != "-":
    socket.gethostname = lambda: host
from zerolm.checkpoint.run_lock import RunLock
RunLock.acquire(sys.argv[1], heartbeat_s=0.2, stale_after_s=2)
print("held", flush=True)
time.sleep(600)
"""


def _holder(url: str, host: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, url, host], env=env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_killed_holder_is_taken_over_once_stale_and_a_live_one_never(gcs):
    url = f"{gcs.url}/run"
    holder = _holder(url, "worker-7")  # as if on another host: only staleness tells it is dead
    try:
        deadline = time.time() + 5  # 2.5 staleness periods: a live holder renews its lease all along
        while time.time() < deadline:
            with pytest.raises(LockHeld, match=r"in use by another run \(host worker-7, "):
                RunLock.acquire(url, stale_after_s=2)
            time.sleep(0.2)
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(LockHeld, match="lease renewed 0 s ago"):
        RunLock.acquire(url, stale_after_s=2)
    time.sleep(2.2)
    lock = RunLock.acquire(url, stale_after_s=2)
    assert lock.taken_over["host"] == "worker-7" and lock.taken_over["pid"] == holder.pid
    lock.release()

    here = _holder(url, "-")  # on this host: once its process is gone, its lease is taken over at once
    here.kill()
    here.wait()
    lock = RunLock.acquire(url, stale_after_s=60)
    assert lock.taken_over["pid"] == here.pid
    lock.release()


def _faults_injected(bucket, run_dir):
    """A run to gs:// through a proxy that answers every 25th request with a 503 or drops it: (the
    process, the faults injected)."""
    proxy = FaultyProxy(bucket.server.port, every=25, start=5)
    try:
        proc = subprocess.run(command(run_dir, f"checkpoint.dir={bucket.url}/run"), env=environment(proxy.url),
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        proxy.close()
    return proc, proxy.faults, proxy.requests


def _committed(server) -> list[int]:
    return [int(n.split("/")[1]) for n in server.objects("bucket", "run/")
            if n.endswith("/commit_success.txt") and n.count("/") == 2]


def _storage_stopped(run_dir):
    """A long run checkpointing every 5 steps to a GCS server of its own, which is stopped once the first
    checkpoint is committed: (the server, stopped, the run's URL, the process, its stderr, the seconds
    from the stop to the process's exit)."""
    server = GCSServer(run_dir / "gcs").start()
    url = server.make_bucket("bucket") + "/run"
    proc = subprocess.Popen(command(run_dir, f"checkpoint.dir={url}", "train.schedule_steps=2000",
                                    "checkpoint.every=5", steps=2000), env={**env(), **server.env()}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not _committed(server):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        server.stop()
        stopped = time.time()
        _, err = proc.communicate(timeout=300)
        return server, url, proc, err, time.time() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


class Background:
    """`scenario(*args)` run in a thread; `result()` joins it, and raises what failed in it."""

    def __init__(self, scenario, *args):
        self.value, self.error = None, None

        def run():
            try:
                self.value = scenario(*args)
            except BaseException as e:  # an assertion too: raised again in the test
                self.error = e

        self.thread = threading.Thread(target=run, name=scenario.__name__, daemon=True)
        self.thread.start()

    def result(self):
        self.thread.join(timeout=600)
        assert not self.thread.is_alive(), "the scenario did not finish in 10 minutes"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    """The module's two runs that spend most of their time waiting on the storage clients' retries (faults
    injected; a server stopped, tens of seconds of backing off before the run gives up) start with the
    module, in threads, so that the waiting overlaps the tests before theirs; each of those tests checks
    what its run did. Only the selected ones start."""
    selected = {item.originalname for item in request.session.items if item.path == request.path}
    started = {}
    if "test_injected_503s_and_dropped_connections_are_retried" in selected:
        request.getfixturevalue("reference")  # the data prepared and the step compiled before, by one run
        bucket = Bucket(request.getfixturevalue("gcs_server"), f"zerolm-{uuid.uuid4().hex[:12]}")
        run_dir = tmp_path_factory.mktemp("faults")
        started["faults"] = bucket, run_dir, Background(_faults_injected, bucket, run_dir)
    if "test_storage_stopped_mid_run_stops_it_in_bounded_time_and_it_resumes" in selected:
        run_dir = tmp_path_factory.mktemp("stopped")
        started["stopped"] = run_dir, Background(_storage_stopped, run_dir)
    return started


def test_injected_503s_and_dropped_connections_are_retried(background, reference):
    bucket, run_dir, scenario = background["faults"]
    proc, faults, requests = scenario.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert faults["503"] >= 3 and faults["drop"] >= 3, (faults, requests)
    assert losses(run_dir) == reference
    assert "Traceback" not in proc.stdout + proc.stderr
    assert {n.split("/")[1] for n in bucket.objects("run/") if n.endswith("/commit_success.txt")} == {"8", "12", "16"}


def test_storage_stopped_mid_run_stops_it_in_bounded_time_and_it_resumes(background):
    run_dir, scenario = background["stopped"]
    server, url, proc, err, stopping_s = scenario.result()
    try:
        assert proc.returncode == EXIT_STORAGE, err[-3000:]
        assert stopping_s < 120
        assert "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: {url}") and "stays the latest" in last, last

        server.start()  # the same objects, the same address
        latest = max(_committed(server))
        steps = {n.split("/")[1] for n in server.objects("bucket", "run/") if n.count("/") >= 2}
        unfinished = sorted(steps - {str(c) for c in _committed(server)}, key=int)  # saves cut short, if any
        listing = zerolm("checkpoints", url, **server.env()).stdout
        assert f"`--resume auto` would take step {latest}" in listing and "DAMAGED" not in listing
        proc = train(run_dir, f"checkpoint.dir={url}", "train.schedule_steps=2000", "checkpoint.every=5",
                     steps=latest + 3, extra_env=server.env())
    finally:
        server.stop()
    assert f"resumed from {url}/{latest} " in proc.stdout
    assert sorted(losses(run_dir))[-1] == latest + 3
    if unfinished:  # never taken, and removed by the run that took the lease
        assert f"checkpoints: removed {len(unfinished)} unfinished save(s) of an earlier run that died while " \
               f"saving: {', '.join(unfinished)}" in proc.stdout
