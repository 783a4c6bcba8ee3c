"""`zerolm prepare --part I/N`: a corpus prepared by N processes ("hosts") into one dataset, the one a
single prepare makes, byte for byte; a part killed and run again, or run twice, loses and duplicates
nothing; parts with other settings stop in one line."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO
from test_sources import _hashes
from zerolm.core.exitcodes import EXIT_USAGE
from zerolm.data.shards import PreparedDataset

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
FLAGS = ["--seq-len", "32", "--vocab-size", "300", "--samples-per-shard", "64", "--unit-mb", "1", "--workers", "1"]


def _corpus(tmp_path, files=5, docs=1500):
    """`files` jsonl files of about 0.6 MiB: with --unit-mb 1, units of two files (0-1, 2-3, 4)."""
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(files):
        lines = (json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(20, 140))))}) for _ in range(docs))
        (d / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    return f"jsonl:{d}/*.jsonl"


def _prepare(*args, expect=0, **popen):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "prepare", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=300, **popen)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _start(*args):
    return subprocess.Popen([sys.executable, "-m", "zerolm.cli", "prepare", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def _same_dataset(single, parted):
    """Every file of the single prepare, at the same path under the parts' directory; the same samples."""
    ours = _hashes(parted / "parts-of-2")
    theirs = _hashes(single)
    manifest = theirs.pop("manifest.json")
    assert {k: v for k, v in ours.items() if k not in ("settings.json",)} == theirs
    a, b = PreparedDataset(single), PreparedDataset(parted)
    for split in ("train", "val"):
        n = len(a.split(split))
        assert n == len(b.split(split)) > 0
        np.testing.assert_array_equal(a.split(split).read(np.arange(n)), b.split(split).read(np.arange(n)))
    assert manifest


@pytest.mark.slow
def test_two_parts_at_once_make_the_dataset_of_one_prepare(tmp_path):
    source = _corpus(tmp_path)
    single = _prepare("--source", source, "--out", tmp_path / "single", *FLAGS)
    assert json.loads((tmp_path / "single" / "manifest.json").read_text())["units"] == ["unit-00000", "unit-00001",
                                                                                       "unit-00002"]
    assert single.stdout.startswith(f"prepared {tmp_path / 'single'}: train ")
    out = tmp_path / "parted"
    procs = [_start("--source", source, "--out", out, *FLAGS, "--part", f"{i}/2") for i in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    published = [o for o, _ in outs if "published it" in o]
    assert len(published) == 1, outs  # the part that completed the last unit, exactly one
    _same_dataset(tmp_path / "single", out)
    assert not (out / "parts-of-2" / "finalize.lock").exists()


@pytest.mark.slow
def test_a_part_killed_then_run_again_or_run_twice_loses_and_duplicates_nothing(tmp_path):
    source = _corpus(tmp_path)
    _prepare("--source", source, "--out", tmp_path / "single", *FLAGS)
    out = tmp_path / "parted"
    # Part 1 packs units 0 and 2: killed once unit 0 is complete.
    proc = _start("--source", source, "--out", out, *FLAGS, "--part", "1/2")
    record = out / "parts-of-2" / "unit-00000" / "unit.json"
    deadline = time.time() + 120
    while not record.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    first = record.stat().st_mtime_ns
    again = _prepare("--source", source, "--out", out, *FLAGS, "--part", "1/2")
    assert record.stat().st_mtime_ns == first  # complete: not packed again
    assert again.stdout.strip() == f"prepared part 1/2 of {out}; 1 unit(s) still to pack by other parts: unit 1 " \
                                   "(the part that packs the last of them publishes the dataset)"
    last = _prepare("--source", source, "--out", out, *FLAGS, "--part", "2/2")
    assert "(part 2/2 published it)" in last.stdout
    _same_dataset(tmp_path / "single", out)
    before = _hashes(out)
    twice = _prepare("--source", source, "--out", out, *FLAGS, "--part", "2/2")  # after it was published
    assert "(already published by an earlier run of a part: nothing changed)" in twice.stdout and _hashes(out) == before


def test_parts_with_other_settings_or_out_of_range_stop_in_one_line(tmp_path):
    source = _corpus(tmp_path, files=3)  # two units: part 1 of 2 does not publish
    out = tmp_path / "parted"
    _prepare("--source", source, "--out", out, *FLAGS, "--part", "1/2")
    err = _prepare("--source", source, "--out", out, *FLAGS, "--seq-len", "16", "--part", "2/2", expect=EXIT_USAGE).stderr
    assert err.strip() == (f"error: {out}/parts-of-2/settings.json: the parts already there were prepared with seq_len "
                           f"= 32, this one with 16; every part takes the same source and settings (or remove "
                           f"{out}/parts-of-2 to start again)")
    err = _prepare("--source", source, "--out", out, *FLAGS, "--part", "0/2", expect=EXIT_USAGE).stderr
    assert err.strip().splitlines() == ["error: zerolm prepare: argument --part: '0/2': expected I/N with 1 <= I <= N, "
                                        "e.g. 1/4 (see zerolm prepare --help)"]
    err = _prepare("--source", "default", "--out", tmp_path / "d", "--part", "1/2", expect=EXIT_USAGE).stderr
    assert err.strip() == "error: --part: default has no files to share among parts; prepare it in one part"


@pytest.mark.slow
def test_two_parts_into_gs_train_like_one_prepare_here(gcs, tmp_path):
    """The TPU VM case: two processes prepare into one gs:// dataset, which trains."""
    source = _corpus(tmp_path, files=3)
    _prepare("--source", source, "--out", tmp_path / "single", *FLAGS)
    url = f"{gcs.url}/ds"
    procs = [_start("--source", source, "--out", url, *FLAGS, "--part", f"{i}/2") for i in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    a, b = PreparedDataset(tmp_path / "single"), PreparedDataset(url)
    n = len(a.split("train"))
    np.testing.assert_array_equal(a.split("train").read(np.arange(n)), b.split("train").read(np.arange(n)))
    assert b.manifest.units == ("parts-of-2/unit-00000", "parts-of-2/unit-00001")
    train = subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
                            "--set", f"data.dataset={url}", "--set", "model.seq_len=32", "--set", "train.steps=2",
                            "--set", "train.warmup_steps=1",
                            "--set", "model.vocab_size=auto", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
                            "--set", f"logging.dir={tmp_path / 'log'}", "--set", "sample.tokens=0"],
                           capture_output=True, text=True, cwd=REPO, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
