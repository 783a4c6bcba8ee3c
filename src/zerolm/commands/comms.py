"""`zerolm comms --config FILE`: every collective of the compiled training step, beside the planner's
prediction (zerolm.compile.collectives)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from zerolm.commands import print_report
from zerolm.core.errors import UsageError

if TYPE_CHECKING:
    import jax


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="a zerolm YAML config")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices to compile for (default: mesh.dp × mesh.tp; with mesh.dp auto, this machine's "
                             "accelerators, or 8 fake CPU devices)")
    parser.add_argument("--step", choices=("zerolm", "naive"), default="zerolm",
                        help="zerolm: the ZeRO step (zero.stage); naive: one plain jax.jit with the accumulation scan inside, "
                             "the baseline the design avoids (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _devices(wanted: int | None) -> list[jax.Device]:
    """`wanted` devices (None: the accelerators, or 8 fake CPU devices): real ones when there are enough."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", wanted or 8)
    real = jax.devices()
    if wanted is None:
        wanted = len(real) if real[0].platform != "cpu" else len(jax.devices("cpu"))
    if len(real) >= wanted:
        return real[:wanted]
    cpu = jax.devices("cpu")
    if len(cpu) < wanted:
        raise UsageError(f"--devices: {wanted} devices wanted, but only {len(cpu)} CPU devices can be made in this "
                         "process (XLA_FLAGS or JAX_NUM_CPU_DEVICES set fewer)")
    return cpu[:wanted]


def run(args: argparse.Namespace) -> int:
    from zerolm.compile import collectives as comms
    from zerolm.config.load import load_config
    from zerolm.data.dataset import load_planned

    if args.devices is not None and args.devices <= 0:
        raise UsageError(f"--devices: {args.devices} is not positive")
    cfg = load_config(args.config, args.set)
    wanted = args.devices or (cfg.device_count if cfg.mesh.dp != "auto" else None)
    devices = _devices(wanted)
    cfg = load_planned(args.config, args.set, device_count=len(devices))
    result = comms.report(cfg, devices, args.step)
    print_report(result, args.json, comms.describe_report)
    return 0
