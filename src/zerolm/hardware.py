"""What one accelerator offers the planner: memory, peak FLOP/s, and the links between devices.

A preset is one *device* as the planner counts them (as JAX counts them, except `v3-chip`, which is
two v3 TensorCores taken as one). Peaks are zerolm.mfu's (one table of peaks). Bandwidths are one
direction's bytes/s per device, what a ring collective can push through: half the bidirectional
figure the vendors quote. Memories and bandwidths come from the cited pages; the latencies are not
published figures but typical ones (NCCL's per-collective launch cost and a per-hop cost of a few
microseconds; TPU ICI hops about a microsecond) and are marked as assumptions; override them.

Inside one "node" (`per_node` devices: a GPU server on NVLink, or a whole TPU pod on ICI) a ring
runs at `intra_bw`; a ring that spans nodes runs at the slowest link, `inter_bw` (the NIC share of
one GPU).
"""

from __future__ import annotations

import dataclasses
import re

from zerolm.mfu import PEAKS

GB = 1e9
GiB = 2**30


def tpu_generation(device_kind: str) -> int | None:
    """The TPU generation in a JAX device kind ("TPU v3" → 3, "TPU v5 lite" → 5, "TPU7x" → 7), or in a
    preset's name ("v3-core" → 3); None for anything else. v2/v3 are the generations whose compiler turns a
    reduce-scatter into an all-reduce and whose Mosaic refuses Pallas's bfloat16 kernels."""
    m = re.match(r"tpu\s*v?(\d+)|v(\d+)", device_kind.strip().lower())
    return int(m.group(1) or m.group(2)) if m else None


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    memory: float  # bytes of device memory
    flops: float  # peak dense bf16 FLOP/s
    intra_bw: float  # bytes/s, one direction, between devices of a node
    inter_bw: float  # bytes/s, one direction, per device, between nodes
    per_node: int  # devices on the fast links
    base_latency: float  # s, once per collective (launch and synchronisation); an assumption
    intra_latency: float  # s per ring hop inside a node; an assumption
    inter_latency: float  # s per ring hop between nodes; an assumption
    source: str
    # Bytes one program may use, as the TPU compiler states it (zerolm.aot.usable_bytes, libtpu 0.0.42.1):
    # what `zerolm compile` checks against. None (GPUs): memory × the planner's --memory-fraction.
    usable: float | None = None

    def describe(self) -> str:
        return (f"{self.name}: {self.memory / GiB:.1f} GiB, {self.flops / 1e12:.1f} TFLOP/s bf16, links "
                f"{self.intra_bw / GB:.0f} GB/s within {self.per_node} devices and {self.inter_bw / GB:.1f} GB/s "
                f"beyond (one direction); latency {self.base_latency * 1e6:.0f} µs + {self.intra_latency * 1e6:.1f}"
                f"/{self.inter_latency * 1e6:.1f} µs per hop (assumed). Sources: {self.source}")


_TPU_DOCS = "https://cloud.google.com/tpu/docs/"
_GPU_LAT = dict(base_latency=10e-6, intra_latency=2e-6, inter_latency=5e-6)
_TPU_LAT = dict(base_latency=5e-6, intra_latency=1e-6, inter_latency=1e-6)

PRESETS: dict[str, Device] = {d.name: d for d in [
    # v3: 2 TensorCores per chip, each a JAX device with half the chip's 32 GiB HBM and 123 TFLOP/s; the
    # chip has 4 ICI links of 656 Gbit/s (Jouppi et al., CACM 63(7) 2020, "A Domain-Specific Supercomputer
    # for Training Deep Neural Networks"), shared by its two cores.
    Device("v3-core", 16 * GiB, PEAKS["TPU v3"].flops, 4 * 82e9 / 2 / 2, 4 * 82e9 / 2 / 2, 2048, **_TPU_LAT,
           source=_TPU_DOCS + "v3 (32 GiB, 123 TFLOP/s per chip); ICI per Jouppi et al. 2020", usable=16621523435),
    Device("v3-chip", 32 * GiB, 2 * PEAKS["TPU v3"].flops, 4 * 82e9 / 2, 4 * 82e9 / 2, 1024, **_TPU_LAT,
           source=_TPU_DOCS + "v3 (32 GiB, 123 TFLOP/s per chip); ICI per Jouppi et al. 2020",
           usable=2 * 16621523435),
    # v4: one megacore JAX device per chip; ICI 2400 Gbit/s per chip (6 links of the 3D torus; Jouppi et al.,
    # ISCA 2023, "TPU v4: An Optically Reconfigurable Supercomputer"), the convention in which the v5e and
    # v5p docs' 1600 and 4800 Gbit/s are half their bidirectional GB/s: so 300 GB/s one direction.
    Device("v4", 32 * GiB, PEAKS["TPU v4"].flops, 300e9, 300e9, 4096, **_TPU_LAT,
           source=_TPU_DOCS + "v4 (32 GiB, 275 TFLOP/s per chip); ICI per Jouppi et al. 2023", usable=33017561088),
    Device("v5e", 16 * GiB, PEAKS["TPU v5 lite"].flops, 400e9 / 2, 400e9 / 2, 256, **_TPU_LAT,
           source=_TPU_DOCS + "v5e (16 GiB, 197 TFLOP/s, ICI 400 GB/s bidirectional per chip, 256-chip pod)",
           usable=16911433728),
    Device("v5p", 95 * GiB, PEAKS["TPU v5p"].flops, 1200e9 / 2, 1200e9 / 2, 8960, **_TPU_LAT,
           source=_TPU_DOCS + "v5p (95 GiB, 459 TFLOP/s, ICI 1200 GB/s bidirectional per chip, 8960-chip pod)",
           usable=102800042229),
    Device("a100", 80 * GB, PEAKS["A100"].flops, 600e9 / 2, 200e9 / 8, 8, **_GPU_LAT,
           source="NVIDIA A100 datasheet (80 GB SXM, 312 TFLOP/s bf16, NVLink 600 GB/s bidirectional); "
                  "DGX A100: one 200 Gbit/s HDR InfiniBand NIC per GPU"),
    Device("h100", 80 * GB, PEAKS["H100"].flops, 900e9 / 2, 400e9 / 8, 8, **_GPU_LAT,
           source="NVIDIA H100 datasheet (80 GB SXM, 989 TFLOP/s dense bf16, NVLink 900 GB/s bidirectional); "
                  "DGX H100: one 400 Gbit/s NDR InfiniBand NIC per GPU"),
    Device("h200", 141 * GB, PEAKS["H200"].flops, 900e9 / 2, 400e9 / 8, 8, **_GPU_LAT,
           source="NVIDIA H200 datasheet (141 GB SXM, 989 TFLOP/s dense bf16, NVLink 900 GB/s bidirectional); "
                  "DGX H200: one 400 Gbit/s NDR InfiniBand NIC per GPU"),
]}


class UnknownDevice(ValueError):
    pass


def preset(name: str) -> Device:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownDevice(f"--device: unknown device kind {name!r}; presets: {', '.join(PRESETS)}") from None
