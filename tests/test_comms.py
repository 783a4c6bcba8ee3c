"""zerolm comms: every collective of the compiled step, beside the planner's predicted bytes."""

import json

import jax
import pytest

from conftest import TINY, requires_devices
from runs import zerolm
from zerolm.compile import collectives as comms
from zerolm.data.dataset import load_planned

# n_layer 4: every parameter has an axis dp divides beside its tp axis (a blockified tp-split leaf, as at
# n_layer 2, adds small gathers the planner does not predict; see docs/zero-questions.md).
SETS = ["train.micro_batch_size=2"]


def compiled(*sets, step="zerolm"):
    return comms.report(load_planned(TINY, [*SETS, *sets], device_count=8), jax.devices()[:8], step)


def report(*sets, step="zerolm"):
    return compiled(*sets, step=step).to_json()


def rows(r, program, op, axes=None):
    return [c for c in r["collectives"] if (c["program"], c["op"]) == (program, op)
            and (axes is None or c["axes"] == axes)]


@requires_devices(8)
@pytest.mark.parametrize("grad_reduce,op", [("reduce_scatter", "reduce-scatter"), ("all_reduce", "all-reduce")])
@pytest.mark.parametrize("mesh", [("mesh.dp=8", "mesh.tp=1"), ("mesh.dp=4", "mesh.tp=2"),
                                  ("mesh.dp=4", "mesh.tp=2", "model.parallel_residual=true", "model.shared_norm=true")],
                         ids=["dp8", "dp4tp2", "dp4tp2-parallel-residual"])
def test_planned_gradient_reduction_bytes_are_what_the_compiled_step_does(grad_reduce, op, mesh):
    r = report(f"zero.grad_reduce={grad_reduce}", *mesh)
    assert r["accum_steps"] > 1
    found = rows(r, "grad", op, ["dp"])
    predicted = [p for p in r["predicted"] if (p["program"], p["op"], p["axes"]) == ("grad", op, ["dp"])]
    assert len(found) == len(predicted) == 1
    assert not found[0]["in_loop"]  # once per step, after the accumulation loop
    assert found[0]["bytes"] == found[0]["bytes_per_run"] == predicted[0]["bytes"]
    # Every prediction is met: the update's all-gather (summed over the axes the partitioner picked) and,
    # with tp, Megatron's activation all-reduces, 4 per layer (2 in GPT-J's parallel block), every micro-step.
    for p in r["predicted"]:
        assert (p["found_bytes"], p["found_bytes_per_step"]) == (p["bytes"], p["bytes_per_step"]), p
    if "mesh.tp=2" in mesh:
        tp = rows(r, "grad", "all-reduce", ["tp"])
        assert tp[0]["in_loop"] and tp[0]["bytes_per_run"] == tp[0]["bytes"] * r["accum_steps"] * 4  # × layers
        assert tp[0]["count"] == (2 if "model.parallel_residual=true" in mesh else 4)  # per layer (the scan's body)


@pytest.mark.slow
@requires_devices(8)
def test_naive_step_reduces_inside_the_loop_and_zerolms_outside():
    naive_report = compiled("mesh.dp=8", step="naive")
    naive = naive_report.to_json()
    reductions = rows(naive, "step", "all-reduce", ["dp"])
    assert reductions and all(c["in_loop"] for c in reductions)
    assert reductions[0]["bytes_per_run"] >= naive["predicted"][0]["bytes_per_step"]
    text = "\n".join(comms.describe_report(naive_report))
    assert "gradient reduction over dp: INSIDE the accumulation loop: every micro-step" in text

    ours = report("mesh.dp=8")
    dp_reductions = [c for c in ours["collectives"] if c["axes"] == ["dp"] and c["program"] == "grad"]
    assert dp_reductions and not any(c["in_loop"] for c in dp_reductions)


@pytest.mark.slow
def test_comms_cli_makes_the_fake_devices_it_needs():
    # One CPU device in the environment; the config asks for dp = 4.
    proc = zerolm("comms", "--config", TINY, *[a for s in [*SETS, "mesh.dp=4"] for a in ("--set", s)], "--json",
                  devices=1)
    r = json.loads(proc.stdout)
    assert (r["devices"], r["backend"], r["mesh"]) == (4, "cpu", {"dp": 4, "tp": 1})
    assert rows(r, "grad", "reduce-scatter", ["dp"])[0]["bytes"] == r["predicted"][0]["bytes"]
    text = zerolm("comms", "--config", TINY, "--devices", "2", devices=1).stdout
    assert "compiled for 2 cpu device(s)" in text and "once per step, after the accumulation loop" in text
    assert "equal" in text and "DIFFERENT" not in text


@pytest.mark.parametrize("args,message", [
    (["--devices", "0"], "--devices: 0 is not positive"),
    (["--set", "mesh.tp=3"], "mesh.tp: tp=3 does not divide model.n_head=4"),
    (["--set", "mesh.tp=2", "--step", "naive"], "--step naive: the naive baseline is data parallel only"),
    (["--set", "train.global_batch_size=30"], "train.global_batch_size: 30 is not divisible"),
])
def test_comms_bad_input_is_one_line_and_exit_2(args, message):
    proc = zerolm("comms", "--config", TINY, *args, expect=2)
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_replica_groups_are_read_in_each_printed_form_and_an_unknown_one_is_refused():

    def module(groups):
        return ("HloModule m\n\nENTRY %main (x: f32[8]) -> f32[8] {\n  %x = f32[8]{0} parameter(0)\n"
                f"  ROOT %ar = f32[8]{{0}} all-reduce(f32[8]{{0}} %x), channel_id=1, replica_groups={groups}, "
                "to_apply=%sum\n}\n")

    mesh = {"dp": 4, "tp": 2}
    for groups, axes in (("{{0,2,4,6},{1,3,5,7}}", ("dp",)), ("[4,2]<=[8]", ("tp",)), ("[2,4]<=[4,2]T(1,0)", ("dp",)),
                         ("{}", ("dp", "tp")), ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", ("dp",)),
                         ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", ("tp",)),
                         ("mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", ("dp", "tp")),
                         # devices in another order (as two processes' step prints it): mesh axis 2 is dp
                         ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", ("tp",)),
                         ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_2'}", ("dp",)),
                         ("mesh['axis_0'=4,'axis_1'=2], device_ids=([8]) {'axis_1'}", ("tp",))):
        (collective,) = comms.read(module(groups))
        assert comms.axis_of(collective, mesh) == axes, groups
    with pytest.raises(ValueError, match=r"^unknown replica-group format in the compiled HLO: replica_groups=mesh"):
        comms.read(module("mesh['axis_0'=4,'axis_1'=2] {'axis_0':(1)2}"))  # a sub-axis
