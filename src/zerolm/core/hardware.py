"""The accelerators zerolm knows, in one table: what every other module asks about a device.

- `CHIPS`: each accelerator kind as JAX names its devices (`device_kind`): its platform, its peak dense
  bfloat16 FLOP/s per JAX device (zerolm.observe.mfu's MFU), and for TPUs the generation, JAX devices per chip,
  chips per host (zerolm.parallel.scatter's rule for slices beyond one host) and, from v4 on, one host's
  data-center network bandwidth (what Multislice's transfers between slices share: `dcn_bw`);
- `TPU_TYPES`: the Cloud TPU accelerator types (`v3-32`, `v5litepod-16`, ...) as libtpu describes their
  slices (zerolm.compile.aot), and `grid`, the chip grid of a slice;
- `PRESETS`: one device as the planner counts it (zerolm.plan): memory, peak, the links between devices.

Peaks are per *JAX device*: on TPU v2 and v3, JAX shows each of a chip's two TensorCores as a device, so
the per-core peak is half the chip's (dividing a per-chip peak by cores, or multiplying a per-core
throughput by chips, is how MFU above 100% gets reported). Bandwidths are one direction's bytes/s per
device, what a ring collective can push through: half the bidirectional figure the vendors quote.
Memories and bandwidths come from the cited pages; the latencies are not published figures but typical
ones (NCCL's per-collective launch cost and a per-hop cost of a few microseconds; TPU ICI hops about a
microsecond) and are marked as assumptions. Inside one "node" (`per_node` devices: a GPU server on
NVLink, or a whole TPU pod on ICI) a ring runs at `intra_bw`; a ring that spans nodes runs at the
slowest link, `inter_bw` (the NIC share of one GPU).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from zerolm.core.errors import ZerolmError

GB = 1e9
GiB = 2**30
_CLOUD_TPU = "https://cloud.google.com/tpu/docs/system-architecture-tpu-vm"


@dataclasses.dataclass(frozen=True)
class Chip:
    """An accelerator kind as JAX sees it."""

    kind: str  # a substring of JAX's device_kind ("TPU v3", "H100")
    platform: str  # "tpu" | "gpu"
    flops: float  # peak dense bf16 FLOP/s of one JAX device
    source: str
    generation: int | None = None  # TPU generation
    devices_per_chip: int = 1  # JAX devices per chip: 2 on TPU v2/v3 (a device per TensorCore)
    chips_per_host: int = 0  # TPU: chips one host of a slice holds
    # TPU v4 on: bytes/s, one direction, of one host's data-center network (its NICs), which its chips share; how
    # Multislice's slices reach each other (zerolm.compile.collectives.read_dcn). Sources at each row.
    dcn_host_bw: float | None = None


# The first match wins, so the more specific names come first.
CHIPS: tuple[Chip, ...] = (
    Chip("TPU v2", "tpu", 22.5e12, "Cloud TPU v2: 45 TFLOP/s per chip, 2 TensorCores = 2 JAX devices; " + _CLOUD_TPU,
         2, 2, 4),
    Chip("TPU v3", "tpu", 61.5e12, "Cloud TPU v3: 123 TFLOP/s per chip, 2 TensorCores = 2 JAX devices; " + _CLOUD_TPU,
         3, 2, 4),
    # DCN: Cloud TPU states none for v4; "DCN bandwidth is typically around 2.5e10 bytes / second per host"
    # (How to Scale Your Model, https://jax-ml.github.io/scaling-book/tpus/), i.e. 200 Gbit/s.
    Chip("TPU v4", "tpu", 275e12, "Cloud TPU v4: 275 TFLOP/s per chip (one megacore device); " + _CLOUD_TPU, 4, 1, 4,
         dcn_host_bw=25e9),
    # DCN: "Per-host NIC configuration: 2 x 100 Gbps NIC" (the v5e column of https://cloud.google.com/tpu/docs/v6e);
    # the v5e page's "Data center network bandwidth per Pod: 6.4 Tbps" is the same 200 Gbit/s for each of 32 hosts.
    Chip("TPU v5 lite", "tpu", 197e12, "Cloud TPU v5e: 197 TFLOP/s per chip; https://cloud.google.com/tpu/docs/v5e",
         5, 1, 8, dcn_host_bw=2 * 100e9 / 8),
    # DCN: "Data center network (DCN) bandwidth per chip (Gbps): 50" (https://cloud.google.com/tpu/docs/v5p), for the
    # 4 chips of a host 200 Gbit/s.
    Chip("TPU v5p", "tpu", 459e12, "Cloud TPU v5p: 459 TFLOP/s per chip; https://cloud.google.com/tpu/docs/v5p",
         5, 1, 4, dcn_host_bw=4 * 50e9 / 8),
    Chip("TPU v5", "tpu", 459e12, "Cloud TPU v5p: 459 TFLOP/s per chip; https://cloud.google.com/tpu/docs/v5p",
         5, 1, 4, dcn_host_bw=4 * 50e9 / 8),
    # DCN: "Per-host NIC configuration: 4 x 200 Gbps NIC" (https://cloud.google.com/tpu/docs/v6e; its "Data center
    # network bandwidth per Pod: 25.6 Tbps" is 800 Gbit/s for each of 32 hosts).
    Chip("TPU v6 lite", "tpu", 918e12, "Cloud TPU v6e: 918 TFLOP/s per chip; https://cloud.google.com/tpu/docs/v6e",
         6, 1, 8, dcn_host_bw=4 * 200e9 / 8),
    Chip("A100", "gpu", 312e12, "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16"),
    Chip("H100 PCIe", "gpu", 756e12, "NVIDIA H100 datasheet: 756 TFLOP/s dense BF16 (PCIe)"),
    Chip("H100", "gpu", 989e12, "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (SXM)"),
    Chip("H200", "gpu", 989e12, "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16 (SXM)"),
    Chip("B200", "gpu", 2250e12, "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU (4.5 sparse)"),
)


def chip(device_kind: str) -> Chip | None:
    """The table's row for a JAX device kind, or None (a CPU, an accelerator not in the table)."""
    return next((c for c in CHIPS if c.kind in device_kind), None)


