"""Downstream tasks through lm-evaluation-harness (zerolm.eval.harness, zerolm.eval.downstream, zerolm.eval.tasks): the zerolm
backend gives the harness's own `hf` backend's numbers on the exported model, the same on any layout the
parameters are sharded in, and `zerolm eval --tasks` writes them beside the checkpoint; bad tasks are one line;
a training run's eval.tasks write those numbers at their steps, once each, through SIGTERM and kill -9."""

import json

import jax
import pytest

from conftest import TINY
from runs import SMALL, zerolm

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # a trained run

TASKS = ["zerolm_cloze", "zerolm_choice", "zerolm_text"]
METRICS = {"zerolm_cloze": ["acc", "perplexity"], "zerolm_choice": ["acc", "acc_norm"],
           "zerolm_text": ["word_perplexity", "byte_perplexity", "bits_per_byte"]}
LIMIT = 12


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    from zerolm.eval import downstream

    for variable in (*downstream.OFFLINE, "DISABLE_MULTIPROC"):
        monkeypatch.setenv(variable, "1")


def task_numbers(lm) -> dict[str, float]:
    from zerolm.eval import downstream

    results = downstream.evaluate(lm, TASKS, downstream.task_manager(TASKS), limit=LIMIT, bootstrap_iters=0)
    numbers = downstream.metrics(results)
    assert sorted(numbers) == sorted(f"tasks/{t}/{m}" for t, ms in METRICS.items() for m in ms)
    return numbers


def test_the_shipped_task_files_are_what_the_corpus_builds(tmp_path):
    from zerolm.eval import tasks

    built = tasks.build(tmp_path)
    for name in tasks.NAMES:
        assert built[name].read_bytes() == (tasks.DIRECTORY / f"{name}.jsonl").read_bytes(), name
    cloze = [json.loads(line) for line in built["zerolm_cloze"].read_text().splitlines()]
    choice = [json.loads(line) for line in built["zerolm_choice"].read_text().splitlines()]
    assert len(cloze) > 250 and all(item["text"].split()[-1].isalpha() for item in cloze)
    assert len(choice) > 250 and {item["label"] for item in choice} == {0, 1, 2, 3}
    assert all(len(set(item["endings"])) == 4 for item in choice)


def test_zerolm_backend_gives_the_hf_backends_numbers_on_the_exported_model(trained_run, tmp_path):
    import lm_eval

    from zerolm.eval import downstream
    from zerolm.eval.harness import ZerolmLM

    zerolm("export-hf", "--checkpoint", trained_run / "ckpt", "--out", tmp_path / "hf", devices=1)
    ours = ZerolmLM(checkpoint=str(trained_run / "ckpt"), batch_size=5)  # 5 rows: rounded up to 8 on 8 devices
    got = task_numbers(ours)
    assert ours.scorer.batch_rows == 8 and ours.max_length == 32
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", tasks=TASKS,
                                 limit=LIMIT, task_manager=downstream.task_manager(TASKS), bootstrap_iters=0,
                                 batch_size=4, device="cpu")
    want = downstream.metrics(hf)
    assert got == pytest.approx(want, rel=1e-5)
    assert 0 < got["tasks/zerolm_choice/acc"] < 1 and got["tasks/zerolm_text/bits_per_byte"] > 0


def restored_on(trained_run, *sets: str, dp: int, tp: int = 1):
    """The run's last checkpoint restored as training would restore it on a (dp, tp) mesh with `sets`."""
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.checkpoint.trained_model import load
    from zerolm.config.load import load_config
    from zerolm.eval.harness import Loaded
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    cfg = load_config(TINY, [*SMALL, "model.vocab_size=2048", f"mesh.tp={tp}", *sets], device_count=dp * tp)
    model, zero, _ = build_step(cfg, make_mesh(dp, tp, jax.devices()[:dp * tp]))
    state, _ = Checkpoints(trained_run / "ckpt", read_only=True).restore(16, zero, cfg.model.model_dump())
    return Loaded(model, state.params, zero.table.mesh, load(str(trained_run / "ckpt")).tokenizer())


def test_the_same_numbers_at_dp_8_tp_2_and_stage_3_as_on_one_device(trained_run):
    from zerolm.eval.harness import ZerolmLM

    one = task_numbers(ZerolmLM(loaded=restored_on(trained_run, dp=1)))
    for sets, dp, tp in [((), 8, 1), ((), 4, 2), (("zero.stage=3", "zero.grad_reduce=reduce_scatter"), 8, 1)]:
        lm = ZerolmLM(loaded=restored_on(trained_run, *sets, dp=dp, tp=tp), batch_size=8)
        assert lm.scorer.batch_rows == 8
        assert task_numbers(lm) == pytest.approx(one, rel=1e-5), (sets, dp, tp)


