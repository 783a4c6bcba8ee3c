"""The `make train` path, end to end, in a subprocess."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, TINY, small_config

from zerolm.config import ConfigError
from zerolm.data.corpus import default_documents
from zerolm.data.prepare import prepare
from zerolm.data.tokenizer import train_bpe
from zerolm.train import run


def test_main_zero_trains_logs_and_samples(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "main_zero.py"), "--config", str(TINY), "--set", "train.steps=40",
         "--set", "train.eval_every=20", "--set", "train.warmup_steps=5", "--set", f"logging.dir={tmp_path}",
         "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
         "--set", "sample.tokens=16"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == list(range(40))
    assert all(k in records[0] for k in ("grad_norm", "lr", "tokens_per_s", "data_wait_s"))
    assert [r["step"] for r in records if "val_loss" in r] == [19, 39]
    entropy = float(proc.stdout.split("unigram entropy ")[1].split()[0])
    assert losses[0] > entropy  # starts near log(vocab)
    assert np.mean(losses[-5:]) < entropy - 0.3  # has learned more than unigram statistics
    sample = [line for line in proc.stdout.splitlines() if line.startswith("sample: ")]
    assert sample and sample[0].startswith("sample: And God said,") and len(sample[0]) > len("sample: And God said,") + 10
    assert "tok_s" in proc.stderr + proc.stdout  # the live progress bar
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["40"]  # the final checkpoint


def test_default_corpus():
    docs = default_documents()
    assert len(docs) == 1189 and docs[0].startswith("In the beginning God created")


def test_training_refuses_a_dataset_prepared_for_another_model(tmp_path):
    prepare("default", tmp_path / "ds", seq_len=32, progress=False)
    cfg = small_config(f"data.dataset={tmp_path / 'ds'}")  # model.seq_len 16
    with pytest.raises(ConfigError, match=rf"^data.dataset: {tmp_path}/ds was prepared with seq_len 32, but model.seq_len is 16$"):
        run(cfg)
    other = tmp_path / "other.json"
    train_bpe(["some other text entirely"] * 10, 300).save(str(other))
    cfg = small_config(f"data.dataset={tmp_path / 'ds'}", "model.seq_len=32", f"data.tokenizer={other}")
    with pytest.raises(ConfigError, match=rf"^data.tokenizer: {other} \(sha256 \w+\) is not the tokenizer "):
        run(cfg)
    cfg = small_config(f"data.dataset={tmp_path / 'ds'}", "model.seq_len=32", "model.vocab_size=1000")
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 1000 is smaller than the dataset's tokenizer"):
        run(cfg)
    with pytest.raises(ConfigError, match=rf"^data.dataset: {tmp_path}/nope/manifest.json: no manifest"):
        run(small_config(f"data.dataset={tmp_path / 'nope'}"))