def memory_limit(device) -> int | None:
    """The bytes the backend lets programs allocate on a `jax.Device` (its allocator's limit: a GPU's or
    TPU's), or None where it states none (CPU)."""
    stats = device.memory_stats()
    return stats.get("bytes_limit") if stats else None


def tpu_generation(device_kind: str) -> int | None:
    """The TPU generation of a JAX device kind ("TPU v3" → 3, "TPU v5 lite" → 5, "TPU7x" → 7), or of a
    preset's name ("v3-core" → 3); None for anything else."""
    m = re.match(r"tpu\s*v?(\d+)|v(\d+)", device_kind.strip().lower())
    return int(m.group(1) or m.group(2)) if m else None


def dcn_bw(device_kind: str) -> float | None:
    """One JAX device's share of its host's data-center network, bytes/s in one direction: the host's NICs
    (`Chip.dcn_host_bw`) over the JAX devices the host holds; None where the table has no figure (before TPU v4, GPUs)."""
    row = chip(device_kind)
    if row is None or row.dcn_host_bw is None:
        return None
    return row.dcn_host_bw / (row.chips_per_host * row.devices_per_chip)


def chips_per_host(device_kind: str) -> int:
    """Chips on one host of a TPU slice: 4, or 8 for the "lite" kinds (v5e, v6e)."""
    row = chip(device_kind)
    if row is not None and row.chips_per_host:
        return row.chips_per_host
    return 8 if "lite" in device_kind.lower() else 4


# --- Cloud TPU accelerator types ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TpuType:
    """A generation as gcloud names its accelerator types (`v3-32`) and libtpu describes its slices."""

    generation: str  # libtpu's: v2, v3, v4, v5e, v5p, v6e
    counts: str  # what N in `v3-N` counts: "cores" or "chips"
    chip_config: str  # libtpu's: default | megacore
    dims: int  # the chip grid's dimensions (2-D or 3-D torus)

    def devices(self, n: int) -> int:
        """JAX devices of a slice of N (cores or chips): v2/v3 show a device per core, the rest per chip."""
        return n if self.generation in ("v2", "v3") or self.counts == "chips" else n // 2


TPU_TYPES = {"v2": TpuType("v2", "cores", "default", 2), "v3": TpuType("v3", "cores", "default", 2),
             "v4": TpuType("v4", "cores", "megacore", 3), "v5p": TpuType("v5p", "cores", "megacore", 3),
             "v5e": TpuType("v5e", "chips", "default", 2), "v5litepod": TpuType("v5e", "chips", "default", 2),
             "v6e": TpuType("v6e", "chips", "default", 2)}


