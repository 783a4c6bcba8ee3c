"""`zerolm contamination`: task passages planted at known places in a corpus are found in exactly those
documents (across packed samples and shards, never across an end-of-text); parts merged give one pass's
result; gs:// datasets; the shipped tasks against the embedded corpus; bad input in one line."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from zerolm.data import contamination, documents, packing
from zerolm.data.ngrams import NgramSet, words
from zerolm.data.prepare import prepare
from zerolm.data.shards import PreparedDataset

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
DOCS = 240
VAL_EVERY = 50
SMALL_PIECES = documents.Pieces(tokens=120, overlap=80)
SETTINGS = dict(vocab_size=300, seq_len=8, samples_per_shard=16, val_every=VAL_EVERY, progress=False)
PLANTED = {0: 3, 2: 61, 3: 120, 5: 199}  # task document -> the training document it is planted in
SHORT = (6, 150)  # a task document of 6 words, planted whole: counted by its whole length
SPLIT = (4, 80)  # task document 4 cut in two: its head ends document 80, its tail starts document 81
IN_VALIDATION = (1, 49)  # task document 1 planted in a validation document: not in training
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: planted.jsonl
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + answer}}}}"
{extra}metric_list:
  - metric: acc
"""


def _passages() -> list[str]:
    """Task documents of words no corpus document holds (7 of 20 words; one of 6)."""
    rng = np.random.default_rng(1)
    letters = list("bcdfghjklmnprstvz")
    made = [" ".join("".join(rng.choice(letters, 6)) for _ in range(20)) for _ in range(7)]
    made[SHORT[0]] = " ".join(made[SHORT[0]].split()[:6])
    return made


