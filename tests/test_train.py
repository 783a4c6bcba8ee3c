"""The `make train` path, end to end, in a subprocess."""

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO, TINY

from zerolm.data.corpus import default_documents, split_documents
from zerolm.data.loader import pack, unigram_entropy


def test_main_zero_trains_logs_and_samples(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "main_zero.py"), "--config", str(TINY), "--set", "train.steps=40",
         "--set", "train.eval_every=20", "--set", "train.warmup_steps=5", "--set", f"logging.dir={tmp_path}",
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


def test_default_corpus_split_and_entropy():
    docs = default_documents()
    assert len(docs) == 1189 and docs[0].startswith("In the beginning God created")
    train, val = split_documents(docs, 50)
    assert len(val) == 23 and len(train) + len(val) == len(docs) and not set(train) & set(val)
    samples = pack([np.arange(5), np.arange(7)], eot_id=99, seq_len=3)
    assert samples.tolist() == [[0, 1, 2, 3], [4, 99, 0, 1], [2, 3, 4, 5]]
    assert unigram_entropy(np.array([[0, 1], [0, 1]])) == np.log(2)