def grid(chips: int, dims: int) -> tuple[int, ...] | None:
    """A slice's chip grid as Cloud TPU builds it: 2-D x ≤ y ≤ 2x; 3-D from 2x2x1, z doubled to 2x2x4,
    then y, x, z in turn (v4-64 is 2x4x4, v4-128 4x4x4, v4-256 4x4x8). None: no such slice."""
    if chips < 1 or chips & (chips - 1):
        return None
    if dims == 2:
        x = 1 << (chips.bit_length() - 1) // 2
        return (x, chips // x)
    shape = [1, 1, 1] if chips == 1 else [2, 2, 1] if chips >= 4 else None
    if shape is None:
        return None
    order = iter([2, 2] + [1, 0, 2] * 10)
    while shape[0] * shape[1] * shape[2] < chips:
        shape[next(order)] *= 2
    return tuple(shape)


# --- NVIDIA GPUs as XLA's GPU compiler describes them ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuType:
    """A GPU `zerolm compile --target` compiles for: XLA's own description of it (a GpuTargetConfigProto in
    text form, from XLA's `xla/backends/gpu/target_config/specs/`, shipped in `zerolm/core/gpu_targets/`)."""

    name: str  # zerolm's target name: h100, h200, a100-80g, b200, ...
    spec: str  # the description's file name in zerolm/core/gpu_targets/
    preset: str | None  # the planner's device preset (PRESETS), if it has one

    def target_config(self) -> str:
        return (Path(__file__).parent / "gpu_targets" / self.spec).read_text()

    def memory(self) -> int:
        """The device's memory in bytes, as the description states it (`device_memory_size`)."""
        return self._number("device_memory_size")

    def memory_bandwidth(self) -> float:
        """The device memory's bandwidth in bytes/s, as the description states it (`memory_bandwidth`)."""
        return float(self._number("memory_bandwidth"))

    def _number(self, key: str) -> int:
        m = re.search(rf"{key}:\s*(\d+)", self.target_config())
        assert m, (self.spec, key)
        return int(m.group(1))


GPU_TYPES = {g.name: g for g in [
    GpuType("h100", "h100_sxm.txtpb", "h100"), GpuType("h100-pcie", "h100_pcie.txtpb", None),
    GpuType("h200", "h200.txtpb", "h200"), GpuType("a100-80g", "a100_sxm_80.txtpb", "a100"),
    GpuType("a100-80g-pcie", "a100_pcie_80.txtpb", None), GpuType("b200", "b200.txtpb", None)]}
GPUS_PER_HOST = 8  # an HGX/DGX server: the GPUs `zerolm compile --target h100-8` spreads dp over (NVLink)
# JAX's GPU allocator takes this share of the device's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise (JAX's "GPU memory allocation" page): what a step may use.
GPU_MEMORY_FRACTION = 0.75


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory JAX lets programs allocate: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        return float(value) if value else GPU_MEMORY_FRACTION
    except ValueError:
        raise UnknownDevice(f"XLA_PYTHON_CLIENT_MEM_FRACTION: {value!r} is not a number (JAX reads it as one, "
                            "e.g. 0.9)") from None


# --- The planner's device presets ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    platform: str  # "tpu" | "gpu": the attention and dtype zerolm picks there (zerolm.parallel.auto)
    memory: float  # bytes of device memory
    flops: float  # peak dense bf16 FLOP/s
    intra_bw: float  # bytes/s, one direction, between devices of a node
    inter_bw: float  # bytes/s, one direction, per device, between nodes
    per_node: int  # devices on the fast links
    base_latency: float  # s, once per collective (launch and synchronisation); an assumption
    intra_latency: float  # s per ring hop inside a node; an assumption
    inter_latency: float  # s per ring hop between nodes; an assumption
    source: str
    # Bytes one program may use, as the TPU compiler states it (zerolm.compile.aot.usable_bytes, libtpu 0.0.42.1):
    # what `zerolm compile` checks against. None (GPUs, whose memory is XLA's description of them, as the
    # GPU compiler's): memory × --memory-fraction, else JAX's allocator share (gpu_memory_fraction).
    usable: float | None = None
    # bytes/s, one direction, per device, between slices over the data-center network (Multislice; `dcn_bw`); None:
    # no Multislice (TPU v3, GPUs)
    dcn_bw: float | None = None

    def describe(self) -> str:
        return (f"{self.name}: {self.memory / GiB:.1f} GiB, {self.flops / 1e12:.1f} TFLOP/s bf16, links "
                f"{self.intra_bw / GB:.0f} GB/s within {self.per_node} devices and {self.inter_bw / GB:.1f} GB/s "
                f"beyond (one direction); latency {self.base_latency * 1e6:.0f} µs + {self.intra_latency * 1e6:.1f}"
                f"/{self.inter_latency * 1e6:.1f} µs per hop (assumed). Sources: {self.source}")


_TPU_DOCS = "https://cloud.google.com/tpu/docs/"
_GPU_LAT = dict(base_latency=10e-6, intra_latency=2e-6, inter_latency=5e-6)
_TPU_LAT = dict(base_latency=5e-6, intra_latency=1e-6, inter_latency=1e-6)


def _peak(kind: str) -> float:
    row = chip(kind)
    assert row is not None, kind
    return row.flops


def _dcn(kind: str) -> float:
    share = dcn_bw(kind)
    assert share is not None, kind
    return share


PRESETS: dict[str, Device] = {d.name: d for d in [
    # v3: 2 TensorCores per chip, each a JAX device with half the chip's 32 GiB HBM and 123 TFLOP/s; the
    # chip has 4 ICI links of 656 Gbit/s (Jouppi et al., CACM 63(7) 2020, "A Domain-Specific Supercomputer
    # for Training Deep Neural Networks"), shared by its two cores.
    Device("v3-core", "tpu", 16 * GiB, _peak("TPU v3"), 4 * 82e9 / 2 / 2, 4 * 82e9 / 2 / 2, 2048, **_TPU_LAT,
           source=_TPU_DOCS + "v3 (32 GiB, 123 TFLOP/s per chip); ICI per Jouppi et al. 2020", usable=16621523435),
    Device("v3-chip", "tpu", 32 * GiB, 2 * _peak("TPU v3"), 4 * 82e9 / 2, 4 * 82e9 / 2, 1024, **_TPU_LAT,
           source=_TPU_DOCS + "v3 (32 GiB, 123 TFLOP/s per chip); ICI per Jouppi et al. 2020",
           usable=2 * 16621523435),
    # v4: one megacore JAX device per chip; ICI 2400 Gbit/s per chip (6 links of the 3D torus; Jouppi et al.,
    # ISCA 2023, "TPU v4: An Optically Reconfigurable Supercomputer"), the convention in which the v5e and
    # v5p docs' 1600 and 4800 Gbit/s are half their bidirectional GB/s: so 300 GB/s one direction.
    Device("v4", "tpu", 32 * GiB, _peak("TPU v4"), 300e9, 300e9, 4096, **_TPU_LAT,
           source=_TPU_DOCS + "v4 (32 GiB, 275 TFLOP/s per chip); ICI per Jouppi et al. 2023", usable=33017561088,
           dcn_bw=_dcn("TPU v4")),
    Device("v5e", "tpu", 16 * GiB, _peak("TPU v5 lite"), 400e9 / 2, 400e9 / 2, 256, **_TPU_LAT,
           source=_TPU_DOCS + "v5e (16 GiB, 197 TFLOP/s, ICI 400 GB/s bidirectional per chip, 256-chip pod)",
           usable=16911433728, dcn_bw=_dcn("TPU v5 lite")),
    Device("v5p", "tpu", 95 * GiB, _peak("TPU v5p"), 1200e9 / 2, 1200e9 / 2, 8960, **_TPU_LAT,
           source=_TPU_DOCS + "v5p (95 GiB, 459 TFLOP/s, ICI 1200 GB/s bidirectional per chip, 8960-chip pod)",
           usable=102800042229, dcn_bw=_dcn("TPU v5p")),
    Device("a100", "gpu", GPU_TYPES["a100-80g"].memory(), _peak("A100"), 600e9 / 2, 200e9 / 8, 8, **_GPU_LAT,
           source="NVIDIA A100 datasheet (80 GB SXM, 312 TFLOP/s bf16, NVLink 600 GB/s bidirectional); "
                  "DGX A100: one 200 Gbit/s HDR InfiniBand NIC per GPU"),
    Device("h100", "gpu", GPU_TYPES["h100"].memory(), _peak("H100"), 900e9 / 2, 400e9 / 8, 8, **_GPU_LAT,
           source="NVIDIA H100 datasheet (80 GB SXM, 989 TFLOP/s dense bf16, NVLink 900 GB/s bidirectional); "
                  "DGX H100: one 400 Gbit/s NDR InfiniBand NIC per GPU"),
    Device("h200", "gpu", GPU_TYPES["h200"].memory(), _peak("H200"), 900e9 / 2, 400e9 / 8, 8, **_GPU_LAT,
           source="NVIDIA H200 datasheet (141 GB SXM, 989 TFLOP/s dense bf16, NVLink 900 GB/s bidirectional); "
                  "DGX H200: one 400 Gbit/s NDR InfiniBand NIC per GPU"),
]}


class UnknownDevice(ZerolmError):
    """A --device that names no preset."""


def preset(name: str) -> Device:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownDevice(f"--device: unknown device kind {name!r}; presets: {', '.join(PRESETS)}") from None
