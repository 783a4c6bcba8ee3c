"""Model FLOPs utilisation: the model's FLOPs per token, and the peak of the device that runs them.

    MFU = (6·N + 12·L·d·T) · tokens/s per device / peak FLOP/s of one device

(PaLM, Chowdhery et al. 2022, appendix B.) N is the parameter count without the position
embeddings (the tied token embedding counts: it is the output matmul; an untied one does not, its lm_head
does: zerolm.model.decoder.count_params(matmul_only)). 6·N is the forward (2) and
backward (4) FLOPs of every weight matmul per token. 12·L·d·T is attention's own matmuls, QKᵀ and
A·V, forward and backward, counted over the full T×T score matrix as PaLM and most published MFU
figures do: a causal kernel skips about half of that work, so this is the convention, not the
kernel's true count. Rematerialisation is not counted (that would be hardware FLOPs utilisation).

Peaks are dense bfloat16 matmul rates per *JAX device*, from zerolm.core.hardware's table (per TensorCore on
TPU v2 and v3, where JAX shows each core as a device). A device not in the table has an unknown peak
and no MFU, rather than a guessed one.
"""

from __future__ import annotations

import dataclasses
import warnings

from zerolm.core.hardware import Chip, chip


def peak_for(device_kind: str) -> Chip | None:
    """The device's peak (`.flops`, with its `.source`), from zerolm.core.hardware's table; None if unknown."""
    return chip(device_kind)


def mfu(tokens_per_s_per_device: float, flops_token: float, device_kind: str) -> float | None:
    """MFU of one device, or None when its peak is unknown; warns above 100% (a wrong peak or count)."""
    peak = peak_for(device_kind)
    if peak is None:
        return None
    value = tokens_per_s_per_device * flops_token / peak.flops
    if value > 1:
        warnings.warn(f"MFU {value:.0%} exceeds 100% on {device_kind}: the peak ({peak.source}) or the "
                      "throughput is per the wrong unit (chips vs cores, per device vs total)", stacklevel=2)
    return value


@dataclasses.dataclass(frozen=True)
class Accounting:
    """A run's FLOP accounting: from tokens/s (all devices together) to per-device TFLOP/s and MFU."""

    flops_per_token: float
    devices: int
    device_kind: str

    @property
    def peak(self) -> Chip | None:
        return peak_for(self.device_kind)

    def __call__(self, tokens_per_s: float) -> dict[str, float]:
        per_device = tokens_per_s / self.devices
        values = {"model_tflops_per_device": per_device * self.flops_per_token / 1e12}
        value = mfu(per_device, self.flops_per_token, self.device_kind)
        if value is not None:
            values["mfu"] = value
        return values

    def describe(self) -> str:
        peak = self.peak
        head = f"model FLOPs {self.flops_per_token / 1e6:.1f} M/token (6·N + 12·L·d·T); "
        if peak is None:
            return head + (f"MFU: unknown peak for device kind {self.device_kind!r} (not in zerolm.core.hardware.CHIPS), so "
                           "only model_tflops_per_device is logged")
        return head + f"MFU against {peak.flops / 1e12:.1f} TFLOP/s per {self.device_kind} device ({peak.source})"
