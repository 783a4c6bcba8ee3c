"""`zerolm compile` for NVIDIA GPUs: XLA's own GPU compiler (the jax-cuda13 plugin), ahead of time, no GPU.

The step of small configs compiled for an H100 (and eight of them): its peak against JAX's share of the
GPU's memory, the exit codes, the layer loop's stacked activations counted in the compiled HLO, and
model.remat auto's choice by the compiled peak."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys

import pytest

from conftest import REPO
from zerolm.compile import aot, hlo
from zerolm.config.load import load_config
from zerolm.core.exitcodes import EXIT_DOES_NOT_FIT, EXIT_USAGE
from zerolm.core.hardware import GPU_TYPES
from zerolm.parallel.auto import REMAT_ORDER
from zerolm.parallel.build import SharedPrograms, build_and_compile, build_step, compile_step
from zerolm.parallel.mesh import make_mesh

pytestmark = pytest.mark.slow  # GPU compiles

TINY = REPO / "configs" / "tiny.yaml"
C1_3B = REPO / "configs" / "1_3b.yaml"
H100_BYTES = 84942979072  # XLA's description of the H100 SXM (device_memory_size)
# The tiny config in bfloat16, at a GPT-2 vocabulary's size class, four layers: compiles in seconds.
SMALL = ["model.vocab_size=1024", "model.n_layer=4", "model.seq_len=128", "model.dtype=bfloat16"]


def compile_cmd(*args, expect=0, **env):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "compile", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=600, env={**_env(), **env})
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the command needs no help to find none


@pytest.mark.parametrize("name, kind, devices", [("h100", "h100", 1), ("H100-8", "h100", 8), ("h100-pcie-2", "h100-pcie", 2),
                                                 ("a100-80g", "a100-80g", 1), ("b200-4", "b200", 4), ("h200", "h200", 1)])
def test_gpu_targets_are_one_host_of_n_gpus(name, kind, devices):
    t = aot.parse_target(name)
    assert (t.platform, t.generation, t.devices, t.topology) == ("gpu", kind, devices, f"1x1x{devices}")


@pytest.mark.parametrize("name, message", [("h300", "is not a TPU accelerator type or a GPU zerolm knows"),
                                           ("h100-9", "zerolm compiles for the GPUs of one host, 1 to 8")])
def test_an_unknown_gpu_target_is_refused(name, message):
    with pytest.raises(aot.TargetError, match=message):
        aot.parse_target(name)


def test_every_gpu_description_loads_and_states_its_memory():
    for gpu in GPU_TYPES.values():
        devices = aot.target_devices(aot.parse_target(gpu.name))
        assert devices[0].platform == "gpu" and gpu.memory() > 70e9, gpu.name


def test_a_small_config_compiled_for_an_h100_states_its_peak_and_fits():
    r = json.loads(compile_cmd("--config", TINY, "--target", "h100", *[a for s in SMALL for a in ("--set", s)],
                               "--json").stdout)
    assert r["device_kind"] == "NVIDIA H100 80GB HBM3" and r["devices"] == 1 and r["fits"]
    assert r["attention"] == "cudnn" and not r["scan_layers"]  # auto on a GPU: cuDNN, the layer loop unrolled
    assert r["usable_bytes_per_device"] == int(0.75 * H100_BYTES) and r["memory_fraction"] == 0.75
    grad = r["programs"]["grad"]
    assert grad["peak_bytes"] == (grad["argument_bytes"] + grad["output_bytes"] + grad["temp_bytes"]
                                  - grad["alias_bytes"] + grad["live_outside_bytes"])
    assert 0 < r["peak_bytes_per_device"] < 2**30
    # (and the Llama layout: cuDNN's attention takes the grouped key/value heads as they are)
    # (and the Llama layout: cuDNN's attention takes the grouped key/value heads as they are; and a staged context,
    # each stage's step compiled for its shapes: 128 tokens split into 4 rows of 32 per sample)
    half = json.loads(compile_cmd("--config", TINY.parent / "tiny_llama.yaml", "--target", "h100", "--set",
                                  "model.vocab_size=1024", "--set", "train.context_stages=[{steps: 10, seq_len: 32}]",
                                  "--json", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5").stdout)
    assert half["usable_bytes_per_device"] == int(0.5 * H100_BYTES) and half["attention"] == "cudnn" and half["fits"]
    (stage,) = half["contexts"]
    assert (stage["steps"], stage["seq_len"], stage["micro_rows"]) == ("1-10", 32, 4 * half["micro_batch"])
    assert stage["fits"] and 0 < stage["peak_bytes"] < 2**30


def test_eight_gpus_of_a_host_reduce_once_per_step_and_print_the_census():
    proc = compile_cmd("--config", TINY, "--target", "h100-8", "--set", "model.vocab_size=1024", "--census")
    lines = proc.stdout.splitlines()
    assert "mesh dp=8 × tp=1" in lines[0] and "attention cudnn" in lines[0]
    grad = next(line for line in lines if line.strip().startswith("grad:"))
    assert re.fullmatch(r"\s*grad: 1 all-reduce over dp \(4 B\) once per step; 1 reduce-scatter over dp \([\d.]+ [KM]iB\) "
                        r"once per step", grad), grad
    # The GPU compiler's reduce-scatter-start returns (operands, outputs): what it delivers is the outputs, the
    # planner's count exactly (read whole, it was 9 times that).
    assert re.search(r"reduce-scatter over dp: ([\d,]+) bytes per device per step; zerolm plan predicts \1 \(100.0%\)",
                     proc.stdout), proc.stdout
    assert any(line.startswith("bytes moved per step: ") for line in lines) and lines[-1].startswith("FITS: peak ")
    r = json.loads(compile_cmd("--config", TINY, "--target", "h100-8", "--set", "model.vocab_size=1024", "--census",
                               "--json").stdout)
    kinds = {row["kind"]: row for row in r["census"]["rows"]}
    # cuDNN's flash attention, forward and backward, once per layer and micro-step (nothing recomputed)
    assert kinds["custom-call __cudnn$fmhaSoftmax"]["executions"] == 4 * r["accum_steps"]
    assert kinds["custom-call __cudnn$fmhaSoftmaxBackward"]["executions"] == 4 * r["accum_steps"]
    assert r["census"]["bytes"] == sum(row["bytes"] for row in r["census"]["rows"]) > 0


def test_zero_2_on_gpus_reduces_each_layer_in_the_loop_of_a_scan():
    """zero.stage=2 on eight H100s: `scan_layers: auto` is a scan there (unrolled, the GPU compiler combined the
    layers' reduce-scatters into one after the whole backward pass), so the layers' reduce-scatters sit in the
    loop (the GPU compiler peels one of tiny's 4 iterations out of it), as many bytes as the planner counts."""
    r = json.loads(compile_cmd("--config", TINY, "--target", "h100-8", "--set", "model.vocab_size=1024", "--set",
                               "zero.stage=2", "--json").stdout)
    assert r["scan_layers"] is True and r["remat"] == "none"  # auto unrolls without remat at stage 1
    scatters = {p["in_loop"]: p for p in r["predicted"] if p["op"] == "reduce-scatter"}
    assert sum(p["found_bytes_per_step"] for p in scatters.values()) == sum(p["bytes_per_step"] for p in scatters.values())
    assert scatters[True]["found_bytes_per_step"] >= 3 / 4 * scatters[True]["bytes_per_step"]


def test_a_step_too_large_for_an_h100_exits_4():
    proc = compile_cmd("--config", C1_3B, "--target", "h100", "--set", "model.remat=none", "--set",
                       "train.micro_batch_size=64", "--set", "train.global_batch_size=128", expect=EXIT_DOES_NOT_FIT)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("DOES NOT FIT: peak ") and "of 59.33 GiB usable on NVIDIA H100 80GB HBM3" in last


def test_an_unknown_gpu_is_one_line_and_exit_2():
    proc = compile_cmd("--config", TINY, "--target", "h300", expect=EXIT_USAGE)
    assert proc.stderr.startswith("error: --target: 'h300' is not a TPU accelerator type or a GPU zerolm knows; "
                                  "valid ones look like v2-8") and len(proc.stderr.strip().splitlines()) == 1


def _stacked_zero_fills(text: str, n_layer: int, seq_len: int) -> list[str]:
    """Buffers of the accumulation loop that are stacked over the layers, hold activations (a dimension of
    seq_len tokens) and are filled with a constant (zeros) each time round: what a layer scan's
    backward pass reads its saved activations from."""
    program = hlo.program(text)
    comps, loops = program.computations, program.in_loop
    found = []
    for name in loops:
        for ins in comps.get(name, []):
            m = re.match(r"\w+\[([\d,]+)\]", ins.result)
            dims = [int(d) for d in m.group(1).split(",")] if m else []
            if len(dims) < 3 or dims[0] != n_layer or seq_len not in dims:
                continue
            fused = comps.get(c.group(1), []) if (c := re.search(r"calls=%?([\w.\-]+)", ins.attributes)) else []
            if ins.opcode == "broadcast" or (fused and fused[-1].opcode == "broadcast"
                                             and any(f.opcode == "constant" for f in fused)):
                found.append(ins.name)
    return found


def test_the_unrolled_layer_loop_holds_no_stacked_zero_filled_activations():
    """On an H100 the layers run unrolled (model.scan_layers: auto): nothing stacked is zero-filled every
    micro-step for the backward pass. The layers in a scan, the control, do it."""
    devices = aot.target_devices(aot.parse_target("h100"))
    found = {}
    for scan in ("auto", "true"):
        cfg = load_config(TINY, [*SMALL, f"model.scan_layers={scan}", "mesh.dp=1", "train.global_batch_size=4",
                                 "train.micro_batch_size=2"], device_count=1)
        _, zero, _ = build_step(cfg, make_mesh(1, 1, devices))
        text = compile_step(zero, 2, 128, 2).texts["grad"]
        found[scan] = _stacked_zero_fills(text, 4, 128)
    assert found["auto"] == [] and len(found["true"]) >= 4, found


@contextlib.contextmanager
def _compiles():
    """The names of the programs XLA compiles inside the block (JAX's compile log, read through its logger)."""
    names: list[str] = []

    class Names(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if (found := re.match(r"Finished XLA compilation of (\S+)", record.getMessage())) is not None:
                names.append(found.group(1))

    logger, handler = logging.getLogger("jax"), Names()
    logger.addHandler(handler)
    import jax

    with jax.log_compiles(True):
        yield names
    logger.removeHandler(handler)


def test_remat_auto_takes_the_least_recomputed_policy_that_fits():
    """model.remat auto compiles the policies in order until one fits; only the gradient's program depends on
    the policy, or on the micro-batch: the reshard and update programs compile once per policy search, and once
    per search of `zerolm compile` (SharedPrograms) whatever the micro-batches and policies it tries."""
    devices = aot.target_devices(aot.parse_target("h100"))
    mesh = make_mesh(1, 1, devices)
    cfg = {micro: load_config(TINY, [*SMALL, "model.remat=auto", "mesh.dp=1", "train.global_batch_size=32",
                                     f"train.micro_batch_size={micro}"], device_count=1) for micro in (8, 16)}
    shared = SharedPrograms()
    with _compiles() as first:
        assert build_and_compile(cfg[8], mesh, None, shared=shared).cfg.model.remat == "none"  # no limit: the first
    step = {"jit(grad_step)", "jit(to_views)", "jit(_update)"}  # the step's programs (not the setup's before them)
    assert sorted(n for n in first if n in step) == ["jit(_update)", "jit(grad_step)", "jit(to_views)"], first
    with _compiles() as each:
        every = build_and_compile(cfg[16], mesh, 1, shared=shared)  # nothing fits: each tried, the last taken
    assert list(every.tried) == list(REMAT_ORDER) and every.cfg.model.remat == "full"
    # another micro-batch, every policy: only the gradient's program compiled
    assert [n for n in each if n in step] == ["jit(grad_step)"] * len(REMAT_ORDER), each
    peaks = every.tried
    assert peaks["full"] < peaks["none"]
    # The first policy that needs less than none: a limit it just meets (two compiles, not five). On its own
    # (no search's programs given), remat auto still compiles the reshard and update programs once.
    first_below = next(r for r in REMAT_ORDER if peaks[r] < peaks["none"])
    limit = peaks[first_below]
    with _compiles() as alone:
        chosen = build_and_compile(cfg[16], mesh, limit)
    assert sorted(n for n in alone if n in step - {"jit(grad_step)"}) == ["jit(_update)", "jit(to_views)"], alone
    taken = chosen.cfg.model.remat
    assert peaks[taken] <= limit and all(peaks[r] > limit for r in REMAT_ORDER[:REMAT_ORDER.index(taken)])


def test_the_gpu_kernel_model_counts_the_steps_work_and_models_back_its_calibration():
    """zerolm.compile.gpu_time on a small step compiled for one H100 (no remat, layers unrolled, cuDNN's attention):
    its matmul kernels do the model's 6·N FLOPs per token (nothing recomputed), its attention kernels cuDNN's causal
    forward and backward (half of 4 + 10 B·H·T·T·dh per layer and micro-step), every kernel together step_time's
    count of the programs; calibrated on this step with a given split of a given time, it models that split back,
    and a card with twice the bandwidth and the same rates takes less time where bytes bound the kernels."""
    from zerolm.compile import gpu_time, step_time
    from zerolm.model.decoder import count_params

    devices = aot.target_devices(aot.parse_target("h100"))
    cfg = load_config(TINY, [*SMALL, "mesh.dp=1", "train.global_batch_size=4", "train.micro_batch_size=2",
                             "model.remat=none"], device_count=1)
    built = build_and_compile(cfg, make_mesh(1, 1, devices), None)
    assert built.cfg.model.attention == "cudnn" and not built.cfg.model.scan_layers
    texts = built.compiled.texts
    kernels = [k for text in texts.values() for k in gpu_time.kernels(text)]
    work = {c: sum(k.runs * k.flops for k in kernels if k.klass == c) for c in gpu_time.CLASSES}
    m, tokens = built.cfg.model, cfg.train.global_batch_size * cfg.model.seq_len
    assert work["matmul"] == pytest.approx(6 * count_params(built.zero.abstract_params, matmul_only=True) * tokens,
                                           rel=0.01)
    B, T, dh = cfg.train.micro_batch_size, m.seq_len, m.head_dim
    assert work["attention"] == (4 + 10) // 2 * B * m.n_head * T * T * dh * m.n_layer * cfg.accum_steps
    assert sum(work.values()) == sum(step_time.flops(text).total for text in texts.values())
    shares = {"matmul": 0.4, "attention": 0.2, "reduction": 0.25, "elementwise": 0.1, "copy": 0.05}
    present = {c: s for c, s in shares.items() if any(k.klass == c for k in kernels)}
    calibration = gpu_time.Calibration("tiny", (), 0.1, present, "this test")  # (above the bytes' floor)
    card = gpu_time.calibrate(texts, "h100", 989e12, 3.35e12, calibration)
    modeled = gpu_time.step(texts, card)
    for klass, share in present.items():
        assert modeled.seconds[klass] == pytest.approx(share * 0.1, rel=1e-3), klass
    wider = gpu_time.Card("wider", 989e12, 6.7e12, card.reached, "")
    assert gpu_time.step(texts, wider).seconds["reduction"] == pytest.approx(modeled.seconds["reduction"] / 2)