def _corpus(directory, plant: bool) -> str:
    """Three jsonl files of DOCS / 3 documents each; with `plant`, the task passages where PLANTED, SHORT and
    SPLIT say (capitalized and punctuated: the same words once normalized)."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(20, 90)))) for _ in range(DOCS)]
    passages = _passages()
    if plant:
        for task_doc, doc in [*PLANTED.items(), SHORT, IN_VALIDATION]:
            head, _, tail = texts[doc].partition(" over ")
            texts[doc] = f"{head} over {passages[task_doc].capitalize()}, {tail}"
        cut = passages[SPLIT[0]].split()
        texts[SPLIT[1]] += " " + " ".join(cut[:8])
        texts[SPLIT[1] + 1] = " " + " ".join(cut[8:]) + " " + texts[SPLIT[1] + 1]  # (its words whole if joined)
    directory.mkdir()
    for f in range(3):
        lines = [json.dumps({"text": t}) for t in texts[f * DOCS // 3:(f + 1) * DOCS // 3]]
        (directory / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return f"jsonl:{directory}/*.jsonl"


def _tasks(directory):
    """Two tasks of the same passages: `planted_query` says what to look for (should_decontaminate), its
    passage; `planted_prompt` does not: its prompt and target, the same passage rendered."""
    directory.mkdir()
    rows = [{"context": " ".join(p.split()[:-1]), "answer": p.split()[-1], "passage": p} for p in _passages()]
    (directory / "planted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    query = "should_decontaminate: true\ndoc_to_decontamination_query: passage\n"
    (directory / "query.yaml").write_text(TASK_YAML.format(name="planted_query", extra=query))
    (directory / "prompt.yaml").write_text(TASK_YAML.format(name="planted_prompt", extra=""))
    return directory


def _prepare(source, out, monkeypatch):
    """Prepared in units of one input file each (a unit's documents end in its leftover)."""
    plan = packing.plan_units
    monkeypatch.setattr(packing, "plan_units", lambda source, unit_bytes: plan(source, 1))
    return prepare(source, out, **SETTINGS)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from zerolm.eval.task_texts import task_ngrams

    root = tmp_path_factory.mktemp("contamination")
    tasks = _tasks(root / "tasks")
    with pytest.MonkeyPatch.context() as monkeypatch:
        dirty = _prepare(_corpus(root / "dirty", plant=True), root / "dirty-ds", monkeypatch)
        clean = _prepare(_corpus(root / "clean", plant=False), root / "clean-ds", monkeypatch)
    assert len(dirty.units) == len(clean.units) == 3
    ngrams = task_ngrams(["planted_query", "planted_prompt"], 13, str(tasks))
    return {"root": root, "tasks": tasks, "dirty": str(root / "dirty-ds"), "clean": str(root / "clean-ds"),
            "ngrams": ngrams}


def _measure(location, ngrams, **kw):
    result, missing = contamination.measure(location, ngrams, **kw)
    assert not missing and result is not None
    return result


def test_the_documents_read_back_are_the_training_documents_whole(planted):
    """Joined across samples, shards and each unit's leftover, cut at end-of-text: every training document
    of the corpus, in order, token for token (the validation ones left out)."""
    dataset = PreparedDataset(planted["dirty"])
    tok = dataset.tokenizer()
    corpus = [json.loads(line)["text"] for f in range(3)
              for line in (planted["root"] / "dirty" / f"part-{f}.jsonl").read_text().splitlines()]
    per_unit = DOCS // 3
    training = [t for i, t in enumerate(corpus) if (i % per_unit) % VAL_EVERY != VAL_EVERY - 1]
    for pieces in (documents.Pieces(), SMALL_PIECES):
        reader = documents.Reader(planted["dirty"], pieces)
        read = [p for item in documents.items(dataset.manifest) for p in reader.documents(item)]
        whole = [p.tokens for p in read] if pieces.tokens > 1000 else None
        assert sum(p.starts for p in read) == len(training)
        assert whole is not None or not all(p.ends for p in read)  # some documents were read in pieces
        if whole is not None:
            assert len(whole) == len(training)
            for got, text in zip(whole, training, strict=True):
                np.testing.assert_array_equal(got, tok.encode(text))
    assert max(len(tok.encode(t)) for t in training) > 3 * (dataset.seq_len + 1)  # documents span several samples


def test_planted_passages_are_found_in_exactly_their_documents(planted):
    result = _measure(planted["dirty"], planted["ngrams"])
    expected = sorted([*PLANTED, SHORT[0]])
    for name in ("planted_query", "planted_prompt"):
        task = result["tasks"][name]
        # not SPLIT's: no n-gram runs across an end-of-text; not IN_VALIDATION's: validation is not training
        assert task["dirty_documents"] == expected, name
        assert (task["documents"], task["dirty"]) == (7, len(expected))
        assert task["dirty_fraction"] == pytest.approx(len(expected) / 7)
        assert [e["document"] for e in task["examples"]] == expected[:contamination.EXAMPLES]
        first = _passages()[expected[0]].split()
        assert task["examples"][0]["ngram"] in " ".join(first)
    assert result["training"]["dirty_documents"] == len(expected)
    assert result["training"]["documents"] == DOCS - 3 * (DOCS // 3 // VAL_EVERY)
    saved = json.loads((contamination.result_path(planted["dirty"], 13)).read_text())
    assert saved == result


def test_the_same_corpus_without_them_is_clean(planted):
    result = _measure(planted["clean"], planted["ngrams"])
    assert all(t["dirty"] == 0 and t["dirty_documents"] == [] for t in result["tasks"].values())
    assert result["training"]["dirty_documents"] == 0


def test_a_passage_is_found_across_the_pieces_of_a_long_document(planted):
    """Read in pieces of 120 tokens overlapping by 80 (a planted passage is about 90): the same documents
    found."""
    whole = contamination.report("x", planted["ngrams"], contamination.scan(planted["dirty"], planted["ngrams"]))
    cut = contamination.report("x", planted["ngrams"], contamination.scan(
        planted["dirty"], planted["ngrams"], pieces=SMALL_PIECES))
    assert {k: t["dirty_documents"] for k, t in cut["tasks"].items()} == {
        k: t["dirty_documents"] for k, t in whole["tasks"].items()} == {k: sorted([*PLANTED, SHORT[0]]) for k in whole["tasks"]}


def test_a_passage_across_an_end_of_text_is_not_found(planted):
    """The two halves of SPLIT's passage, joined, are dirty; across the end-of-text between them, not."""
    halves = _passages()[SPLIT[0]]
    ngrams = NgramSet.build({"split": [halves]}, 13)
    tally = contamination.scan(planted["dirty"], ngrams)
    assert tally.found == {}
    assert len(words(halves)) == 20


def test_parts_merged_are_one_pass(planted, tmp_path):
    one = _measure(planted["dirty"], planted["ngrams"])
    for i in (2, 3):
        assert contamination.measure(planted["dirty"], planted["ngrams"], part=(i, 3)) == (None, [1, 3] if i == 2 else [1])
    merged, missing = contamination.measure(planted["dirty"], planted["ngrams"], part=(1, 3))
    assert missing == [] and merged == one
    with pytest.raises(contamination.ContaminationError, match=r"--part: 4/3: the part must be 1 to 3"):
        contamination.measure(planted["dirty"], planted["ngrams"], part=(4, 3))


def test_json_is_json_also_while_parts_are_still_to_run(planted, tmp_path, capsys):
    """`--json --part`: the part that leaves others to run prints what it did and what is left, as JSON too."""
    from zerolm.commands import main

    dataset = tmp_path / "ds"
    shutil.copytree(planted["dirty"], dataset)
    flags = ["contamination", "--dataset", str(dataset), "--tasks", "planted_query", "--include-path",
             str(planted["tasks"]), "--workers", "1", "--json"]
    assert main([*flags, "--part", "2/2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"dataset": str(dataset), "ngram": 13, "part": "2/2",
                                                    "parts_to_run": [1]}
    assert main([*flags, "--part", "1/2"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"]["planted_query"]["dirty"] == 5


def test_a_dataset_on_gs_is_scanned_and_its_result_written_beside_it(planted, gcs, monkeypatch):
    from zerolm.core import storage

    source = _corpus(planted["root"] / "gs-corpus", plant=True)
    url = f"{gcs.url}/ds"
    _prepare(source, url, monkeypatch)
    here = _measure(planted["dirty"], planted["ngrams"])
    there = _measure(url, planted["ngrams"])
    assert there["training"] == here["training"]
    for name, task in there["tasks"].items():  # examples say where: the gs:// build's shards are under a prefix
        assert [e["ngram"] for e in task.pop("examples")] == [e["ngram"] for e in here["tasks"][name].pop("examples")]
        assert task == here["tasks"][name]
    saved = json.loads(storage.path(url).joinpath("contamination", "13gram.json").read_text())
    assert saved["dataset"] == url and saved["training"] == there["training"]
    assert contamination.dirty_fractions([url])["planted_query"]["dirty"] == 5


def _cli(*args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "contamination", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_the_command_on_two_workers_prints_the_table_and_json(planted):
    flags = ["--dataset", planted["dirty"], "--tasks", "planted_query", "--include-path", planted["tasks"]]
    table = _cli(*flags, "--workers", "2").stdout
    assert "| planted_query | 7 | 5 | 71.4% |" in table
    data = json.loads(_cli(*flags, "--workers", "2", "--json").stdout)
    assert data["ngram"] == 13 and data["tasks"]["planted_query"]["dirty"] == 5
    assert set(data["tasks"]) == {"planted_query"}


@pytest.mark.parametrize("flags, message", [
    (["--tasks", "nope"], "error: --tasks: unknown task 'nope'"),
    (["--dataset", "{root}/missing"], "error: --dataset: {root}/missing/manifest.json: no manifest"),
    (["--part", "3/2"], "error: --part: 3/2: the part must be 1 to 2"),
    (["--ngram", "0"], "error: --ngram: 0 must be a positive number of words"),
])
def test_bad_input_is_one_line_naming_the_value(planted, flags, message, capsys):
    from zerolm.commands import main

    args = {"--dataset": planted["dirty"], "--tasks": "planted_query", "--include-path": str(planted["tasks"])}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        args[flag] = value.format(root=planted["root"])
    assert main(["contamination", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(message.format(root=planted["root"])), err


@pytest.mark.slow
def test_the_shipped_tasks_are_all_in_the_embedded_corpus(tmp_path):
    """zerolm's tasks are built from the embedded corpus, the default training data: every document dirty."""
    from zerolm.eval.task_texts import task_ngrams

    prepare("default", tmp_path / "kjv", vocab_size=512, seq_len=256, progress=False)
    ngrams = task_ngrams(["zerolm_cloze", "zerolm_choice", "zerolm_text"], 13)
    result = _measure(str(tmp_path / "kjv"), ngrams)
    assert {name: t["dirty_fraction"] for name, t in result["tasks"].items()} == {
        "zerolm_cloze": 1.0, "zerolm_choice": 1.0, "zerolm_text": 1.0}


def test_words_and_ngrams_are_gpt3s():
    """Lower-cased, punctuation (ASCII's and Unicode's) deleted, a token of punctuation alone no word; a document
    shorter than n words is found by its whole length, and only whole."""
    assert words("The «Quick», brown—fox ... JUMPS!") == ["the", "quick", "brownfox", "jumps"]
    ngrams = NgramSet.build({"t": ["one two three four five six", "Seven, eight"]}, 5)
    from zerolm.data.ngrams import Matcher

    found = Matcher(ngrams).dirty(["x ONE two three four FIVE y", "seven eight", "eight seven", "two three four five"])
    assert found.tolist() == [True, True, False, False]  # the last: 4 words of a 5-gram


def test_a_decontaminated_prepare_measures_clean_and_leaves_validation_alone(planted, tmp_path, monkeypatch, capsys):
    """prepare --decontaminate (in worker processes) leaves out exactly the dirty training documents: the
    dataset measures clean, its validation split is the plain prepare's, and the manifest says what it left out."""
    from zerolm.commands import main

    plan = packing.plan_units
    monkeypatch.setattr(packing, "plan_units", lambda source, unit_bytes: plan(source, 1))
    out = tmp_path / "decontaminated"
    assert main(["prepare", "--source", f"jsonl:{planted['root']}/dirty/*.jsonl", "--out", str(out),
                 "--vocab-size", "300", "--seq-len", "8", "--samples-per-shard", "16", "--val-every", str(VAL_EVERY),
                 "--workers", "2", "--decontaminate", "planted_query,planted_prompt",
                 "--include-path", str(planted["tasks"])]) == 0
    assert "left out 5 training document(s) sharing a 13-gram with planted_query, planted_prompt" in capsys.readouterr().out
    result = _measure(str(out), planted["ngrams"])
    assert all(t["dirty"] == 0 for t in result["tasks"].values())
    plain = PreparedDataset(planted["dirty"])
    ours = PreparedDataset(out)
    assert result["training"]["documents"] == _measure(planted["dirty"], planted["ngrams"])["training"]["documents"] - 5
    n = len(plain.split("val"))
    np.testing.assert_array_equal(ours.split("val").read(np.arange(n)), plain.split("val").read(np.arange(n)))
    assert len(ours.split("val")) == n
    record = ours.manifest.decontamination
    assert record is not None and (record.tasks, record.ngram, record.documents) == (
        ("planted_query", "planted_prompt"), 13, 5)
    assert record.ngrams_sha256 == planted["ngrams"].fingerprint()
    units = [packing.read_unit(out, i) for i in range(3)]
    assert sorted(i * (DOCS // 3) + d for i, u in enumerate(units) for d in u.removed) == sorted(
        [*PLANTED.values(), SHORT[1]])


@pytest.mark.slow
def test_eval_and_report_show_each_tasks_dirty_fraction_for_the_runs_data(trained_run, tmp_path):
    """A measure of zerolm_cloze against the run's own dataset (its first two documents said dirty, so that
    some are clean): `zerolm eval --tasks` prints the dirty fraction and the clean documents' score, and
    `zerolm report` a table of it; a task not measured shows nothing."""
    import shutil

    from runs import zerolm
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.eval.task_texts import task_ngrams
    from zerolm.observe import run_files
    from zerolm.observe import run_report as report

    location = Checkpoints(trained_run / "ckpt", read_only=True).readable_meta(16).dataset_location
    try:
        result = _measure(location, task_ngrams(["zerolm_cloze"], 13))
        assert result["tasks"]["zerolm_cloze"]["dirty_fraction"] == 1.0
        result["tasks"]["zerolm_cloze"].update(dirty=2, dirty_fraction=2 / 280, dirty_documents=[0, 1])
        contamination.write_result(location, result)
        out = zerolm("eval", "--checkpoint", trained_run / "ckpt" / "16", "--tasks", "zerolm_cloze,zerolm_text",
                     "--limit", "4", devices=2).stdout
        assert "  zerolm_cloze: 0.7% dirty (2 of 280 documents share a 13-gram with the training data); on the clean " \
               "ones: acc " in out
        assert "zerolm_text:" not in out
        written = json.loads((trained_run / "ckpt" / "lm-eval-step16.json").read_text())
        assert set(written["contamination"]) == {"zerolm_cloze"} and "samples" not in written
        log_dir = tmp_path / "log"
        shutil.copytree(trained_run / "log", log_dir)
        with (log_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 16, "tasks/zerolm_cloze/acc": 0.5, "tasks/zerolm_text/bits_per_byte": 3}) + "\n")
        text = "\n".join(report.markdown(run_files.read(log_dir)))
        assert "| zerolm_cloze | 280 | 2 | 0.7% |" in text and "| zerolm_text | 40 |" not in text
    finally:
        shutil.rmtree(f"{location}/{contamination.DIRECTORY}", ignore_errors=True)  # the session's shared dataset


def test_the_clean_subset_score_leaves_the_dirty_documents_out():
    samples = {"t": [{"doc_id": 0, "acc": 1.0, "acc_norm": 0.0}, {"doc_id": 1, "acc": 0.0, "acc_norm": 0.0},
                     {"doc_id": 2, "acc": 1.0, "acc_norm": 1.0}, {"doc_id": 3, "acc": 0.0, "acc_norm": 1.0}],
               "unmeasured": [{"doc_id": 0, "acc": 1.0}]}
    dirty = {"t": {"dirty_documents": [1, 3], "dirty": 2, "documents": 4, "dirty_fraction": 0.5, "ngram": 13}}
    assert contamination.clean_scores(samples, dirty) == {"t": {"acc": 1.0, "acc_norm": 0.5}}
