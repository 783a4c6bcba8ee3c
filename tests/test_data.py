"""prepare -> shards -> loader: formats, determinism, coverage, resume, and every bad input's message."""

import base64
import io
import json
import shutil

import jax
import numpy as np
import pytest
import webdataset as wds

from conftest import requires_devices, small_config
from zerolm.data import packing
from zerolm.data import prepare as prep
from zerolm.data.loader import BatchLoader
from zerolm.data.manifest import FORMAT
from zerolm.data.order import GlobalOrder, ShardOrder, sample_order
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.data.sources import SourceError
from zerolm.parallel.mesh import make_mesh
from zerolm.train.trainer import train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()


def _texts(n, seed=0, length=60):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, length)) for _ in range(n)]


@pytest.fixture(scope="module")
def kjv(tmp_path_factory):
    """The default corpus prepared once for the module: seq_len 64, small shards."""
    out = tmp_path_factory.mktemp("data") / "kjv"
    prep.prepare("default", out, seq_len=64, samples_per_shard=2000, progress=False)
    return out


def test_prepare_default_writes_shards_manifest_and_tokenizer(kjv):
    m = json.loads((kjv / "manifest.json").read_text())
    assert m["format"] == FORMAT and m["seq_len"] == 64 and m["dtype"] == "uint16"
    assert m["tokenizer"]["vocab_size"] == 2048 and (kjv / "tokenizer.json").exists()
    train = m["splits"]["train"]
    assert len(train["shards"]) > 3 and sum(s["samples"] for s in train["shards"]) == train["samples"]
    assert m["splits"]["val"]["samples"] > 0 and 5.0 < train["unigram_entropy"] < 7.0
    # Every member is one sample of seq_len + 1 tokens, readable by plain webdataset.
    first = next(iter(wds.WebDataset(str(kjv / train["shards"][0]["name"]), shardshuffle=False).decode()))
    assert first["__key__"] == "000000000" and first["npy"].shape == (65,) and first["npy"].dtype == np.uint16
    tok = PreparedDataset(kjv).tokenizer()
    assert tok.decode(first["npy"][:5]).startswith("In the beginning")


def test_shard_reader_matches_webdataset_locally_and_by_url(kjv):
    split = PreparedDataset(kjv).split("train")
    ids = np.array([0, 1, 1999, 2000, len(split) - 1])
    rows = split.read(ids)
    assert split.rows_read == 5
    names = [s.name for s in split.shards]
    whole = np.concatenate([np.stack([s["npy"] for s in wds.WebDataset(str(kjv / n), shardshuffle=False).decode()])
                            for n in names])
    np.testing.assert_array_equal(rows, whole[ids])
    remote = PreparedDataset(f"file://{kjv}")
    np.testing.assert_array_equal(remote.split("train").read(ids), whole[ids])
    assert remote.tokenizer().sha256 == PreparedDataset(kjv).tokenizer().sha256  # fetched into the cache


