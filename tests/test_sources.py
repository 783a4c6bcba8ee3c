"""prepare's sources at real-corpus formats (parquet, .jsonl.gz, .jsonl.zst, .txt.gz; local and gs://),
its bounded BPE sample and its worker processes: the same corpus in any format, and with any number of
workers, gives the same bytes."""

import gzip
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import REPO
from zerolm.core.exitcodes import EXIT_USAGE
from zerolm.data import prepare as prep
from zerolm.data import sources
from zerolm.data.sources import SourceError

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(5, 120)))) for _ in range(n)]


def _corpus(tmp_path, files=3, per_file=150):
    """The same documents as jsonl, jsonl.gz, jsonl.zst and parquet (another column beside the text)."""
    formats = {k: tmp_path / k for k in ("jsonl", "gz", "zst", "parquet")}
    for d in formats.values():
        d.mkdir()
    for i in range(files):
        docs = _texts(per_file, seed=i)
        lines = "".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(docs)).encode()
        (formats["jsonl"] / f"part-{i}.jsonl").write_bytes(lines)
        (formats["gz"] / f"part-{i}.jsonl.gz").write_bytes(gzip.compress(lines))
        (formats["zst"] / f"part-{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
        pq.write_table(pa.table({"id": list(range(per_file)), "content": docs}), formats["parquet"] / f"part-{i}.parquet",
                       row_group_size=64)
    return formats


def _hashes(directory):
    """sha256 of every file of a prepared dataset, by path; the manifest and the units' records without
    their timing and the source's name."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_dir():
            continue
        data = p.read_bytes()
        if p.name in ("manifest.json", "unit.json"):
            m = json.loads(data)
            for key in ("seconds", "source", "files"):
                m.pop(key, None)
            data = json.dumps(m, sort_keys=True).encode()
        out[str(p.relative_to(directory))] = hashlib.sha256(data).hexdigest()
    return out


def test_every_format_gives_the_same_dataset(tmp_path):
    """jsonl, .jsonl.gz, .jsonl.zst and parquet (its `content` column) of the same documents: the same shards,
    tokenizer and manifest, byte for byte (the default BPE included: its sample is the same documents)."""
    formats = _corpus(tmp_path)
    got = {}
    for kind, pattern, field in [("jsonl", "jsonl/*.jsonl", "text"), ("gz", "gz/*.jsonl.gz", "text"),
                                 ("zst", "zst/*.jsonl.zst", "text"), ("parquet", "parquet/*.parquet", "content")]:
        spec = f"{'parquet' if kind == 'parquet' else 'jsonl'}:{tmp_path / pattern}"
        m = prep.prepare(spec, tmp_path / f"out-{kind}", seq_len=32, vocab_size=300, samples_per_shard=100,
                         text_field=field, progress=False)
        assert m.documents == 450
        got[kind] = _hashes(tmp_path / f"out-{kind}")
    assert got["gz"] == got["jsonl"] == got["zst"] == got["parquet"]
    assert len([n for n in got["jsonl"] if n.startswith("unit-00000/train-")]) > 3
    assert formats  # the corpus stays for the eye of whoever debugs this


def test_text_files_compressed_or_not_are_one_document_each(tmp_path):
    for i, text in enumerate(_texts(4, seed=7)):
        (tmp_path / f"{i}.txt").write_text(text * 20)
        (tmp_path / f"{i}.txt.gz").write_bytes(gzip.compress((text * 20).encode()))
    plain = list(sources.iter_documents(f"text:{tmp_path}/*.txt"))
    assert plain == list(sources.iter_documents(f"text:{tmp_path}/*.txt.gz")) and len(plain) == 4


def test_workers_give_the_same_bytes_as_one_process(tmp_path):
    """--workers 1 (this process) and 2 (two spawned processes): every shard hashes the same."""
    _corpus(tmp_path, files=2, per_file=400)
    spec = f"jsonl:{tmp_path}/zst/*.jsonl.zst"
    one = prep.prepare(spec, tmp_path / "one", seq_len=32, vocab_size=300, samples_per_shard=64, progress=False)
    two = prep.prepare(spec, tmp_path / "two", seq_len=32, vocab_size=300, samples_per_shard=64, progress=False,
                       workers=2)
    assert one.splits["train"].samples == two.splits["train"].samples > 200
    assert _hashes(tmp_path / "one") == _hashes(tmp_path / "two")


def test_bad_records_in_workers_stop_at_the_first_or_are_counted(tmp_path):
    """A bad record found by a worker process is reported as in one process: file and line, the first one."""
    good = "".join(json.dumps({"text": t}) + "\n" for t in _texts(300))
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress((good + "{oops\n" + good + '{"text": 5}\n').encode()))
    with pytest.raises(SourceError, match=rf"^{path}:301: not valid JSON"):
        prep.prepare(f"jsonl:{path}", tmp_path / "o", seq_len=32, vocab_size=300, progress=False, workers=2)
    m = prep.prepare(f"jsonl:{path}", tmp_path / "o", seq_len=32, vocab_size=300, progress=False, workers=2,
                     skip_bad=True)
    assert (m.skipped, m.skipped_first, m.documents) == (2, f"{path}:301: not valid JSON (Expecting property name "
                                                            "enclosed in double quotes, column 2)", 600)
    assert not list(tmp_path.glob(".o.partial-*"))


def test_bpe_sample_is_bounded_spread_over_files_and_leaves_validation_out(tmp_path):
    _corpus(tmp_path, files=3, per_file=150)
    spec = f"jsonl:{tmp_path}/jsonl/*.jsonl"
    budget = 3000
    sample = prep.bpe_sample(spec, budget, val_every=5)
    per_file = [_texts(150, seed=i) for i in range(3)]
    expected = []
    for docs in per_file:  # the first training documents of each file, up to a third of the budget each
        taken = 0
        for index, doc in enumerate(docs):
            if index % 5 != 4:
                expected.append(doc)
                taken += len(doc)
                if taken >= budget // 3:
                    break
    assert sample == expected and sum(map(len, sample)) < budget + 3 * 700
    assert prep.bpe_sample(spec, 10**9, val_every=5) == [d for docs in per_file for i, d in enumerate(docs) if i % 5 != 4]


def test_prepare_trains_the_bpe_on_the_bounded_sample(tmp_path, monkeypatch):
    """Past the budget (--bpe-sample-mb 1 against 1.6 MiB of text in 3 files) the BPE gets each file's first
    training documents up to a third of a MiB, not the corpus; under it (the default 100), all of them."""
    d = tmp_path / "big"
    d.mkdir()
    per_file = [_texts(2400, seed=i) for i in range(3)]  # about 0.55 MiB of text each
    for i, docs in enumerate(per_file):
        (d / f"{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    trained_on = []
    real = prep.load_tokenizer
    monkeypatch.setattr(prep, "load_tokenizer", lambda spec, vocab=2048, texts=(): (trained_on.append(list(texts)),
                                                                                    real(spec, vocab, texts))[1])
    for budget in (1, 100):
        prep.prepare(f"jsonl:{d}/*.jsonl", tmp_path / f"out-{budget}", seq_len=32, vocab_size=300, progress=False,
                     bpe_sample_mb=budget)
    bounded, whole = trained_on
    assert bounded == prep.bpe_sample(f"jsonl:{d}/*.jsonl", 2**20, val_every=50)
    assert 2**20 <= sum(map(len, bounded)) < 2**20 + 3 * 1000
    assert whole == [t for docs in per_file for i, t in enumerate(docs) if i % 50 != 49]
    assert sum(map(len, whole)) > 1.5 * 2**20


def _cli(*args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "prepare", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def test_bad_input_is_one_line_and_loses_nothing(tmp_path):
    formats = _corpus(tmp_path, files=1, per_file=50)
    out = tmp_path / "ds"
    flags = ["--seq-len", "16", "--vocab-size", "300", "--workers", "1"]
    _cli("--source", f"jsonl:{formats['jsonl']}/*.jsonl", "--out", out, *flags)
    before = _hashes(out)
    parquet = formats["parquet"] / "part-0.parquet"
    corrupt = tmp_path / "bad.jsonl.zst"
    whole = zstandard.ZstdCompressor().compress((formats["jsonl"] / "part-0.jsonl").read_bytes())
    corrupt.write_bytes(whole[: len(whole) // 2])  # a download cut short
    notparquet = tmp_path / "x.parquet"
    notparquet.write_text("not parquet")
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a b c " * 50, None]}), nulls)
    cases = [
        (["--source", f"parquet:{parquet}"],
         f"error: {parquet}: no column 'text' (it has id, content); name the text column with --text-field"),
        (["--source", f"jsonl:{corrupt}"], f"error: {corrupt}: corrupt zstd data"),
        (["--source", f"parquet:{notparquet}"], f"error: {notparquet}: not a readable parquet file ("),
        (["--source", f"parquet:{nulls}"], f"error: {nulls}: row 1: column 'text' is null, not a string"),
        (["--source", f"parquet:{parquet}", "--text-field", "content", "--workers", "0"],
         "error: --workers: must be a positive integer, got 0"),
    ]
    for args, message in cases:
        err = _cli(*flags, "--out", out, "--overwrite", *args, expect=EXIT_USAGE).stderr
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert _hashes(out) == before and not list(tmp_path.glob(".ds.partial-*"))


@pytest.mark.slow
def test_a_zst_corpus_on_gs_prepares_like_the_same_files_here(gcs, tmp_path):
    """jsonl:gs://BUCKET/web/*.jsonl.zst read through the storage layer: the dataset of the local copy."""
    formats = _corpus(tmp_path, files=2, per_file=120)
    from zerolm.core import storage

    for p in sorted(formats["zst"].iterdir()):
        storage.write_atomic(storage.path(f"{gcs.url}/web/{p.name}"), p.read_bytes())
    storage.write_atomic(storage.path(f"{gcs.url}/web/README"), b"not a match")
    flags = ["--seq-len", "32", "--vocab-size", "300", "--samples-per-shard", "100"]
    _cli("--source", f"jsonl:{gcs.url}/web/*.jsonl.zst", "--out", tmp_path / "remote", *flags)
    _cli("--source", f"jsonl:{formats['zst']}/*.jsonl.zst", "--out", tmp_path / "local", *flags)
    assert _hashes(tmp_path / "remote") == _hashes(tmp_path / "local")
    err = _cli("--source", f"jsonl:{gcs.url}/none/*.zst", "--out", tmp_path / "x", *flags, expect=EXIT_USAGE).stderr
    assert err.strip() == f"error: jsonl:{gcs.url}/none/*.zst: no files match '{gcs.url}/none/*.zst'"


def _descendants(pid: int) -> set[int]:
    """The live processes below `pid` (read from /proc)."""
    from pathlib import Path

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_kill_9_of_prepare_leaves_no_worker_behind(tmp_path):
    """prepare --workers 2 killed with kill -9: its spawned workers (and multiprocessing's resource tracker,
    which they hold open) are gone within seconds, not left running with parent 1."""
    import signal
    import time

    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(60000)))
    proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{docs}", "--out",
                             str(tmp_path / "ds"), "--seq-len", "16", "--vocab-size", "300", "--workers", "2",
                             "--unit-mb", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 120
    # The tracker and two workers, at work: a unit's first shard is being written.
    while len(children := _descendants(proc.pid)) < 3 or not list(tmp_path.glob(".ds.partial-*/unit-*/*.tar")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while any(map(_alive, children)) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)], "prepare's workers outlived it"


