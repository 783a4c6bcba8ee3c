"""`zerolm compile`: the real TPU compiler (libtpu, ahead of time, no TPU) on the step of small configs."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from conftest import REPO, small_config
from zerolm import plan
from zerolm.compile import aot
from zerolm.core.exitcodes import EXIT_DOES_NOT_FIT, EXIT_USAGE
from zerolm.core.hardware import preset
from zerolm.model import decoder as gpt_model
from zerolm.model import losses
from zerolm.parallel import auto

pytestmark = pytest.mark.slow  # TPU compiles

TINY = REPO / "configs" / "tiny.yaml"
C125M = REPO / "configs" / "125m.yaml"


def compile_cmd(*args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "compile", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=900)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("name, topology, devices", [
    ("v3-8", "v3:2x2", 8), ("v3-32", "v3:4x4", 32), ("v2-512", "v2:16x16", 512), ("v4-8", "v4:2x2x1", 4),
    ("v4-64", "v4:2x4x4", 32), ("v5p-128", "v5p:4x4x4", 64), ("v5litepod-16", "v5e:4x4", 16),
    ("v5e-8", "v5e:2x4", 8), ("v6e-64", "v6e:8x8", 64), ("v5e-1", "v5e:1x1", 1)])
def test_targets_are_named_as_gcloud_names_them(name, topology, devices):
    target = aot.parse_target(name)
    assert (target.topology, target.devices) == (topology, devices)


@pytest.mark.parametrize("name", ["v3-7", "v4-2", "v9-8", "tpu", "v5p-12", "v3-0"])
def test_an_unknown_target_is_refused(name):
    with pytest.raises(aot.TargetError, match="valid ones look like v2-8, v3-8"):
        aot.parse_target(name)


def test_megacore_targets_give_one_device_per_chip():
    devices = aot.target_devices(aot.parse_target("v4-16"))
    assert len(devices) == 8 and len({d.id for d in devices}) == 8


@pytest.mark.parametrize("target, scatter, inner", [
    ("v3-8", "two_stage", 4), ("v3-32", "two_stage", 8), ("v4-8", "collective", None), ("v5p-8", "collective", None), ("v5e-8", "collective", None),
    ("v4-16", "two_stage", 4), ("v5p-64", "two_stage", 4), ("v5e-16", "two_stage", 4), ("v6e-64", "two_stage", 4)])
def test_auto_scatter_takes_two_stages_on_slices_beyond_one_host(target, scatter, inner):
    """zero.scatter=auto: two stages where the one-stage psum_scatter is an all-reduce of the whole (v2/v3;
    v4+ beyond one host's 4 or 8 chips), the second over a host's worth of dp positions (a v3 host: 8
    cores; one v3-8 host holds all of dp, so dp's largest proper divisor)."""
    from zerolm.parallel import auto
    from zerolm.parallel.mesh import make_mesh
    from zerolm.parallel.scatter import two_stage_inner

    devices = aot.target_devices(aot.parse_target(target))
    mesh = make_mesh(len(devices), 1, devices)
    assert auto.scatter("auto", mesh) == scatter
    assert inner is None or two_stage_inner(mesh) == inner


def test_two_stages_keep_blocks_of_part_tiles_a_reduce_scatter_beyond_one_host():
    """A stacked bfloat16 kernel whose dp blocks are 24 rows (125m's 768 over dp 32), compiled for v5p-64:
    the plain two stages make the second an all-reduce (the control: the check can see it), zerolm's
    `two_stage_reduce_scatter` (its 2-D form of whole-tile blocks) keeps both reduce-scatters."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from zerolm.compile import collectives as comms
    from zerolm.compile import hlo
    from zerolm.parallel.mesh import make_mesh
    from zerolm.parallel.scatter import two_stage_groups, two_stage_inner, two_stage_reduce_scatter

    devices = aot.target_devices(aot.parse_target("v5p-64"))
    dp = len(devices)
    mesh = make_mesh(dp, 1, devices)
    inner = two_stage_inner(mesh)

    def plain(x):
        for groups in two_stage_groups(dp, inner):
            x = lax.psum_scatter(x, "dp", scatter_dimension=1, axis_index_groups=groups, tiled=True)
        return x

    x = jax.ShapeDtypeStruct((dp, 12, 24 * dp, 768), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp")))
    ops = {}
    for name, fn in (("plain", plain), ("zerolm", functools.partial(two_stage_reduce_scatter, axis=1, dp=dp,
                                                                    inner=inner))):
        step = jax.shard_map(lambda v, fn=fn: fn(v[0])[None], mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        ops[name] = [c.op for c in comms.read(hlo.compiled_text(jax.jit(step), x))]
    assert "all-reduce" in ops["plain"], ops
    assert ops["zerolm"].count("reduce-scatter") == 2 and "all-reduce" not in ops["zerolm"], ops


@pytest.mark.parametrize("target, attention", [("v3-8", "blockwise"), ("v5e-8", "pallas")])
def test_the_tpu_attentions_never_allocate_the_t_by_t_scores(target, attention):
    """A layer's loss gradient at 1024 positions (blocks of 128) compiled for a TPU core: XLA's attention
    allocates 1024 × 1024 scores; the blockwise (v3) and Pallas (v4+) attentions nothing of that size."""
    import re

    import jax
    import jax.numpy as jnp

    device = aot.target_devices(aot.parse_target(target))[0]
    on = jax.sharding.SingleDeviceSharding(device)
    found = {}
    for impl in ("xla", attention):
        cfg = small_config("model.n_layer=1", "model.d_model=128", "model.n_head=1", "model.seq_len=1024",
                           "model.attention_block=128", "model.dtype=bfloat16", "model.loss_chunk=256",
                           f"model.attention={impl}")
        model = gpt_model.GPT(auto.model_settings(cfg.model, auto.Where.of(device)))  # for the TPU core
        loss_fn = functools.partial(losses.lm_loss, model)
        abstract = jax.eval_shape(functools.partial(gpt_model.init_params, model), jax.random.key(0))
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), abstract)
        rows = jax.ShapeDtypeStruct((2, 1025), jnp.int32, sharding=on)
        text = jax.jit(jax.grad(loss_fn)).lower(params, rows).compile().as_text()
        found[impl] = (re.findall(r"\w+\[[\d,]*1024,1024\]", text), text.count('custom_call_target="tpu_custom_call"'))
    assert found["xla"][0], "XLA's attention should hold the T×T scores: the check would be blind"
    assert found[attention] == ([], 3 if attention == "pallas" else 0)  # Pallas: forward, dk/dv, dq kernels


@pytest.fixture(scope="module")
def v3_report():
    return json.loads(compile_cmd("--config", TINY, "--target", "v3-8", "--json").stdout)


def test_tiny_fits_a_v3_8_and_the_peak_follows_the_documented_rule(v3_report):
    r = v3_report
    assert r["fits"] is True and r["target"] == "v3-8" and r["devices"] == 8 and r["device_kind"] == "TPU v3"
    assert r["usable_bytes_per_device"] == int(15.48 * 2**30)  # the compiler's own figure for a v3 core
    assert preset("v3-core").usable == r["usable_bytes_per_device"]  # what `zerolm plan` checks against
    for p in r["programs"].values():
        assert p["error"] is None
        assert p["peak_bytes"] == (p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"] - p["alias_bytes"]
                                   + p["live_outside_bytes"])
    assert r["peak_bytes_per_device"] == max(p["peak_bytes"] for p in r["programs"].values())
    # The update takes the old parameters (whole on each device: reshard's argument) and the optimizer state
    # (grad's outside) donated: the new ones are written into their buffers, and nothing lives outside it.
    programs = r["programs"]
    assert programs["update"]["live_outside_bytes"] == 0
    assert programs["update"]["alias_bytes"] >= (programs["reshard"]["argument_bytes"]
                                                 + programs["grad"]["live_outside_bytes"])


def test_one_dp_reduction_per_step_outside_the_loop_on_tpu(v3_report):
    """v3 (zero.scatter=auto): the reduce-scatter in two stages, over dp(2/8) then dp(4/8), once."""
    assert v3_report["scatter"] == "two_stage" and v3_report["scatter_inner"] == 4
    reductions = [c for c in v3_report["collectives"] if c["program"] == "grad" and c["axes"] == ["dp"]
                  and c["op"] in ("all-reduce", "reduce-scatter", "collective-permute") and c["bytes"] > 1024]
    assert {(c["op"], *c["span"]) for c in reductions} >= {("reduce-scatter", "dp(2/8)"), ("reduce-scatter", "dp(4/8)")}
    assert not [c for c in reductions if c["op"] == "all-reduce" and c["bytes"] > 64 * 1024]
    assert not any(c["in_loop"] for c in reductions)
    assert not any(c["in_loop"] and "dp" in c["axes"] for c in v3_report["collectives"])


def test_zero_3_on_tpu_gathers_and_reduce_scatters_each_layer_in_the_loop_as_the_planner_counts():
    """tiny at zero.stage=3 on v3-8, 4 accumulation steps: the TPU compiler's schedule has each layer's
    all-gathers and its two-stage reduce-scatter inside the layers' loops, the embeddings' gather before them and
    their reduction after, no all-gather in the update; each one's bytes per step as the planner counts them
    (the TPU compiler states no trip count: zerolm.compile.hlo reads it off the loop's condition); and the planner's
    step peak not under the compiler's by more than its margin."""
    # Mixed precision, as the configs that need stage 3 ship: in fp32 with a bfloat16 compute dtype the TPU
    # compiler moves the cast before the gather and gathers half the bytes the planner counts.
    # Attention blocks of 32 positions: 4 query blocks of tiny's 128, whose key-block loops the compiler cannot count.
    r = json.loads(compile_cmd("--config", TINY, "--target", "v3-8", "--set", "zero.stage=3", "--set",
                               "zero.precision=mixed", "--set", "train.micro_batch_size=1", "--set",
                               "model.attention_block=32", "--json").stdout)
    assert (r["stage"], r["accum_steps"], r["scatter"]) == (3, 4, "two_stage")
    # The blockwise attention's key-block loops keep their name through libtpu: zerolm.compile.step_time counts them at
    # their mean trip count (tests/test_step_time.py checks the count), and no loop is left counted once.
    grad_flops = r["step_model"]["programs"]["grad"]
    assert r["attention"] == "blockwise" and grad_flops["triangular_loops"] >= 2 and grad_flops["unknown_loops"] == 0
    assert r["step_model"]["mfu"] is None or r["step_model"]["mfu"] <= 1
    over_dp = {(c["program"], c["op"], c["in_loop"]) for c in r["collectives"] if "dp" in c["axes"] and c["bytes"] > 64}
    assert over_dp >= {("grad", "all-gather", True), ("grad", "reduce-scatter", True), ("grad", "all-gather", False),
                       ("grad", "reduce-scatter", False)}
    assert not [c for c in r["collectives"] if c["program"] == "update" and c["op"] == "all-gather"]
    for p in (p for p in r["predicted"] if p["bytes"] > 4):  # not the loss's mean
        assert p["found_bytes_per_step"] is not None, p
        low = 1 - (p["within"] or 0.03)  # the blockified leaves' padding: a few percent, as at stage 1
        assert low * p["bytes_per_step"] <= p["found_bytes_per_step"] <= 1.03 * p["bytes_per_step"], p
    planned = json.loads(subprocess.run(
        [sys.executable, "-m", "zerolm.cli", "plan", "--config", str(TINY), "--device", "v3-core", "--dp", "8", "--set",
         "zero.stage=3", "--set", "zero.precision=mixed", "--set", "train.micro_batch_size=1", "--json"], capture_output=True, text=True, cwd=REPO,
        check=True).stdout)["zerolm_step"]
    assert planned["stage"] == 3 and planned["program"] == r["peak_program"] == "grad"
    assert planned["total_bytes"] * (1 + plan.SAFETY_MARGIN) >= r["peak_bytes_per_device"]
    # zero.tpu_async_collectives auto: libtpu's asynchronous collective fusion at stage 3 (zerolm.core.tpu_flags), each
    # layer's later gathers started before a matmul and done after it; off: libtpu's default, every one blocks.
    assert {"h/attn/c_proj", "h/mlp/c_fc"} <= {o for a in r["async_collectives"] if a["in_loop"]
                                               and "all-gather" in a["ops"] for o in a["overlaps"]}
    off = compile_cmd("--config", TINY, "--target", "v3-8", "--set", "zero.stage=3", "--set", "zero.precision=mixed",
                      "--set", "train.micro_batch_size=1", "--set", "zero.tpu_async_collectives=off").stdout
    assert "libtpu:" not in off and "between their start and done: 0 (every collective blocks until done)" in off


# The 125m config (mixed precision, as shipped) cut to 2 layers of 512 tokens: the shapes of the real
# model at a compile time a test can afford (about 40 s per target on 2 cores).
SMALL_125M = ["model.n_layer=2", "model.seq_len=512", "train.micro_batch_size=4", "model.remat=full"]


# v3-8: two stages and the blockwise attention; v5e-8: one stage and Pallas's (a v4 slice beyond one host runs
# the same two stages as v3: test_auto_scatter_takes_two_stages_on_slices_beyond_one_host).
@pytest.fixture(scope="module", params=[("v3-8", "v3-core", "two_stage"), ("v5e-8", "v5e", "collective")],
                ids=["v3-8", "v5e-8"])
def small_125m(request):
    target, preset, scatter = request.param
    sets = [a for s in SMALL_125M for a in ("--set", s)]
    report = json.loads(compile_cmd("--config", C125M, "--target", target, *sets, "--json").stdout)
    return report, preset, scatter


def test_mixed_precision_reduces_with_a_reduce_scatters_bytes_in_bfloat16(small_125m):
    """grad_reduce=reduce_scatter on the TPU compiler, as zero.scatter=auto runs it: v3 and a v4 slice beyond
    one host (v4-16) make a psum_scatter an all-reduce, so two stages of reduce-scatters over dp sub-groups
    there; one v5e host keeps the one-stage reduce-scatter.
    Each way no all-reduce of gradient size (the compiler all-reduces only the smallest leaves, biases and
    LayerNorm scales, a latency choice), once per step, outside any loop (8 accumulation steps), and the
    bytes the planner predicts for a bfloat16 reduction and all-gather."""
    r, _, scatter = small_125m
    assert r["fits"] and r["precision"] == "mixed" and r["accum_steps"] == 8 and r["scatter"] == scatter
    assert "reshard" not in r["programs"]
    grad = [c for c in r["collectives"] if c["program"] == "grad"]
    assert not [c for c in r["collectives"] if c["in_loop"]]
    reduced = [p for p in r["predicted"] if p["program"] == "grad" and p["op"] == "reduce-scatter"]
    assert [p["span"] for p in reduced] == ([["dp"]] if scatter == "collective" else [["dp(2/8)"], ["dp(4/8)"]])
    assert all(p["axes"] == ["dp"] for p in reduced)
    gradient = next(p for p in r["predicted"] if p["op"] == "all-gather")["bytes"]  # the whole bf16 gradient
    all_reduced = sum(c["bytes"] for c in grad if c["op"] == "all-reduce")
    assert all_reduced < 0.01 * gradient
    for p in reduced:  # the TPU pads some leaves' blocks and sends a part of one as a collective-permute
        assert p["found_bytes"] is not None, grad
        assert 0.97 * p["bytes"] <= p["found_bytes"] <= 1.03 * p["bytes"]
    gathered = next(p for p in r["predicted"] if p["op"] == "all-gather")
    assert 0.99 * gathered["bytes"] <= gathered["found_bytes"] <= gathered["bytes"]  # bfloat16: 2 bytes per param


def test_auto_attention_is_blockwise_on_v3_and_pallas_on_v4_and_later_inside_the_step(small_125m):
    """attention: auto, for the slice's devices: the step's grad program runs Pallas's kernels (inside the
    step's shard_map: the forward, its rerun under full remat, and the two backward kernels, once each in
    the layers' loop) on v4 and v5e, none on v3."""
    r, preset, _ = small_125m
    if preset == "v3-core":
        assert r["attention"] == "blockwise" and r["pallas_kernels"]["grad"] == 0
    else:
        assert r["attention"] == "pallas" and r["pallas_kernels"]["grad"] == 4


def test_the_step_model_counts_the_pallas_kernels_flops(small_125m):
    """On v5e the attention is Pallas's: the forward kernel (run twice under full remat) counted by its own cost
    estimate, the two backward kernels by the flash attention's formula (dK/dV 8, dQ 6 per B·H·T·T·dh), none left
    uncounted; the step's FLOPs per token then sit above the model's (the remat's rerun forward, the kernels'
    full T x T), where leaving the kernels out put them below."""
    r, preset, _ = small_125m
    if preset != "v5e":
        pytest.skip("the blockwise attention on v3 is counted by its dots (test_step_time.py)")
    grad, model = r["step_model"]["programs"]["grad"], r["step_model"]
    runs = r["accum_steps"] * 2  # 2 layers a micro-step
    assert grad["uncounted_kernels"] == 0 and grad["estimated_kernels"] == 4 * runs
    B, H, T, dh = 4, 12, 512, 64
    assert grad["kernels"] >= (2 * 4 + 8 + 6) * B * H * T * T * dh * runs
    assert 1.0 < model["flops_ratio"] < 1.25 and model["uncounted_kernels"] == 0


def test_the_planner_predicts_the_compiled_peak_within_its_margin(small_125m):
    """`zerolm plan`'s step peak (Planner.step_peak) against the compiler's: the same program, not under it by
    more than plan.SAFETY_MARGIN."""
    import argparse

    from zerolm.commands import plan as commands_plan

    r, preset, _ = small_125m
    parser = argparse.ArgumentParser()
    commands_plan.add_arguments(parser)
    sets = [a for s in SMALL_125M for a in ("--set", s)]
    planner = commands_plan.build(parser.parse_args(["--config", str(C125M), "--device", preset, "--dp", "8", *sets]))
    planned = planner.step_peak(4)
    assert planned["program"] == r["peak_program"] == "grad"
    # Never under by more than the margin that advice keeps; over, by what a 2-layer model's fixed parts
    # weigh against the counts fitted on 125m-1_3b (BENCHMARKS.md).
    assert 1 / (1 + plan.SAFETY_MARGIN) <= planned["total_bytes"] / r["peak_bytes_per_device"] <= 1.35


def test_a_step_that_does_not_fit_exits_with_its_own_code():
    proc = compile_cmd("--config", TINY, "--target", "v2-8", "--set", "model.d_model=2048", "--set", "model.n_layer=24",
                       "--set", "model.n_head=16", expect=EXIT_DOES_NOT_FIT)
    assert proc.stdout.strip().splitlines()[-1].startswith("DOES NOT FIT: peak ")
    assert "usable on TPU v2" in proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--target", "v3-33"], "error: --target: v3-33: no v3 slice has 33 cores; valid ones look like"),
    (["--target", "v3-8", "--set", "mesh.dp=4"], "error: mesh: dp × tp = 4 × 1 = 4 devices, but v3-8 has 8"),
    (["--target", "v3-8", "--set", "mesh.tp=4", "--set", "mesh.dp=4"], "error: mesh: dp × tp = 4 × 4 = 16 devices"),
])
def test_bad_input_is_one_line(args, message):
    proc = compile_cmd("--config", TINY, *args, expect=EXIT_USAGE)
    assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# The shipped 125m (no remat, 2048 tokens) cut to 2 layers, 32 sequences per rank on 8 devices.
SMALL_NO_REMAT = ["model.n_layer=2", "train.global_batch_size=256"]


def test_the_planners_advice_compiles_and_the_search_finds_the_compilers_largest():
    """`zerolm compile --largest-micro-batch` compiles the planner's advice, then up while it fits: 125m cut to
    6 layers on v5e-8 (64 sequences per rank) is advised a micro-batch the compiler fits, the search goes up to
    the compiler's largest, and the next one is refused (two compiles; the 12 layers took three, twice as long)."""
    r = json.loads(compile_cmd("--config", C125M, "--target", "v5e-8", "--set", "train.global_batch_size=512",
                               "--set", "model.n_layer=6", "--largest-micro-batch", "--json").stdout)
    assert r["target"] == "v5e-8" and r["per_rank"] == 64
    assert r["advised"] is not None and r["advised"] <= r["largest"] < 64
    assert r["compiled"][str(r["advised"])]["fits"] and r["compiled"][str(r["largest"])]["fits"]
    assert not r["compiled"][str(2 * r["largest"])]["fits"]


def test_the_search_walks_down_from_advice_the_compiler_refuses():
    """Were the compiler to refuse the advice, the search tries smaller micro-batches until one fits (here
    told by `known`, so nothing is compiled) and goes no further."""
    from zerolm.compile import micro_batch_search as advice

    target = aot.parse_target("v3-8")
    advised = advice.planned(str(C125M), SMALL_NO_REMAT, target, 8, 1)
    assert advised is not None and advised >= 4
    known = {b: {"peak_bytes": (9 if b <= advised // 4 else 20) * 2**30, "fits": b <= advised // 4,
                 "accum_steps": 32 // b} for b in (1, 2, 4, 8, 16, 32)}
    found = advice.search(str(C125M), SMALL_NO_REMAT, target, known=known)
    assert (found.advised, found.largest, set(found.compiled)) == (advised, advised // 4,
                                                                   {advised, advised // 2, advised // 4})
    assert f"largest micro-batch of 125m on v3-8 (dp 8, 32 sequences per rank): {advised // 4}" in \
        advice.describe(found)[0]


@pytest.mark.parametrize("target, attention, config", [("v3-8", "blockwise", TINY),
                                                       ("v5e-8", "pallas", TINY.parent / "tiny_llama.yaml")])
def test_a_document_masked_step_compiles_for_the_tpu_attentions(target, attention, config):
    """model.document_mask through the real step, compiled by libtpu for the attention `auto` takes there
    (the blockwise one on v3, Pallas's on v5e: the sweep found the blockwise one failing inside the step); on v5e
    in the Llama layout (Pallas's kernel takes the grouped key/value heads repeated; rotary positions restart)."""
    r = json.loads(compile_cmd("--config", config, "--target", target, "--set", "model.vocab_size=1024", "--set",
                               "model.document_mask=true", "--set", "model.document_positions=restart",
                               "--json").stdout)
    assert r["attention"] == attention and r["fits"]
    kernels = r["pallas_kernels"]["grad"]  # Pallas's forward, dk/dv and dq kernels
    assert kernels >= 3 if attention == "pallas" else kernels == 0