def test_text_and_jsonl_sources_and_file_tokenizers(tmp_path):
    (tmp_path / "a.txt").write_text(" ".join(_texts(1, 1, 400)))
    (tmp_path / "b.txt").write_text(" ".join(_texts(1, 2, 400)))
    text = prep.prepare(f"text:{tmp_path}/*.txt", tmp_path / "t", seq_len=16, vocab_size=300, val_every=2,
                        progress=False).to_json()
    assert text["documents"] == 2 and text["splits"]["val"]["samples"] > 0
    lines = [json.dumps({"body": t}) for t in _texts(20)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    tok_file = tmp_path / "t" / "tokenizer.json"
    js = prep.prepare(f"jsonl:{tmp_path}/*.jsonl", tmp_path / "j", text_field="body", tokenizer=str(tok_file),
                      seq_len=16, progress=False).to_json()
    assert js["documents"] == 20 and js["tokenizer"]["sha256"] == text["tokenizer"]["sha256"]
    # A tiktoken BPE file: byte-level ranks, end-of-text appended after them.
    ranks = tmp_path / "bytes.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    tk = prep.prepare(f"jsonl:{tmp_path}/*.jsonl", tmp_path / "k", text_field="body", tokenizer=str(ranks),
                      seq_len=16, progress=False).to_json()
    assert tk["tokenizer"]["kind"] == "tiktoken" and tk["tokenizer"]["eot_id"] == 256
    row = PreparedDataset(tmp_path / "k").split("train").read(np.array([0]))[0]
    assert PreparedDataset(tmp_path / "k").tokenizer().decode(row) == _texts(20)[0][:17]
    assert packing.token_dtype(50257) == np.uint16 and packing.token_dtype(100_000) == np.uint32


@pytest.mark.slow
def test_tfds_source_built_offline(tmp_path):
    import tensorflow_datasets as tfds

    texts = _texts(40, seed=3)

    class ZerolmTinyText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, t in enumerate(texts):
                yield i, {"text": t}

    ZerolmTinyText(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    m = prep.prepare("tfds:zerolm_tiny_text", tmp_path / "ds", tfds_data_dir=str(tmp_path / "tfds"),
                     seq_len=16, vocab_size=300, val_every=10, progress=False).to_json()
    assert m["documents"] == 40 and m["splits"]["train"]["samples"] > 10
    summary = train(small_config(f"data.dataset={tmp_path / 'ds'}", "model.vocab_size=auto", "train.steps=3",
                               "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=2",
                               f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                               "sample.tokens=0"), out=io.StringIO())
    assert np.isfinite(summary["loss"]) and np.isfinite(summary["val_loss"])
    with pytest.raises(SourceError, match=r"^tfds:no_such_dataset: cannot open from "):
        prep.prepare("tfds:no_such_dataset", tmp_path / "x", tfds_data_dir=str(tmp_path / "tfds"), progress=False)


def test_prepare_refuses_to_overwrite_and_survives_a_kill(tmp_path, monkeypatch, kjv):
    out = tmp_path / "ds"
    shutil.copytree(kjv, out)
    before = _files(out)
    with pytest.raises(prep.PrepareError, match=rf"^{out}: already holds a prepared dataset; pass --overwrite"):
        prep.prepare("default", out, seq_len=64, progress=False)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for a kill half way through writing shards

    monkeypatch.setattr(packing.ShardWriter, "close", killed)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare("default", out, seq_len=32, overwrite=True, progress=False)
    assert _files(out) == before  # the old dataset is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no half-written directory left behind
    monkeypatch.undo()
    prep.prepare("default", out, seq_len=32, overwrite=True, progress=False)
    assert PreparedDataset(out).seq_len == 32


def test_bad_sources(tmp_path):
    with pytest.raises(SourceError, match=r"^text:.*: no files match"):
        prep.prepare(f"text:{tmp_path}/none/*.txt", tmp_path / "o", progress=False)
    (tmp_path / "empty.txt").write_text("hi")
    with pytest.raises(prep.PrepareError, match=rf"^text:.*: too little text for one training sample of seq_len \+ 1 = "
                                                rf"2049 tokens \(1 document\(s\) in {tmp_path / 'empty.txt'}\)"):
        prep.prepare(f"text:{tmp_path}/*.txt", tmp_path / "o", tokenizer=str(_tokenizer(tmp_path)), progress=False)
    (tmp_path / "none.jsonl").write_text("")
    with pytest.raises(prep.PrepareError, match=rf"^jsonl:.*: empty source: no document with text in "
                                                rf"{tmp_path / 'none.jsonl'}$"):
        prep.prepare(f"jsonl:{tmp_path}/none.jsonl", tmp_path / "o", progress=False)
    number = tmp_path / "number.jsonl"
    number.write_text(json.dumps({"text": 123}) + "\n")
    with pytest.raises(SourceError, match=rf"^{number}:1: field 'text' is not a string \(got int 123\)$"):
        prep.prepare(f"jsonl:{number}", tmp_path / "o", tokenizer=str(_tokenizer(tmp_path)), progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": _texts(1)[0]}) + "\n" + json.dumps({"txt": "x"}) + "\n{oops\n")
    with pytest.raises(SourceError, match=rf"^{bad}:2: no text field 'text'$"):
        prep.prepare(f"jsonl:{bad}", tmp_path / "o", tokenizer=str(_tokenizer(tmp_path)), progress=False)
    m = prep.prepare(f"jsonl:{bad}", tmp_path / "o", tokenizer=str(_tokenizer(tmp_path)), seq_len=8,
                     skip_bad=True, val_every=1000, progress=False).to_json()
    assert m["skipped"] == 2 and m["skipped_first"] == f"{bad}:2: no text field 'text'"
    with pytest.raises(SourceError, match=r"^csv:x: unknown source"):
        prep.prepare("csv:x", tmp_path / "o2", progress=False)


def _tokenizer(tmp_path):
    path = tmp_path / "tok.json"
    if not path.exists():
        from zerolm.data.tokenizer import train_bpe

        train_bpe(_texts(20), 300).save(str(path))
    return path


def _damaged_copy(kjv, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(kjv, out)
    return out, json.loads((out / "manifest.json").read_text())


def test_missing_truncated_and_mismatched_shards(kjv, tmp_path):
    out, m = _damaged_copy(kjv, tmp_path)
    shard0, shard1 = (out / s["name"] for s in m["splits"]["train"]["shards"][:2])
    shard0.unlink()
    with pytest.raises(DataError, match=rf"^{shard0}: missing or unreadable shard"):
        PreparedDataset(out).split("train").read(np.array([0]))
    shard1.write_bytes(shard1.read_bytes()[:50_000])
    with pytest.raises(DataError, match=rf"^{shard1}: 50000 bytes, the manifest says \d+ \(truncated or replaced shard\)"):
        PreparedDataset(out).split("train").read(np.array([2000]))
    m["splits"]["train"]["shards"][2]["samples"] += 5
    del m["splits"]["train"]["shards"][2]["bytes"]
    (out / "manifest.json").write_text(json.dumps(m))
    shard2 = out / m["splits"]["train"]["shards"][2]["name"]
    with pytest.raises(DataError, match=rf"^{shard2}: does not match the manifest's 2005 samples \(sample 2004: "):
        PreparedDataset(out).split("train").read(np.array([4000]))
    with pytest.raises(DataError, match=rf"^{tmp_path}/nothing/manifest.json: no manifest"):
        PreparedDataset(tmp_path / "nothing")


def test_wrong_length_sample_is_named_or_skipped(kjv, tmp_path):
    out, m = _damaged_copy(kjv, tmp_path)
    shard = out / m["splits"]["train"]["shards"][0]["name"]
    data = bytearray(shard.read_bytes())
    probe = PreparedDataset(out).split("train")
    probe.read(np.array([0]))
    reader = probe._readers[0]
    # Rewrite sample 7's .npy header to claim a different length: the row is no longer a seq_len+1 sample.
    start = 7 * reader.stride + 512
    header = bytes(data[start: start + reader.npy_header]).replace(b"(65,)", b"(64,)")
    data[start: start + len(header)] = header
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^{shard}: sample 7 is not a uint16\[65\] .npy member"):
        PreparedDataset(out).split("train").read(np.array([6, 7]))
    lenient = PreparedDataset(out).split("train", skip_bad=True)
    rows = lenient.read(np.array([7]))
    np.testing.assert_array_equal(rows[0], PreparedDataset(kjv).split("train").read(np.array([8]))[0])
    assert lenient.bad_samples == 1


@pytest.mark.parametrize("version", [1, 2])
def test_sample_order_covers_each_epoch_once_in_new_orders(version):
    order = sample_order(np.array([5, 7, 3, 9]), seed=1, version=version)
    e0, e1 = order.ids(np.arange(24)), order.ids(np.arange(24, 48))
    assert sorted(e0) == sorted(e1) == list(range(24))
    assert list(e0) != list(e1)
    np.testing.assert_array_equal(sample_order(np.array([5, 7, 3, 9]), 1, version).ids(np.arange(48)),
                                  np.concatenate([e0, e1]))
    assert list(sample_order(np.array([5, 7, 3, 9]), 2, version).ids(np.arange(24))) != list(e0)
    if version == 1:  # the old order (checkpoints saved before version 2): a shard's samples come together
        shard_of = np.searchsorted(np.array([0, 5, 12, 15, 24]), e0, side="right") - 1
        assert (np.diff(shard_of) != 0).sum() == 3


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 63, 64, 65, 1000, 4097, 123_457])
def test_global_order_is_a_bijection_on_every_epoch(n):
    order = GlobalOrder(n, seed=5)
    for epoch in (0, 1, 7):
        ids = order.ids(np.arange(epoch * n, (epoch + 1) * n))
        assert np.array_equal(np.sort(ids), np.arange(n)), (n, epoch)
    if n >= 64:  # a fresh permutation each epoch, and another for another seed
        assert not np.array_equal(order.ids(np.arange(n)), order.ids(np.arange(n, 2 * n)))
        assert not np.array_equal(order.ids(np.arange(n)), GlobalOrder(n, seed=6).ids(np.arange(n)))


@pytest.mark.parametrize("per_shard", [1, 7, 100, 4096, 100_000])
def test_a_global_batch_spans_many_shards_whatever_the_shard_size(per_shard):
    """The order does not see shards: one batch of G = 512 draws from nearly min(G, S) shards of S, as
    G uniform draws would (S·(1 - (1 - 1/S)^G) expected), at any step; the old order drew from one."""
    n, G = 1_000_000, 512
    sizes = np.full(n // per_shard, per_shard)
    sizes[-1] += n - sizes.sum()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    S = len(sizes)
    expected = S * (1 - (1 - 1 / S) ** G)
    new, old = sample_order(sizes, 0), ShardOrder(sizes, 0)
    for step in (0, 1, 977, 1953):  # the last is in the second epoch
        positions = np.arange(step * G, (step + 1) * G)
        shards = len(np.unique(np.searchsorted(starts, new.ids(positions), side="right") - 1))
        assert shards >= 0.9 * expected, (per_shard, step, shards, expected)
        if per_shard >= G:
            assert len(np.unique(np.searchsorted(starts, old.ids(positions), side="right") - 1)) <= 2
    # the ids themselves, hence the order, are the same whatever the shard size
    assert np.array_equal(new.ids(np.arange(G)), sample_order(np.array([n]), 0).ids(np.arange(G)))


@requires_devices(8)
def test_loader_layout_resume_and_small_data(kjv):
    split = PreparedDataset(kjv).split("train")
    mesh = make_mesh(8)
    loader = BatchLoader(split, mesh, global_batch_size=32, micro_batch_size=2, seed=0)
    batch = np.asarray(loader.global_batch(5))
    assert batch.shape == (2, 16, 65)
    rows = split.read(loader.order.ids(np.arange(5 * 32, 6 * 32)))
    # device d holds rows [4d, 4d+4): micro-step a, slot j -> row 4d + 2a + j
    for d in range(8):
        for a in range(2):
            np.testing.assert_array_equal(batch[a, 2 * d: 2 * d + 2], rows[4 * d + 2 * a: 4 * d + 2 * a + 2])
    resumed = BatchLoader(split, mesh, 32, 2, seed=0).batches(start_step=5)
    np.testing.assert_array_equal(np.asarray(next(resumed)[0]), batch)
    step = int(np.random.default_rng().integers(100, 10_000))  # a random restart step, epochs later
    later = BatchLoader(split, mesh, 32, 2, seed=0).batches(start_step=step)
    np.testing.assert_array_equal(np.asarray(next(later)[0]), np.asarray(loader.global_batch(step)), err_msg=str(step))
    single = BatchLoader(split, make_mesh(1, 1, jax.devices()[:1]), 32, 4, seed=0)  # 8 accumulation steps
    np.testing.assert_array_equal(np.asarray(single.global_batch(5)).reshape(-1, 65), rows)
    with pytest.raises(DataError, match="fewer than one global batch of 1000000"):
        BatchLoader(split, mesh, 1_000_000, 125_000, seed=0)


@requires_devices(8)
def test_tp_mesh_feeds_tp0_and_sums_over_tp(kjv):
    split = PreparedDataset(kjv).split("train")
    one = np.asarray(BatchLoader(split, make_mesh(4, 1, jax.devices()[:4]), 16, 2, seed=3).global_batch(2))
    two = BatchLoader(split, make_mesh(4, 2), 16, 2, seed=3)
    np.testing.assert_array_equal(np.asarray(two.global_batch(2)), one)


def test_prepare_cli(tmp_path):
    import subprocess
    import sys

    lines = tmp_path / "d.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in _texts(30)) + "\n")
    cmd = [sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{lines}", "--out", str(tmp_path / "o"),
           "--seq-len", "16", "--vocab-size", "300"]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"prepared {tmp_path / 'o'}: train ") and "B/s" in ok.stderr and " tokens]" in ok.stderr
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2
    assert again.stderr.strip() == f"error: {tmp_path / 'o'}: already holds a prepared dataset; pass --overwrite to replace it"


def _overwrite_token(shard, reader, samples, position, value):
    """Set one token of each of `samples` (an int or a range) in a shard file, as a disk fault or a bad
    writer would."""
    data = bytearray(shard.read_bytes())
    for sample in [samples] if isinstance(samples, int) else samples:
        at = sample * reader.stride + 512 + reader.npy_header + position * reader.dtype.itemsize
        data[at: at + reader.dtype.itemsize] = np.array([value], reader.dtype).tobytes()
    shard.write_bytes(bytes(data))


def test_token_ids_outside_the_vocabulary_are_named_or_skipped(kjv, tmp_path):
    out, m = _damaged_copy(kjv, tmp_path)
    shard = out / m["splits"]["train"]["shards"][0]["name"]
    probe = PreparedDataset(out).split("train")
    probe.read(np.array([0]))
    _overwrite_token(shard, probe._readers[0], samples=5, position=10, value=60000)
    with pytest.raises(DataError, match=rf"^{shard}: sample 5 has token id 60000, outside the tokenizer's vocabulary "
                                        r"of 2048 \(corrupted data; data.skip_bad_samples: true replaces such samples\)$"):
        PreparedDataset(out).split("train").read(np.array([4, 5]))
    lenient = PreparedDataset(out).split("train", skip_bad=True)
    np.testing.assert_array_equal(lenient.read(np.array([5]))[0], PreparedDataset(kjv).split("train").read(np.array([6]))[0])
    assert lenient.bad_samples == 1


@pytest.mark.slow
def test_train_stops_on_out_of_vocabulary_tokens_with_a_data_error(kjv, tmp_path):
    import subprocess
    import sys

    from conftest import REPO, TINY

    out, m = _damaged_copy(kjv, tmp_path)
    probe = PreparedDataset(out).split("train")
    probe.read(np.array([0]))
    for shard_info in m["splits"]["train"]["shards"]:  # every sample of every shard: the first batch must hit one
        _overwrite_token(out / shard_info["name"], probe._readers[0], range(shard_info["samples"]), 3, 65535)
    before = _files(out)
    args = ["--set", f"data.dataset={out}", "--set", "model.seq_len=64", "--set", "train.steps=3",
            "--set", "model.n_layer=1", "--set", "model.d_model=32",  # the model does not matter here
            "--set", "train.warmup_steps=1", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set", f"logging.dir={tmp_path / 'log'}", "--set", "sample.tokens=0"]
    for extra in ([], ["--set", "train.skip_nonfinite=true"]):
        proc = subprocess.run([sys.executable, str(REPO / "main_zero.py"), "--config", str(TINY), *args, *extra],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {out}/unit-00000/train-") and "has token id 65535, outside the tokenizer's vocabulary" in last
    assert _files(out) == before
    assert not (tmp_path / "ckpt").exists() or not any(p.name.isdigit() for p in (tmp_path / "ckpt").iterdir())


def test_missing_or_truncated_shard_is_found_before_the_first_step(kjv, tmp_path):
    out, m = _damaged_copy(kjv, tmp_path)
    last = out / m["splits"]["train"]["shards"][-1]["name"]
    last.write_bytes(last.read_bytes()[:-4096])
    cfg = small_config(f"data.dataset={out}", "model.seq_len=64", "model.vocab_size=auto", "train.steps=3",
                       "train.warmup_steps=1", f"logging.dir={tmp_path / 'log'}", f"checkpoint.dir={tmp_path / 'c'}")
    with pytest.raises(DataError, match=rf"^{last}: \d+ bytes, the manifest says \d+ \(truncated or replaced shard\)$"):
        train(cfg, out=io.StringIO())
    last.unlink()
    with pytest.raises(DataError, match=rf"^{last}: missing or unreadable shard"):
        train(cfg, out=io.StringIO())
    assert not (tmp_path / "log").exists()  # stopped before any step


def test_one_document_source_holds_out_validation_and_trains(tmp_path):
    (tmp_path / "book.txt").write_text(" ".join(_texts(1, 4, 3000)))
    m = prep.prepare(f"text:{tmp_path}/book.txt", tmp_path / "ds", seq_len=16, vocab_size=300, progress=False).to_json()
    train_n, val_n = m["splits"]["train"]["samples"], m["splits"]["val"]["samples"]
    assert m["documents"] == 1 and val_n == max(1, (train_n + val_n) // 50)
    assert m["val_rule"].startswith(f"the last {val_n} training sample(s), since 1 document(s) are too few")
    # The held-out rows are the tail of the token stream: together the splits are the whole book, in order.
    ds = PreparedDataset(tmp_path / "ds")
    rows = np.concatenate([ds.split("train").read(np.arange(train_n)), ds.split("val").read(np.arange(val_n))])
    ref = prep.prepare(f"text:{tmp_path}/book.txt", tmp_path / "ref", seq_len=16, vocab_size=300, val_every=10**9,
                       progress=False).to_json()  # holds out 1 sample
    ref_ds = PreparedDataset(tmp_path / "ref")
    assert (ref["splits"]["train"]["samples"], ref["splits"]["val"]["samples"]) == (train_n + val_n - 1, 1)
    np.testing.assert_array_equal(rows, np.concatenate([ref_ds.split("train").read(np.arange(train_n + val_n - 1)),
                                                        ref_ds.split("val").read(np.arange(1))]))

    # A dataset with no validation samples at all trains without evaluation, and says so.
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    manifest["splits"]["val"] = {"shards": [], "samples": 0, "tokens": 0, "unigram_entropy": None}
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(manifest))
    out = io.StringIO()
    summary = train(small_config(f"data.dataset={tmp_path / 'ds'}", "model.vocab_size=auto", "train.steps=3",
                               "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=2",
                               f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                               "sample.tokens=0"), out=out)
    assert "has no validation samples: training without evaluation" in out.getvalue()
    assert np.isfinite(summary["loss"]) and "val_loss" not in summary


def test_skip_bad_counts_each_record_once_with_the_default_tokenizer(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": t}) for t in _texts(30)]
    bad.write_text("\n".join(good[:10] + ['{"txt": 1}'] + good[10:] + ["{oops"]) + "\n")
    m = prep.prepare(f"jsonl:{bad}", tmp_path / "o", seq_len=8, vocab_size=300, skip_bad=True, progress=False).to_json()
    assert m["skipped"] == 2 and m["skipped_first"] == f"{bad}:11: no text field 'text'"


@pytest.mark.parametrize("flag, value, message", [
    ("--seq-len", "0", "--seq-len: must be a positive integer, got 0"),
    ("--seq-len", "-3", "--seq-len: must be a positive integer, got -3"),
    ("--val-every", "0", "--val-every: must be a positive integer, got 0"),
    ("--vocab-size", "0", "--vocab-size: must be at least 257 (256 bytes + end-of-text), got 0"),
    ("--samples-per-shard", "0", "--samples-per-shard: must be a positive integer, got 0"),
])
def test_prepare_flags_are_validated(flag, value, message, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "prepare", "--source", "default", "--out",
                           str(tmp_path / "o"), flag, value], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == f"error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_interrupted_prepare_removes_its_partial_directory(tmp_path):
    import signal
    import socket
    import subprocess
    import sys
    import time

    # A partial directory of a prepare on this host whose process is gone (killed with kill -9).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ds.partial-{socket.gethostname()}-{dead.pid}"
    (stale / "junk").mkdir(parents=True)
    docs = tmp_path / "d.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in _texts(20000, length=40)) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{docs}", "--out",
                             str(tmp_path / "ds"), "--seq-len", "16", "--vocab-size", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not [p for p in tmp_path.glob(".ds.partial-*") if p != stale]:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    assert not stale.exists()  # the dead run's partial directory was removed first
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"prepare: interrupted; {tmp_path / 'ds'} is unchanged and the partial output was removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def _files(path):
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()}


def test_prepare_never_writes_over_the_users_files(tmp_path):
    """--out DIR holding the user's files (the source itself, here) is refused, with or without --overwrite,
    and nothing is touched; --overwrite replaces only a dataset that holds nothing but a prepare's files."""
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    (data / "good.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in _texts(30)) + "\n")
    (data / "notes.txt").write_text("mine")
    before = _files(data)

    def prepare(out, *flags):
        return subprocess.run([sys.executable, "-m", "zerolm.cli", "prepare", "--source", f"jsonl:{data / 'good.jsonl'}",
                               "--out", str(out), "--seq-len", "16", "--vocab-size", "300", *flags],
                              capture_output=True, text=True)

    for flags in ((), ("--overwrite",)):
        proc = prepare(data, *flags)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"error: {data}: is not empty and holds no prepared dataset (manifest.json); prepare writes only into a "
            "missing or empty directory: choose another --out"), proc.stderr
        assert _files(data) == before
    (tmp_path / "empty").mkdir()
    assert prepare(tmp_path / "empty").returncode == 0  # an empty directory is fine
    out = tmp_path / "prepared"
    assert prepare(out).returncode == 0
    (out / "README.md").write_text("the user's note about this dataset")
    held = _files(out)
    proc = prepare(out, "--overwrite")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {out}: holds README.md, which no prepare wrote; --overwrite replaces only a prepared dataset: "
        "move them out first"), proc.stderr
    assert _files(out) == held
    (out / "README.md").unlink()
    assert prepare(out, "--overwrite").returncode == 0


def test_a_runs_losses_do_not_depend_on_the_shard_size(kjv, tmp_path):
    """The order does not see shards: the corpus prepared with 7 samples per shard trains exactly as with 2,000
    (the old order read one shard at a time, so its batches, hence its losses, differed)."""
    prep.prepare("default", tmp_path / "small-shards", seq_len=64, samples_per_shard=7, progress=False)
    losses = {}
    for name, data in (("large", kjv), ("small", tmp_path / "small-shards")):
        train(small_config(f"data.dataset={data}", "model.vocab_size=auto", "model.seq_len=64", "train.steps=3",
                         "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=2",
                         "train.eval_every=1000", "train.eval_sequences=16", f"logging.dir={tmp_path / name}",
                         f"checkpoint.dir={tmp_path / name / 'ckpt'}", "sample.tokens=0"), out=io.StringIO())
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(r["step"], r.get("loss"), r.get("val_loss")) for r in lines if "loss" in r or "val_loss" in r]
    assert len(losses["large"]) == 4 and losses["large"] == losses["small"]


@pytest.mark.slow
def test_a_checkpoint_of_the_old_order_resumes_in_it(kjv, tmp_path, monkeypatch):
    """A run saved in order version 1 (before the global permutation) continues in version 1, exactly as it
    would have gone on; a new run takes version 2."""
    from zerolm.checkpoint import resume
    from zerolm.checkpoint.store import Checkpoints

    def losses(name, steps, *extra):
        train(small_config(f"data.dataset={kjv}", "model.vocab_size=auto", "model.seq_len=64", f"train.steps={steps}",
                         "train.schedule_steps=6", "train.warmup_steps=1", "train.global_batch_size=16",
                         "train.micro_batch_size=2", "train.eval_every=1000", "train.eval_sequences=0",
                         "checkpoint.every=3", f"logging.dir={tmp_path / name}",
                         f"checkpoint.dir={tmp_path / name / 'ckpt'}", "sample.tokens=0", *extra), out=io.StringIO())
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in lines if "loss" in r}

    with monkeypatch.context() as old:
        old.setattr(resume, "ORDER_VERSION", 1)
        straight = losses("straight", 6)
        losses("resumed", 3)
    # As the zerolm before version 2 wrote it: no `order` in the data identity (and its file list to match).
    step = tmp_path / "resumed" / "ckpt" / "3"
    meta_file, record_file = step / "meta" / "metadata", step / "zerolm_files.json"
    meta = json.loads(meta_file.read_text())
    assert meta["dataset"].pop("order") == 1
    meta_file.write_text(json.dumps(meta))
    record = json.loads(record_file.read_text())
    record["files"]["meta/metadata"] = meta_file.stat().st_size
    record_file.write_text(json.dumps(record))
    assert losses("resumed", 6) == straight  # continued in version 1
    assert Checkpoints(tmp_path / "resumed" / "ckpt", read_only=True).meta(6).dataset["order"] == 1
    new = losses("new", 6)
    assert new != straight  # another order
    assert Checkpoints(tmp_path / "new" / "ckpt", read_only=True).meta(6).dataset["order"] == 2