def test_generate_until_is_the_greedy_sample_cut_at_the_stop_sequence(trained_run):
    from lm_eval.api.instance import Instance

    from zerolm.config.sampling import Sampling
    from zerolm.eval.harness import ZerolmLM
    from zerolm.model.generate import generate

    lm = ZerolmLM(checkpoint=str(trained_run / "ckpt"))
    tok, model = lm.zerolm_tokenizer, lm.loaded
    prompt = tok.encode("And God said,").tolist()
    greedy = tok.decode(generate(model.model, model.params, prompt, 12, Sampling(temperature=0), tok.eot_id)[len(prompt):])
    stop = greedy.strip().split(" ")[1]
    request = lambda until: Instance("generate_until", {}, ("And God said,", {"until": until, "max_gen_toks": 12}), 0)
    full, cut = lm.generate_until([request([]), request([stop])])
    assert full == greedy and cut == greedy.split(stop)[0] and len(cut) < len(full)


def test_eval_tasks_prints_the_table_and_writes_the_results_beside_the_checkpoint(trained_run):
    out = zerolm("eval", "--checkpoint", trained_run / "ckpt" / "12", "--tasks", "zerolm_cloze,zerolm_text",
                 "--limit", "4", devices=2).stdout
    written = trained_run / "ckpt" / "lm-eval-step12.json"
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("|")]
    assert f"results: {written}" in out and {"zerolm_cloze", "zerolm_text"} < set(rows) and "bits_per_byte" in out
    results = json.loads(written.read_text())
    assert sorted(results["results"]) == ["zerolm_cloze", "zerolm_text"]
    assert results["config"]["model_name"] == f"{trained_run / 'ckpt'} step 12"
    assert results["results"]["zerolm_text"]["sample_len"] == 4
    assert results["config"]["batch_size"] == 8  # the rows of a batch (the default), not the harness's None
    # A later evaluation of the same step (another task, --limit, --batch-size) keeps the first one's file;
    # --json: one object on stdout, the numbers as training's rows name them.
    first = written.read_bytes()
    # (zerolm_cloze's perplexity is bootstrapped, which the harness announces with a print: not on stdout.)
    again = json.loads(zerolm("eval", "--checkpoint", trained_run / "ckpt" / "12", "--tasks", "zerolm_cloze",
                              "--limit", "2", "--batch-size", "3", "--json", devices=2).stdout)
    assert written.read_bytes() == first
    assert again["results"] == str(trained_run / "ckpt" / "lm-eval-step12-2.json") and again["step"] == 12
    assert set(again) == {"checkpoint", "step", "results", "tasks/zerolm_cloze/acc", "tasks/zerolm_cloze/perplexity"}
    second = json.loads((trained_run / "ckpt" / "lm-eval-step12-2.json").read_text())
    assert second["results"]["zerolm_cloze"]["sample_len"] == 2
    assert second["config"]["batch_size"] == 4  # 3 rows, rounded up to a multiple of dp 2


