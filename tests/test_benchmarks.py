"""Every program in benchmarks/ runs, so that a change in zerolm that breaks one fails here, not in a reader's hands:
each answers --help (the unit tier), every `from zerolm... import NAME` in them resolves, and each runs end to end at
its smallest on CPU (`slow`: a tiny config, a few steps; a compile for a small slice), `RUNS` below or a test of
its own that checks more of what it wrote. benchmarks/README.md lists every program."""

import ast
import gzip
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, TINY
from xla_flags import cpu_flags

GROUPS = ("measure", "compiler", "experiments", "tools")
PROGRAMS = sorted(f"benchmarks.{p.parent.name}.{p.stem}" for g in GROUPS for p in (REPO / "benchmarks" / g).glob("*.py")
                  if p.name != "__init__.py")
# A small model for the experiments' training runs (each `zerolm train` a few seconds), after their own settings.
SMALL = [a for s in ("model.n_layer=1", "model.d_model=32", "train.eval_sequences=8", "train.global_batch_size=8",
                     "train.micro_batch_size=8") for a in ("--set", s)]
SMALL_YAML = "extends: {repo}/configs/tiny.yaml\nmodel:\n  n_layer: 1\n  vocab_size: 2048\n"


def run_module(module: str, *args: str, devices: int = 1, cwd=None, fast_compile: bool = True, timeout: int = 600,
               **env: str) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` as a user runs it, with the repository's root on PYTHONPATH so that any working
    directory will do; on `devices` fake CPU devices."""
    return run_python(["-m", module, *args], devices=devices, cwd=cwd, fast_compile=fast_compile, timeout=timeout, **env)


def run_python(args: list[str], devices: int = 1, cwd=None, fast_compile: bool = True, timeout: int = 600,
               **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(devices, fast_compile=fast_compile),
           "WANDB_MODE": "disabled", **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd or REPO, env=env,
                          timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


# --- every program: listed, --help, its imports ----------------------------------------------------------------

def test_every_program_is_listed_and_has_a_run():
    """benchmarks/README.md names each program; each has its small run below (RUNS, or a test named in ELSEWHERE)."""
    listed = set(re.findall(r"`((?:measure|compiler|experiments|tools)/\w+)\.py`", (REPO / "benchmarks" / "README.md").read_text()))
    assert {m.removeprefix("benchmarks.").replace(".", "/") for m in PROGRAMS} == listed
    assert sorted([*RUNS, *ELSEWHERE]) == PROGRAMS
    assert not set(RUNS) & set(ELSEWHERE)
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(ELSEWHERE.values()) <= tests


# Each program's `python -m MODULE --help`, all in one interpreter (runpy runs each as __main__, as `-m` does): one
# import of JAX for the 38 programs, not 38 (24 s of the suite on 2 cores, now a few).
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
answers = {}
for module in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        except BaseException:
            code, _ = "raised", traceback.print_exc(file=err)
    answers[module] = [code, out.getvalue(), err.getvalue()[-3000:]]
print(json.dumps(answers))
"""


def test_every_program_answers_help(tmp_path):
    answers = json.loads(ok(run_python(["-c", HELP_ALL, *PROGRAMS], cwd=tmp_path, timeout=300)))
    assert sorted(answers) == PROGRAMS
    wrong = {m: err or out[-300:] for m, (code, out, err) in answers.items() if code != 0 or not out.startswith("usage:")}
    assert wrong == {}




def test_every_zerolm_name_the_benchmarks_import_exists():
    """Every `from zerolm.x import NAME` in benchmarks/, at the top or inside a function, names what zerolm has
    (a run reaches the imports inside functions only on its own path)."""
    missing = []
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("zerolm", "benchmarks"):
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert missing == []


# --- the small runs ---------------------------------------------------------------------------------------------

# module -> (arguments, fake CPU devices, a line its output must hold); {tmp} is the test's directory, {small} a YAML
# of the tiny config at one layer and a fixed vocabulary.
RUNS = {
    "benchmarks.measure.checkpoint": (["--config", str(TINY), "--saves", "1", "--dir", "{tmp}/ckpt"], 1, "| restore |"),
    "benchmarks.measure.loader": (["--seq-len", "256", "--batch", "8", "--steps", "2", "--train-steps", "7"], 8,
                                  "| loader / training |"),
    "benchmarks.measure.prepare_scale": (["--sizes-gb", "0.002", "--parts", "0", "--workers", "1", "--dir", "{tmp}/corpus"],
                                         1, "| **ratio** |"),
    "benchmarks.measure.serve": (["--seconds", "0.5", "--clients", "1", "2", "--tries", "1", "--short-tokens", "16",
                                  "--train-steps", "2", "--decode-steps", "5"], 1,
                                 "| one row (--max-rows 1) | whole | 2 |"),
    "benchmarks.measure.step_clock": (["--devices", "1", "--steps", "3", "--warmup", "1"], 1, "| loop / step alone |"),
    "benchmarks.compiler.census": (["--target", "h100", "--config", "tiny", "--micro-batch", "1", "--variants",
                                    "plain", "--set", "model.vocab_size=2048"], 1, "| plain |"),
    "benchmarks.compiler.compile_time": (["--config", "tiny", "--targets", "cpu", "--micro-batch", "1", "--set",
                                          "model.vocab_size=2048"], 1, "| cpu | unrolled |"),
    "benchmarks.compiler.fastest": (["search", "--config", "{small}", "--target", "v3-8", "--stages", "1", "--remats",
                                     "none"], 1, "the fastest that fits"),
    "benchmarks.compiler.model_options": (["--targets", "v3-8", "--variants", "learned", "--set", "model.n_layer=1",
                                           "--set", "model.d_model=256", "--set", "model.vocab_size=2048"], 1,
                                          "| v3-8 | learned | blockwise |"),
    "benchmarks.compiler.multislice": (["--configs", "{small}", "--target", "v5e-8", "--slices", "2", "--global-batch",
                                        "32"], 1, "| small | 2 × v5e-8 | ZeRO over every device |"),
    "benchmarks.compiler.plan_memory": (["--micro", "1"], 1, "ratio"),
    "benchmarks.compiler.plan_vs_compile": (["--configs", "{small}", "--targets", "v3-8", "--settings", "1:full",
                                             "--cache", "{tmp}/cache.jsonl"], 1, "the planner's safety margin"),
    "benchmarks.compiler.step_time": (["--configs", "125m"], 1, "| 125m | none | 16 |"),
    "benchmarks.compiler.tp_layouts": (["--config", str(TINY), "--layouts", "4x2", "--global-batch", "8", "--micro-batch",
                                        "1", "--steps", "1"], 8, "| (4, 2) | grad | all-reduce | tp | in loop |"),
    "benchmarks.compiler.tpu_reduce_scatter": (["--targets", "v5e-8", "--two-stage", "--rows", "64", "--cols", "128"], 1,
                                               "reduce-scatter"),
    "benchmarks.compiler.zero_questions": (["--layers", "2"], 8, "4. the naive single jit"),
    "benchmarks.compiler.zero_stages": (["overlap", "--config", "tiny", "--target", "v3-8", "--set", "model.vocab_size=2048",
                                         "--set", "zero.stage=3"], 1, "| all-gather |"),
    "benchmarks.experiments.context_stages": (["--steps", "4", *SMALL], 1, "| split | 4 |"),
    "benchmarks.experiments.data_order": (["loader", "--seq-len", "256", "--batch", "8", "--steps", "2"], 8,
                                          "a v3-32 host consumes"),
    "benchmarks.experiments.document_mask": (["--config", str(TINY), "--steps", "4", *SMALL, "--out", "{tmp}/runs"], 1,
                                             "| document mask, positions restart |"),
    "benchmarks.experiments.extrapolation": (["--steps", "2", *SMALL], 1, "| alibi |"),
    "benchmarks.experiments.precision": (["--config", str(TINY), *SMALL, "--set", "train.steps=4", "--out", "{tmp}/runs"],
                                         1, "| mixed, bfloat16 accumulator |"),
    "benchmarks.experiments.wsd": (["--steps", "5", "--warmup", "1", *SMALL], 1, "1 - sqrt decay branch"),
    "benchmarks.tools.gcs_starts": (["--starts", "2", "--parallel", "1", "--burners", "0", "--clients", "0"], 1, ": 0 failed"),
}
# module -> the test below that runs it (and checks more of what it writes)
ELSEWHERE = {
    "benchmarks.measure.zero_step": "test_make_bench_runs_the_zero_step_benchmark",
    "benchmarks.measure.train_mfu": "test_train_mfu_runs_on_cpu_and_writes_its_table",
    "benchmarks.measure.torch_gpt": "test_torch_baseline_trains_the_config_shape_on_cpu",
    "benchmarks.measure.side_by_side": "test_gpu_session_side_part_dry_run_pairs_zerolm_with_pytorch_on_cpu",
    "benchmarks.measure.contamination": "test_contamination_scans_a_generated_corpus_and_writes_its_table",
    "benchmarks.measure.lm_eval_requests": "test_lm_eval_requests_times_a_trained_checkpoint",
    "benchmarks.experiments.attention_mask": "test_attention_mask_times_every_implementation_it_runs",
    "benchmarks.experiments.averaging": "test_averaging_runs_the_commands_and_writes_its_table",
    "benchmarks.tools.profile_summary": "test_profile_summary_sums_the_device_kernels_by_kind",
    "benchmarks.tools.suite_cpu": "test_suite_cpu_summarizes_a_log_by_file_test_and_command",
    "benchmarks.tools.figures": "test_figures_are_drawn_from_the_recorded_results",
}


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(RUNS))
def test_program_runs_small(module, tmp_path):
    args, devices, expected = RUNS[module]
    small = tmp_path / "small.yaml"
    small.write_text(SMALL_YAML.format(repo=REPO))
    args = [a.format(tmp=tmp_path, small=small) for a in args]
    # The compile studies read configs/ as the docs run them, from the root; the others write into their own directory.
    out = ok(run_module(module, *args, devices=devices, cwd=REPO if ".compiler." in module else tmp_path))
    assert expected in out, out[-3000:]


@pytest.mark.slow
def test_make_bench_runs_the_zero_step_benchmark(tmp_path):
    """`make bench` as the README gives it (its install step left out: this interpreter is installed), on a cut-down
    tiny model: each variant's row is timed."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    small = "--set model.n_layer=1 --set model.seq_len=32 --steps 1 --warmup 1"
    proc = subprocess.run(["make", "-s", "-C", str(REPO), "-o", f"{venv}/.installed", "bench", f"VENV={venv}",
                           f"BENCH_ARGS={small}"], capture_output=True, text=True, timeout=300)
    rows = [line.split("|")[1].strip() for line in ok(proc).splitlines() if line.startswith("| ")][1:]
    assert rows == ["all_reduce", "reduce_scatter", "naive"], proc.stdout


@pytest.mark.slow
def test_train_mfu_runs_on_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n\nkept text\n")
    ok(run_module("benchmarks.measure.train_mfu", "--configs", "tiny", "--seq-len", "64", "--vocab-size", "2048",
                  "--micro-batches", "2", "4", "--remat", "dots", "--steps", "5", "--warmup", "1", "--write", str(out),
                  cwd=tmp_path))
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept text\n") and "<!-- train_mfu:cpu:begin -->" in text
    assert "python -m benchmarks.measure.train_mfu --configs tiny" in text  # the command that made it, as a user runs it
    row = next(line for line in text.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["dots", "4"] and cells[6] == "—"  # largest micro-batch; no MFU without a known peak
    assert float(cells[4]) > 0 and float(cells[5].replace(",", "")) > 0


@pytest.mark.slow
def test_torch_baseline_trains_the_config_shape_on_cpu(tmp_path):
    """The PyTorch side of the GPU comparison runs and reports the same MFU count."""
    out = tmp_path / "torch.json"
    ok(run_module("benchmarks.measure.torch_gpt", "--config", "tiny", "--device", "cpu", "--no-compile", "--seq-len",
                  "64", "--vocab-size", "2048", "--micro-batch", "2", "--accum", "2", "--steps", "3", "--warmup", "1",
                  "--json", str(out), cwd=tmp_path, timeout=300))
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and result["mfu"] is None and 6 < result["loss"] < 9  # ~ln(2048) at init


@pytest.mark.slow
def test_attention_mask_times_every_implementation_it_runs(tmp_path):
    """On CPU, XLA's and the blockwise attention (cuDNN's on a GPU), masked and not: every row ran, was timed, and
    the masked ones say how far they are from the float32 reference (that they are close is
    tests/test_documents.py's check)."""
    out = tmp_path / "attn.jsonl"
    ok(run_module("benchmarks.experiments.attention_mask", "--batch", "2", "--seq-len", "256", "--heads", "2",
                  "--head-dim", "32", "--docs", "4", "--repeat", "2", "--json", str(out), cwd=tmp_path, timeout=300))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["implementation"], r["mask"]) for r in rows] == [("xla", True), ("xla", False), ("blockwise", True),
                                                                ("blockwise", False)]
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and not r["cudnn_fmha"] and len(r.get("errors", [])) == 4 * r["mask"]


@pytest.mark.slow
def test_averaging_runs_the_commands_and_writes_its_table(tmp_path):
    """A run, `zerolm average` twice, `zerolm eval` thrice; the final checkpoint's and the written EMA's eval repeat
    what the run logged at its end."""
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n")
    small = ["model.n_layer=1", "model.d_model=32", "model.seq_len=32", "train.global_batch_size=8",
             "train.micro_batch_size=8", "train.eval_sequences=16"]
    ok(run_module("benchmarks.experiments.averaging", "--steps", "4", "--every", "1", "--last", "3", "--ema", "0.5",
                  *[a for s in small for a in ("--set", s)], "--write", str(out), cwd=tmp_path))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in out.read_text().splitlines() if line.startswith("| ") and "val loss" not in line}
    assert list(rows) == ["final checkpoint", "LAWA, mean of the last 3", "EMA, decay 0.5"]
    assert rows["LAWA, mean of the last 3"][1] == "steps 2, 3, 4" and "16 validation sequences" in out.read_text()
    for name in ("final checkpoint", "EMA, decay 0.5"):
        assert abs(float(rows[name][2]) - float(rows[name][5])) <= 1e-4  # `zerolm eval` of it: what the run logged


@pytest.mark.slow
def test_contamination_scans_a_generated_corpus_and_writes_its_table(tmp_path):
    """At 1 MiB: the corpus generated and prepared, scanned with the shipped tasks (its words are theirs, its order
    random: nothing dirty), a row of tokens, speed and memory."""
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n")
    ok(run_module("benchmarks.measure.contamination", "--sizes-mb", "1", "--workers", "1", "--dir", str(tmp_path / "bench"),
                  "--write", str(out), cwd=tmp_path))
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 1 MiB |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[1].replace(",", "")) > 100_000 and cells[2] == "1" and cells[5].endswith("MiB")


@pytest.mark.slow
def test_lm_eval_requests_times_a_trained_checkpoint(trained_run, tmp_path):
    out = ok(run_module("benchmarks.measure.lm_eval_requests", "--checkpoint", str(trained_run / "ckpt"), "--docs", "2",
                        "--batch-size", "2", "--no-write", cwd=tmp_path))
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| zerolm_")]
    assert rows == ["zerolm_choice", "zerolm_cloze", "zerolm_text"], out


@pytest.mark.slow
def test_gpu_session_side_part_dry_run_pairs_zerolm_with_pytorch_on_cpu(tmp_path):
    """`DRY_RUN=1 bash benchmarks/measure/gpu_session.sh side`: both sides really train (the tiny config at tiny shapes,
    PyTorch uncompiled), zerolm then PyTorch twice, each pair's ratio printed; no nvidia-smi here is said, not
    fatal; the JSON lines, the tables between their markers, and the same tables again from the lines alone."""
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "XLA_FLAGS": cpu_flags(1),
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # python3: this interpreter
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "measure" / "gpu_session.sh"), "side", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0 and "part side done" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "log-side.txt").read_text()
    assert "nvidia-smi: not found" in log and "tiny pair 1: zerolm ÷ PyTorch" in log and "tiny pair 2: zerolm ÷ PyTorch" in log
    rows = [json.loads(line) for line in (out / "side.jsonl").read_text().splitlines()]
    assert [(r["pair"], r["side"]) for r in rows] == [(1, "zerolm"), (1, "pytorch"), (2, "zerolm"), (2, "pytorch")]
    for r in rows:
        assert r.get("error") is None and r["step_s"] > 0 and r["card_before"] is None and r["mfu"] is None, r
        assert r["global_batch"] == r["micro"] * r["accum"] == 4 and r["tokens_per_s"] == 4 * 64 / r["step_s"]
    assert {r["compile"] for r in rows} == {"XLA", "off"} and rows[1]["sdpa"] == "flash"
    table = (out / "side.md").read_text()
    assert table.startswith("<!-- side_by_side:cpu:begin -->\n`python -m benchmarks.measure.side_by_side --dry-run`")
    pairs = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| tiny |")]
    assert [p[1] for p in pairs] == ["1", "2"]
    for p, (z, t) in zip(pairs, [rows[0:2], rows[2:4]], strict=True):
        assert float(p[-1]) == round(z["tokens_per_s"] / t["tokens_per_s"], 3)
    again = tmp_path / "again"
    ok(run_module("benchmarks.measure.side_by_side", "--from", str(out / "side.jsonl"), "--out", str(again),
                  cwd=tmp_path, timeout=120))
    assert (again / "side.md").read_text() == table


# --- the tools, on inputs made here -----------------------------------------------------------------------------

def test_side_by_side_reads_the_cards_throttle_reasons_and_counters():
    """nvidia-smi's PERFORMANCE report, as drivers print it: the active reasons, and the counters (µs) in seconds."""
    from benchmarks.measure.side_by_side import performance, throttled

    report = """
GPU 00000000:00:1E.0
    Performance State                     : P0
    Clocks Event Reasons
        Idle                              : Not Active
        SW Power Cap                      : Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Not Active
        SW Thermal Slowdown               : Not Active
    Clocks Event Reasons Counters
        SW Power Capping                  : 9700000 us
        Sync Boost                        : 0 us
        SW Thermal Slowdown               : 172000000 us
        HW Thermal Slowdown               : 0 us
    Sparse Operation Mode                 : N/A
"""
    active, counters = performance(report)
    assert active == ["SW Power Cap"]
    assert counters == {"SW Power Capping": 9.7, "Sync Boost": 0.0, "SW Thermal Slowdown": 172.0, "HW Thermal Slowdown": 0.0}
    before = {"counters_s": {**counters, "SW Power Capping": 0.0}}
    assert throttled(before, {"counters_s": counters}) == {"SW Power Capping": 9.7}
    assert throttled(None, {"counters_s": counters}) is None


def test_profile_summary_sums_the_device_kernels_by_kind(tmp_path):
    """A trace as jax.profiler writes it: the GPU stream's complete events summed by kind, the host's left out."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "name": "nvjet_sm90_gemm", "ts": 0, "dur": 600},
              {"ph": "X", "pid": 1, "name": "cudnn_fmha_fwd", "ts": 600, "dur": 300},
              {"ph": "X", "pid": 1, "name": "loop_add_fusion", "ts": 900, "dur": 100},
              {"ph": "X", "pid": 2, "name": "nvjet_host_side", "ts": 0, "dur": 5000}]
    trace = tmp_path / "profile" / "plugins" / "host.trace.json.gz"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    out = ok(run_module("benchmarks.tools.profile_summary", str(tmp_path / "profile"), cwd=tmp_path, timeout=120))
    assert "3 kernels, 1.0 ms of kernel time over a 1.0 ms span" in out
    shares = dict(re.findall(r"^  (matmul|attention|fused elementwise)\s+[\d.]+ ms\s+([\d.]+%)", out, re.M))
    assert shares == {"matmul": "60.0%", "attention": "30.0%", "fused elementwise": "10.0%"}, out


def test_suite_cpu_summarizes_a_log_by_file_test_and_command(tmp_path):
    """The log its hook (benchmarks/tools/suite_cpu_hook/sitecustomize.py) writes, one line per Python process."""
    log = tmp_path / "processes.jsonl"
    records = [{"argv": ["pytest"], "test": None, "worker": "gw0", "user": 50.0, "sys": 5.0},
               {"argv": [".../zerolm/cli.py", "train"], "test": "tests/test_a.py::test_one (call)", "worker": "gw0",
                "user": 8.0, "sys": 1.0},
               {"argv": [".../zerolm/cli.py", "eval"], "test": "tests/test_a.py::test_two (call)", "worker": "gw1",
                "user": 3.0, "sys": 0.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = ok(run_module("benchmarks.tools.suite_cpu", "--log", str(log), cwd=tmp_path, timeout=120))
    assert "the pytest workers' own CPU: 55 s; the Python processes the tests started: 12 s (2 processes)" in out
    assert re.search(r"by test file:\n\s+12\.0  tests/test_a\.py", out) and re.search(r"by command:\n\s+9\.0  cli\.py train", out)


def test_figures_are_drawn_from_the_recorded_results(tmp_path):
    """benchmarks/tools/figures.py draws every figure into the test's directory from benchmarks/results/*.json, and
    what the H100 one plots is the JSON's: zerolm's current rows beside PyTorch's at the same config and micro-batch,
    MFU in one panel and peak memory in the other."""
    import matplotlib

    from benchmarks.tools import figures

    out = ok(run_module("benchmarks.tools.figures", "--out", str(tmp_path / "figures"), cwd=tmp_path, timeout=120))
    for name in figures.FIGURES_DRAWN:
        assert (tmp_path / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(tmp_path / "figures" / name) in out
    results = REPO / "benchmarks" / "results"
    mine = {(r["config"], r["micro_batch"]): r for s in json.loads((results / "train_h100.json").read_text())["sessions"]
            for r in s["rows"] if r["status"].startswith("current")}
    torch = [r for r in json.loads((results / "torch_h100.json").read_text())["rows"] if (r["config"], r["micro_batch"]) in mine]
    assert len(torch) == 3
    matplotlib.use("Agg")
    fig, _ = figures.pytorch_figure(figures.load("train_h100"), figures.load("torch_h100"))
    speed, memory = fig.axes
    expected_mfu = [100 * mine[(r["config"], r["micro_batch"])]["mfu"] for r in torch] + [100 * r["mfu"] for r in torch]
    expected_gib = [mine[(r["config"], r["micro_batch"])]["peak_gib"] for r in torch] + [r["peak_gib"] for r in torch]
    assert [round(b.get_height(), 6) for b in speed.patches] == [round(v, 6) for v in expected_mfu]
    assert [b.get_height() for b in memory.patches] == expected_gib
    labels = [t.get_text() for t in speed.texts]
    assert labels == [f"{v / 1e3:,.1f}k tok/s" for v in [mine[(r["config"], r["micro_batch"])]["tokens_per_s"] for r in torch]
                      + [r["tokens_per_s"] for r in torch]]


def test_benchmarks_md_opens_with_the_table_the_recorded_results_make():
    """BENCHMARKS.md's "Where zerolm stands" is what benchmarks/tools/figures.py renders from benchmarks/results/
    today (a figure typed in by hand, or a result recorded but not drawn, fails here), it comes first, holds at most
    15 rows, and every section a row, or the file's list of sections, links to is one of its headings."""
    from benchmarks.tools import figures

    text = (REPO / "BENCHMARKS.md").read_text()
    block = text[text.index(figures.BEGIN) + len(figures.BEGIN):text.index(figures.END)].strip("\n").splitlines()
    assert block == figures.table(figures.rows())
    assert len(block) - 2 <= 15 and re.search(r"^## (.+)$", text, re.M).group(1) == "Where zerolm stands"
    headings = {figures.slug(h) for h in re.findall(r"^#{2,4} (.+)$", text, re.M)}
    anchors = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert anchors and anchors <= headings, sorted(anchors - headings)


def test_the_readme_shows_four_of_those_rows_and_links_the_rest():
    from benchmarks.tools import figures

    text = (REPO / "README.md").read_text()
    block = text[text.index(figures.BEGIN) + len(figures.BEGIN):text.index(figures.END)].strip("\n").splitlines()
    front = [r for r in figures.rows() if r.front]
    assert len(front) == 4 and block == figures.table(front, "BENCHMARKS.md")
    assert "(BENCHMARKS.md#where-zerolm-stands)" in text and text.index(figures.BEGIN) < text.index("## Train")
