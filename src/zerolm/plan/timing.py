"""Step time: compute at a share of the device's peak, and the collectives' ring (and tree) model.

Compute = (6·N + 12·L·h·s) FLOPs per token (zerolm.observe.mfu; 8·N + 16·L·h·s with full remat) over the
device's peak times the efficiency. A ring reduce-scatter or all-gather of S bytes over n devices takes
base + (n−1)·hop latency + (n−1)/n·S/bandwidth (an all-reduce twice the steps), hops between nodes at
the inter-node latency and the whole ring at the slowest link's bandwidth; the tree all-reduce (NCCL's
double binary tree) takes base + 2·⌈log2 n⌉·hop + 2·S/bandwidth (docs/design.md, "How long a step
takes"). zerolm's step reduce-scatters the gradients and all-gathers the parameters once per step, after
the accumulation loop (not overlapped). With overlap, the last micro-batch's backward pass would reduce
bucket by bucket: t_fwd + t_bwd(first bucket) + max(t_bwd(rest), t_comm(all buckets but the last)) +
t_comm(last bucket); the recommended bucket is the smallest for which the rest of the backward pass
covers the communication, else the fastest.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from zerolm.core.hardware import Device
from zerolm.plan.spec import Parallelism


def _span(device: Device, n: int, tp: int) -> tuple[int, float, float]:
    """(nodes a dp ring of n ranks spans, its bandwidth, its hop latency between nodes)."""
    nodes = -(-n * tp // device.per_node)
    return nodes, (device.inter_bw if nodes > 1 else device.intra_bw), device.inter_latency


def ring_time(device: Device, op: str, nbytes: float, n: int, tp: int = 1) -> float:
    """A ring reduce-scatter / all-gather (n−1 steps) or all-reduce (2(n−1)) of `nbytes` per device."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    passes = 2 if op == "all-reduce" else 1
    nodes, bw, inter_lat = _span(device, n, tp)
    inter_hops = nodes if nodes > 1 else 0
    hops = passes * (inter_hops * inter_lat + (n - 1 - inter_hops) * device.intra_latency)
    return device.base_latency + hops + passes * (n - 1) / n * nbytes / bw


def tree_time(device: Device, nbytes: float, n: int, tp: int = 1) -> float:
    """A pipelined (double binary) tree all-reduce: log-depth latency, 2·S/bandwidth transport."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes, bw, inter_lat = _span(device, n, tp)
    return device.base_latency + 2 * math.ceil(math.log2(n)) * (inter_lat if nodes > 1 else device.intra_latency) \
        + 2 * nbytes / bw


@dataclasses.dataclass(frozen=True)
class StepTime:
    micro_batch: int
    accum_steps: int
    compute_s: float
    tp_comm_s: float
    grad_comm_s: float  # the reduction after the loop (ring reduce-scatter; all-reduce for stage 0)
    param_gather_s: float  # the update's all-gather (stages 1, 2)
    grad_allreduce_ring_s: float
    grad_allreduce_tree_s: float
    bucket_bytes: int
    buckets: int
    overlapped_s: float  # the step with the bucketed reduction overlapping the last backward pass
    efficiency: float  # assumed share of peak while computing
    model_flops: float  # per device per step, zerolm.observe.mfu's count: no recomputation (what training logs)
    peak_flops: float  # of one device
    # Several slices: each device's block of the gradient (stage 0: all of it) all-reduced across them over the
    # data-center network, after the reduction inside the slice (`dcn_time`); its bytes per device
    dcn_s: float = 0.0
    dcn_bytes: int = 0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.grad_comm_s + self.param_gather_s + self.dcn_s

    def mfu(self, overlap: bool = False) -> float:
        """zerolm.observe.mfu's MFU, as training would log it at this step time: the model's FLOPs without the
        recomputation of remat (which the compute time does include) over the device's peak."""
        return self.model_flops / (self.peak_flops * (self.overlapped_s if overlap else self.step_s))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "step_s": self.step_s, "mfu": self.mfu(), "mfu_overlapped": self.mfu(True)}


def dcn_time(device: Device, nbytes: float) -> float:
    """Seconds to send `nbytes` per device to other slices over the data-center network, at the device's share of
    its host's NICs (`Device.dcn_bw`: the host's bytes/s, one direction, over the devices it holds; the host's figure
    is what Cloud TPU states, zerolm.core.hardware). The bytes are zerolm.compile.collectives' convention, each
    transfer's send operand (`LinkBytes.dcn`), charged once at that rate: no latency, nothing overlapped, and no ring
    factor (an ALL_REDUCE between 2 slices sends its operand once each way; over S slices a ring would send 2(S−1)/S
    of it)."""
    if nbytes <= 0:
        return 0.0
    if device.dcn_bw is None:
        raise ValueError(f"{device.name} states no data-center network bandwidth: its devices are not joined "
                         "across slices (Cloud TPU Multislice is TPU v4 and later)")
    return nbytes / device.dcn_bw


def bucketed(device: Device, op: str, grads: int, bwd: float, rest: float, layout: Parallelism) -> tuple[int, int, float]:
    """The bucketed reduction of the last micro-batch's backward pass (`bwd` seconds) overlapping the
    communication of `grads` bytes over `layout`'s dp (each device's share of tp), the rest of the step taking
    `rest`: (bucket bytes, buckets, step)."""
    comm = functools.partial(ring_time, device, op, n=layout.dp, tp=layout.tp)
    options = []
    size = 2**20
    while True:
        k = -(-grads // size)
        first = (k - 1) * comm(size)
        last = comm(grads - (k - 1) * size)
        step = rest - bwd + bwd / k + max(bwd * (k - 1) / k, first) + last
        options.append((size, k, step, bwd * (k - 1) / k >= first))
        if size >= grads:
            break
        size *= 2
    covered = [o for o in options if o[3] and o[1] > 1]
    size, k, step, _ = covered[0] if covered else min(options, key=lambda o: o[2])
    return size, k, step