def test_prepare_says_what_it_does_and_how_far_it_is(tmp_path):
    """The tokenizer's training is announced (it took 18 s of a silent bar on 81 MB), and the bar counts the
    source's bytes against its total: a percentage and an ETA, tokens beside."""
    import os
    import pty

    docs = tmp_path / "d.jsonl.gz"
    docs.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in _texts(3000)).encode()))
    import fcntl
    import struct
    import termios

    terminal, tty = pty.openpty()  # stderr on a terminal (120 columns), as a person running it sees it
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{docs}", "--out",
                             str(tmp_path / "ds"), "--seq-len", "16", "--vocab-size", "300", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=tty, text=True, cwd=REPO)
    os.close(tty)
    seen = b""
    while True:
        try:
            data = os.read(terminal, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not data:
            break
        seen += data
    assert proc.wait(timeout=300) == 0, seen.decode()[-2000:]
    stdout = proc.stdout.read()
    os.close(terminal)
    stderr = seen.decode().replace("\r\n", "\n")
    assert stderr.startswith("prepare: training the tokenizer (byte-level BPE, 300 tokens) on up to 100 MiB "
                                  "of the source's text\nprepare: tokenizer ready (")
    assert stdout.startswith(f"prepared {tmp_path / 'ds'}: train ")  # the result's line alone
    final = stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert re.fullmatch(r"prepare: 100%\|█+\| (\d+k)/\1 \[\S+, \S+B/s, [\d,]+ tokens\]", final), final
    assert abs(int(final.split("| ")[1].split("k/")[0]) - docs.stat().st_size / 1024) <= 1  # its bytes as stored
