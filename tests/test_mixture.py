"""data.mixture: datasets interleaved by weight, deterministic, exactly resumable (kill -9 and resume give
the same losses), the realised shares logged, and bad mixtures refused in one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

import runs
from conftest import REPO, TINY
from zerolm.core.exitcodes import EXIT_USAGE
from zerolm.data.mixture import BLOCK, MixtureOrder, apportion
from zerolm.data.order import sample_order


def test_every_block_holds_each_datasets_share():
    assert apportion([0.7, 0.3], 10).tolist() == [7, 3] and apportion([1, 1, 1], 8).tolist() == [3, 3, 2]
    assert apportion([2, 1], BLOCK).sum() == BLOCK
    order = MixtureOrder([0.5, 0.3, 0.2], seed=3, block=64)
    dataset, local = order.locate(np.arange(64 * 5 + 17))
    for i, n in enumerate(order.per_block):
        mine = np.sort(local[dataset == i])
        # Each dataset's own stream is read in order, nothing skipped, nothing twice.
        assert mine.tolist() == list(range(len(mine)))
        assert (dataset[: 64 * 5] == i).sum() == 5 * n
    assert order.counts(64 * 5 + 17).tolist() == np.bincount(dataset, minlength=3).tolist()
    again, _ = MixtureOrder([0.5, 0.3, 0.2], seed=3, block=64).locate(np.arange(64 * 5 + 17))
    assert (again == dataset).all()  # deterministic
    other, _ = MixtureOrder([0.5, 0.3, 0.2], seed=4, block=64).locate(np.arange(64 * 5 + 17))
    assert not (other == dataset).all()  # and shuffled by the seed
    # Any range of positions (a host's rows of a step) gives what the whole stream gives there.
    d, k = order.locate(np.arange(200, 260))
    assert (d == dataset[200:260]).all() and (k == local[200:260]).all()


def test_a_mixture_of_one_dataset_reads_it_as_a_plain_run_does():
    from zerolm.data.mixture import MixedOrder

    class Split:  # what MixedOrder reads of a split
        sizes = np.array([5, 7, 3])
        name, T1 = "train", 9

        def __len__(self):
            return 15

    class Mixture:
        weights, names = [1.0], ["only"]

    from zerolm.data.mixture import MixedSplit

    split = MixedSplit(Mixture(), [Split()])
    positions = np.arange(40)
    for version in (1, 2):
        assert (MixedOrder(split, 11, version).ids(positions) == sample_order(Split.sizes, 11, version).ids(positions)).all()


def test_a_mixtures_head_is_n_samples_when_a_dataset_has_fewer_than_its_share():
    """Evaluation reads a mixture's first n validation samples by weight: a dataset with fewer than its share
    gives all it has and the others make up the rest, so n come back (the evaluator shapes them as n rows)."""
    from zerolm.data.mixture import MixedSplit

    class Split:  # a split of `size` samples whose sample i is the row [first + i] * T1
        name, T1 = "val", 3

        def __init__(self, first: int, size: int):
            self.first, self.size = first, size

        def __len__(self):
            return self.size

        def read(self, ids):
            return np.repeat(self.first + np.asarray(ids)[:, None], self.T1, axis=1).astype(np.int32)

    class Mixture:
        weights, names = [0.7, 0.2, 0.1], ["a", "b", "c"]

    split = MixedSplit(Mixture(), [Split(0, 1000), Split(10_000, 9), Split(20_000, 1000)])
    first = lambda rows: rows[:, 0]  # noqa: E731
    # No dataset short: each its apportioned share, as before.
    assert np.bincount(first(split.head(40)) // 10_000).tolist() == [28, 8, 4]
    # b has 9 of the 20 that 100 would give it: a and c share its 11 by their weights (0.7 : 0.1).
    rows = first(split.head(100))
    assert len(rows) == 100 and np.bincount(rows // 10_000).tolist() == [80, 9, 11]
    assert sorted(rows[rows < 10_000].tolist()) == list(range(80))  # each dataset's first samples, once each
    assert len(split.head(5000)) == 2009  # all there is


def _second_dataset(tmp_path, tokenizer, seq_len=32):
    """A small jsonl corpus prepared with the default dataset's tokenizer: a mixture partner for it."""
    from zerolm.data.prepare import prepare

    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    docs = tmp_path / "second.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 80))}) + "\n" for _ in range(400)))
    prepare(f"jsonl:{docs}", tmp_path / "second", tokenizer=str(tokenizer), seq_len=seq_len, progress=False)
    return tmp_path / "second"