@pytest.mark.parametrize("tasks, message", [
    ("zerolm_cloze,nosuch", "--tasks: unknown task 'nosuch' (zerolm's: zerolm_cloze, zerolm_choice, zerolm_text; "
     "the harness's: `lm-eval ls tasks`; your own: --include-path DIR)"),
    ("lambada_openai", "--tasks: lambada_openai: its data is not on this machine (Couldn't reach "
     "'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled)); download it on a machine with internet"),
])
def test_an_unknown_task_or_one_without_its_data_is_one_line_and_exit_2(trained_run, tasks, message, capsys):
    from zerolm.commands import main

    assert main(["eval", "--checkpoint", str(trained_run / "ckpt"), "--tasks", tasks]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {message}")


def test_download_without_internet_is_one_line_at_once(trained_run, monkeypatch, capsys):
    """--download where the hub cannot be reached: one line that says so, not half a minute of the harness's
    retries ending in advice to pass --download (HF_DATASETS_OFFLINE=1, set here, yields to --download)."""
    import urllib.request

    from zerolm.commands import main

    monkeypatch.setattr(urllib.request, "_opener", None)
    for variable in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(variable, "http://127.0.0.1:9")  # nothing listens there: refused at once, like no route out
    for variable in ("NO_PROXY", "no_proxy", "HF_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    assert main(["eval", "--checkpoint", str(trained_run / "ckpt"), "--tasks", "lambada_openai", "--download"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("error: --download: no internet (https://huggingface.co: [Errno "), err
    assert "refused" in err, err  # by the dead proxy: the probe reads the environment's proxies when it runs
    # and keeps none: urlopen's opener, built at its first call, would send the worker's later urlopen there
    assert urllib.request._opener is None


TASK_FILE = """task: mine
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: {output_type}
test_split: test
doc_to_text: "{text}"
doc_to_target: " x"
"""


def task_directory(path, data="docs.jsonl", output_type="loglikelihood", text="{{text}}"):
    """A directory of the user's with one task file (task `mine`) and its data, docs.jsonl (3 documents)."""
    path.mkdir()
    (path / "mine.yaml").write_text(TASK_FILE.format(data=data, output_type=output_type, text=text))
    (path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    return path


def test_a_task_files_relative_data_files_are_relative_to_the_file(tmp_path, monkeypatch):
    from zerolm.eval import downstream

    mine = task_directory(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)  # not the task file's directory
    manager = downstream.prepare(["mine"], str(mine))
    assert len(manager.load(["mine"])["tasks"]["mine"].eval_docs) == 3


def test_only_a_local_tasks_data_paths_are_made_relative_to_its_file():
    """datasets' own builders (json, csv, ...) read data_files from this machine: relative to the task file. A
    hub repository's data_files (the harness's mmlusr tasks) are paths in the repository: left as they are."""
    from zerolm.eval.downstream import relative_to_file

    local = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": ["a.jsonl", "/b.jsonl", "hf://c"]},
                                                        "data_dir": "d"}}
    assert relative_to_file(local, "/tasks/t.yaml")["dataset_kwargs"] == {
        "data_files": {"test": ["/tasks/a.jsonl", "/b.jsonl", "hf://c"]}, "data_dir": "/tasks/d"}
    hub = {"dataset_path": "NiniCat/MMLU-SR", "dataset_kwargs": {"data_files": {"test": "answer_only_test/x.csv"}}}
    assert relative_to_file(hub, "/tasks/t.yaml") == hub


@pytest.mark.parametrize("mistake, message", [
    ({"output_type": "nonsense"}, "Got invalid output_type 'nonsense', must be in 'loglikelihood,"),
    ({"text": "{{passage}}"}, "doc_to_text: 'passage' is undefined (the documents' fields: text)"),
    ({"data": "nowhere.jsonl"}, "dataset_kwargs.data_files: {dir}/nowhere.jsonl does not exist (a relative path is "
                                "relative to the task file)"),
])
def test_a_mistake_in_your_task_file_is_one_line_naming_the_file_and_key(trained_run, tmp_path, mistake, message,
                                                                         capsys):
    from zerolm.commands import main

    mine = task_directory(tmp_path / "tasks", **mistake)
    assert main(["eval", "--checkpoint", str(trained_run / "ckpt"), "--tasks", "mine", "--include-path", str(mine)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --tasks: mine: {mine / 'mine.yaml'}: {message.format(dir=mine)}"), err


def test_lm_eval_cli_checks_the_tasks_before_the_model_and_runs_quietly(trained_run, tmp_path):
    """python -m zerolm.lm_eval_cli: a misspelled task is zerolm eval's one line, before the model (here a
    checkpoint that does not exist) loads; a run outside a git checkout, its standard errors bootstrapped in
    the harness's process pool, says nothing of forking JAX or of git."""
    import subprocess
    import sys

    import runs

    cli = [sys.executable, "-m", "zerolm.lm_eval_cli", "--model", "zerolm", "--model_args"]
    env = {k: v for k, v in runs.env(2).items() if k != "DISABLE_MULTIPROC"}  # the harness's own default: a pool
    bad = subprocess.run([*cli, f"checkpoint={tmp_path / 'none'}", "--tasks", "zerolm_clozee"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr == (
        "error: --tasks: unknown task 'zerolm_clozee' (zerolm's: zerolm_cloze, zerolm_choice, zerolm_text; the "
        "harness's: `lm-eval ls tasks`; your own: --include_path DIR)\n")
    ok = subprocess.run([*cli, f"checkpoint={trained_run / 'ckpt'}", "--tasks", "zerolm_cloze", "--limit", "2"],
                        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "|zerolm_cloze|" in ok.stdout and "bootstrapping for stddev" in ok.stdout, ok.stderr
    assert "os.fork()" not in ok.stderr and "not a git repository" not in ok.stderr, ok.stderr


# eval.tasks during training: zerolm_cloze's first 4 documents at steps 8 and 16 (train.eval_every, the default
# of eval.every; the 16 steps' last is evaluated too), checkpoints every 4.
DURING = ["eval.tasks=zerolm_cloze", "eval.limit=4", "train.eval_every=8"]
CLOZE = {"tasks/zerolm_cloze/acc", "tasks/zerolm_cloze/perplexity"}


def task_rows(run_dir) -> dict[int, dict[str, float]]:
    """step -> its metrics.jsonl row of task metrics; each step has at most one."""
    rows: dict[int, dict[str, float]] = {}
    for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(key.startswith("tasks/") for key in record):
            assert record["step"] not in rows, f"step {record['step']}: two task rows"
            rows[record["step"]] = record
    return rows


@pytest.fixture(scope="module")
def tasks_run(tmp_path_factory):
    """An uninterrupted run with DURING (its task data cached afresh, as on a new machine), its task rows and
    what it wrote to stderr."""
    import runs

    run_dir = tmp_path_factory.mktemp("tasks")
    proc = runs.train(run_dir, *DURING, extra_env={"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf-datasets"))})
    return run_dir, task_rows(run_dir), proc.stderr


def test_a_run_with_eval_tasks_writes_the_eval_commands_numbers_at_its_steps(tasks_run):
    from zerolm.eval import downstream

    run_dir, rows, stderr = tasks_run
    # The run's own bar and lines say it: no progress bar of the harness's or datasets' ("Generating test split").
    assert "%|" not in stderr and "Generating" not in stderr, stderr[-2000:]
    assert sorted(rows) == [8, 16]
    assert set(rows[8]) == {"step", "tokens_seen", "tasks_s", *CLOZE} and rows[8]["tasks_s"] > 0
    zerolm("eval", "--checkpoint", run_dir / "ckpt" / "8", "--tasks", "zerolm_cloze", "--limit", "4")
    command = downstream.metrics(json.loads((run_dir / "ckpt" / "lm-eval-step8.json").read_text()))
    assert command == {key: rows[8][key] for key in CLOZE}
    assert rows[16]["tasks/zerolm_cloze/perplexity"] != rows[8]["tasks/zerolm_cloze/perplexity"]


def test_a_task_evaluation_stopped_by_sigterm_or_kill_9_resumes_with_one_row_per_evaluated_step(tasks_run, tmp_path):
    """SIGTERM during step 8's task evaluation: its row is written, the run saves step 9 and exits 75; kill -9
    during step 16's: no row, no checkpoint of 16 (the tasks run before its save); resumed, the run trains and
    evaluates step 16 again. The rows are the uninterrupted run's, each once."""
    import signal

    from runs import committed, losses, release, start_held, train
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.core.exitcodes import EXIT_PREEMPTED

    proc = start_held(tmp_path, *DURING, before_step=8, extra_env={"ZEROLM_TEST_HOLD_IN": "tasks"})
    proc.send_signal(signal.SIGTERM)
    release(tmp_path)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED
    assert Checkpoints(tmp_path / "ckpt", read_only=True).latest_step() == 9 and sorted(task_rows(tmp_path)) == [8]
    proc = start_held(tmp_path, *DURING, before_step=16, until=lambda: committed(tmp_path) and Checkpoints(
        tmp_path / "ckpt", read_only=True).latest_step() == 12, extra_env={"ZEROLM_TEST_HOLD_IN": "tasks"})
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sorted(task_rows(tmp_path)) == [8] and not list((tmp_path / "ckpt").glob("16*"))  # no save of 16 begun
    train(tmp_path, *DURING)
    untimed = lambda rows: {step: {k: v for k, v in row.items() if k != "tasks_s"} for step, row in rows.items()}
    assert untimed(task_rows(tmp_path)) == untimed(tasks_run[1])
    assert sorted(losses(tmp_path)) == list(range(1, 17))


def test_a_misspelled_task_stops_the_run_in_one_line_before_compiling(tmp_path, monkeypatch, capsys):
    from runs import SMALL
    from zerolm.commands import main
    from zerolm.train import opening

    def compiled(*args, **kwargs):
        raise AssertionError("compiled the step")

    monkeypatch.setattr(opening, "build_and_compile", compiled)
    sets = [*SMALL, f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'log'}", "eval.tasks=zerolm_clozee"]
    assert main(["train", "--config", str(TINY), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert err == ("error: eval.tasks: unknown task 'zerolm_clozee' (zerolm's: zerolm_cloze, zerolm_choice, "
                   "zerolm_text; the harness's: `lm-eval ls tasks`; your own: eval.include_path DIR)\n")


def test_ctrl_c_during_the_last_steps_task_evaluation_saves_that_step_and_exits_75_without_sampling(tmp_path):
    """Ctrl-C while the tasks of the run's last step (16) are evaluated: the evaluation ends and its row is
    written, step 16 is saved, the message names step 16 (there is no step 17), and the run exits 75 without
    its closing sample."""
    import signal

    from runs import release, start_held
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.core.exitcodes import EXIT_PREEMPTED

    proc = start_held(tmp_path, *DURING, "sample.tokens=4", before_step=16, extra_env={"ZEROLM_TEST_HOLD_IN": "tasks"})
    proc.send_signal(signal.SIGINT)
    release(tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert "stopping after step 16 " in err and "step 17" not in err
    assert "interrupted: checkpoint saved at step 16" in err
    assert "sample:" not in out
    assert Checkpoints(tmp_path / "ckpt", read_only=True).latest_step() == 16 and sorted(task_rows(tmp_path)) == [8, 16]
