"""The benchmarks run end to end on CPU (tiny config), through `zerolm train`: the GPU MFU benchmark, the PyTorch
baseline, the attention mask and weight averaging."""

import os
import subprocess
import sys

import pytest

from conftest import REPO
from xla_flags import cpu_flags

pytestmark = pytest.mark.slow  # the benchmarks run end to end


def test_train_mfu_benchmark_runs_on_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n\nkept text\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(1)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.measure.train_mfu", "--configs", "tiny",
                           "--seq-len", "64", "--vocab-size", "2048", "--micro-batches", "2", "4", "--remat", "dots",
                           "--steps", "5", "--warmup", "1", "--write", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept text\n") and "<!-- train_mfu:cpu:begin -->" in text
    row = next(line for line in text.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["dots", "4"] and cells[6] == "—"  # largest micro-batch; no MFU without a known peak
    assert float(cells[4]) > 0 and float(cells[5].replace(",", "")) > 0


def test_torch_baseline_trains_the_config_shape_on_cpu(tmp_path):
    """The PyTorch side of the GPU comparison (benchmarks/measure/torch_gpt.py) runs and reports the same MFU count."""
    import json

    out = tmp_path / "torch.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.measure.torch_gpt", "--config", "tiny", "--device",
                           "cpu", "--no-compile", "--seq-len", "64", "--vocab-size", "2048", "--micro-batch", "2", "--accum", "2", "--steps", "3", "--warmup", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and result["mfu"] is None and 6 < result["loss"] < 9  # ~ln(2048) at init


def test_attention_mask_benchmark_checks_every_implementation_it_runs(tmp_path):
    """benchmarks/experiments/attention_mask.py on CPU (XLA's and the blockwise attention; cuDNN's on a GPU): the masked
    rows agree with the float32 reference, the unmasked ones are timed."""
    import json

    out = tmp_path / "attn.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(1)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.experiments.attention_mask", "--batch", "2",
                           "--seq-len", "256", "--heads", "2", "--head-dim", "32", "--docs", "4", "--repeat", "2",
                           "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["implementation"], r["mask"]) for r in rows] == [("xla", True), ("xla", False), ("blockwise", True),
                                                                ("blockwise", False)]
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and not r["cudnn_fmha"]
        if r["mask"]:
            assert max(r["errors"]) < 0.02, r  # bfloat16 inputs against float32


def test_averaging_benchmark_runs_the_commands_and_writes_its_table(tmp_path):
    """benchmarks/experiments/averaging.py: a run, `zerolm average` twice, `zerolm eval` thrice; the final checkpoint's and the
    written EMA's eval repeat what the run logged at its end."""
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n")
    small = ["model.n_layer=1", "model.d_model=32", "model.seq_len=32", "train.global_batch_size=8",
             "train.micro_batch_size=8", "train.eval_sequences=16"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(1)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.experiments.averaging", "--steps", "4", "--every", "1",
                           "--last", "3", "--ema", "0.5", *[a for s in small for a in ("--set", s)], "--write", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in out.read_text().splitlines() if line.startswith("| ") and "val loss" not in line}
    assert list(rows) == ["final checkpoint", "LAWA, mean of the last 3", "EMA, decay 0.5"]
    assert rows["LAWA, mean of the last 3"][1] == "steps 2, 3, 4" and "16 validation sequences" in out.read_text()
    for name in ("final checkpoint", "EMA, decay 0.5"):
        assert abs(float(rows[name][2]) - float(rows[name][5])) <= 1e-4  # `zerolm eval` of it: what the run logged


def test_contamination_benchmark_scans_a_generated_corpus_and_writes_its_table(tmp_path):
    """benchmarks/measure/contamination.py at 1 MiB: the corpus generated and prepared, scanned with the shipped tasks
    (its words are theirs, its order random: nothing dirty), a row of tokens, speed and memory."""
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.measure.contamination", "--sizes-mb", "1",
                           "--workers", "1", "--dir", str(tmp_path / "bench"), "--write", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 1 MiB |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[1].replace(",", "")) > 100_000 and cells[2] == "1" and cells[5].endswith("MiB")


def test_make_bench_runs_the_zero_step_benchmark(tmp_path):
    """`make bench`'s benchmark (benchmarks/measure/zero_step.py), on a cut-down tiny model: each variant's row is timed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(8)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.measure.zero_step", "--config",
                           str(REPO / "configs" / "tiny.yaml"), "--set", "model.n_layer=1", "--set", "model.seq_len=32",
                           "--steps", "1", "--warmup", "1"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows == ["all_reduce", "reduce_scatter", "naive"], proc.stdout


def test_gpu_session_side_part_dry_run_pairs_zerolm_with_pytorch_on_cpu(tmp_path):
    """`DRY_RUN=1 bash benchmarks/measure/gpu_session.sh side`: both sides really train (the tiny config at tiny shapes,
    PyTorch uncompiled), zerolm then PyTorch twice, each pair's ratio printed; no nvidia-smi here is said, not
    fatal; the JSON lines, the tables between their markers, and the same tables again from the lines alone."""
    import json

    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "XLA_FLAGS": cpu_flags(1),
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # python3: this interpreter
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "measure" / "gpu_session.sh"), "side", str(out)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
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
    proc = subprocess.run([sys.executable, "-m", "benchmarks.measure.side_by_side", "--from", str(out / "side.jsonl"),
                           "--out", str(again)], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / "side.md").read_text() == table


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