@pytest.mark.slow
def test_a_mixture_trains_resumes_exactly_after_kill_9_and_logs_its_shares(tmp_path):
    # The default dataset (the first run prepares it into this test's cache) and one of the same tokenizer.
    from zerolm.core.storage import cache_dir

    runs.train(tmp_path / "first", steps=1)
    default = next(cache_dir().glob("datasets/kjv-*-seq32"))  # the session's private cache (conftest)
    second = _second_dataset(tmp_path, default / "tokenizer.json")
    mixture = f"data.mixture=[{{dataset: {default}, weight: 0.75, name: bible}}, {{dataset: {second}, weight: 0.25}}]"
    # 256 validation sequences: second's share (64) is more than its 40, so the rest come from the bible.
    sets = (mixture, "train.eval_sequences=256")
    straight = tmp_path / "straight"
    proc = runs.train(straight, *sets)
    assert "data: mixture: bible 0.7500 (6144 of every 8192 samples; weight 0.75), second 0.2500 (2048 of every 8192 " \
           "samples; weight 0.25)" in proc.stdout
    reference = runs.losses(straight)
    shares = [json.loads(line) for line in (straight / "log" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in shares if "mixture_share/bible" in r][-1]
    assert abs(last["mixture_share/bible"] - 0.75) < 0.1 and abs(last["mixture_share/bible"] + last["mixture_share/second"]
                                                                  - 1) < 1e-9
    killed = tmp_path / "killed"
    runs.kill_9_after(killed, *sets)
    runs.train(killed, *sets)
    assert runs.losses(killed) == reference

    # A mixture's checkpoint is used as a single dataset's is: eval gives the validation loss training
    # logged (the mixture's validation set), and sample and export-hf find the datasets' shared tokenizer.
    logged = [r["val_loss"] for r in shares if "val_loss" in r][-1]
    result = json.loads(runs.zerolm("eval", "--checkpoint", straight / "ckpt", "--json").stdout)
    assert result["loss"] == pytest.approx(logged, abs=1e-5) and result["dataset"].startswith("mixture of bible (0.75)")
    assert result["sequences"] == 256
    assert runs.zerolm("sample", "--checkpoint", straight / "ckpt", "--prompt", "In the beginning", "--max-new-tokens", "4").stdout
    runs.zerolm("export-hf", "--checkpoint", straight / "ckpt", "--out", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").exists()


@pytest.mark.parametrize("mixture, message", [
    ("[{dataset: default, weight: 0}]", "data.mixture.0.weight: Input should be greater than 0"),
    ("[{dataset: default, weight: 1}, {dataset: SECOND, weight: 1}]",
     "data.mixture.1.dataset: SECOND was prepared with tokenizer "),
    ("[{dataset: default, weight: 1}, {dataset: SECOND, weight: 0.00001}]",
     "data.mixture.1.weight: 1e-05 gives SECOND none of every 8192 samples (weights are shares of their sum); raise it "
     "or leave the dataset out"),
])
def test_bad_mixtures_are_one_line(tmp_path, mixture, message):
    from zerolm.data.tokenizer import train_bpe

    tok = tmp_path / "other.json"
    train_bpe(["some other text entirely"] * 20, 300).save(str(tok))
    second = _second_dataset(tmp_path, tok, seq_len=128)
    mixture, message = mixture.replace("SECOND", str(second)), message.replace("SECOND", str(second))
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(TINY), "--set",
                           f"data.mixture={mixture}", "--set", "train.steps=2", "--set", "train.warmup_steps=1",
                           "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", f"logging.dir={tmp_path / 'log'}"],
                          capture_output=True, text=True, cwd=REPO, timeout=300, env=runs.env(1))
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "ckpt").exists()
