"""Device mesh construction. The mesh axis names are defined here, once."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

from zerolm.core.errors import ZerolmError, first_line
from zerolm.core.exitcodes import EXIT_PEER_LOST

T = TypeVar("T")

SLICE = "slice"  # across TPU slices (the data-center network): batch rows only, the ZeRO state replicated
DP = "dp"  # data parallel inside a slice: batch rows and the ZeRO optimizer-state shards
TP = "tp"  # tensor parallel: attention heads and the MLP width (Megatron), see zerolm.parallel.sharding


def make_mesh(dp: int, tp: int = 1, devices: Sequence[jax.Device] | None = None, slices: int = 1) -> Mesh:
    """A (dp, tp) mesh; with several slices a (slice, dp, tp) one, each slice's (dp, tp) laid out on that slice's
    devices alone (`slice_groups`), so that dp and tp never cross a slice. Auto axis types, so jit's sharding
    propagation (the reshard and update) works."""
    devices = list(devices) if devices is not None else jax.devices()
    if slices * dp * tp != len(devices):
        raise ValueError(f"mesh {'' if slices == 1 else 'slices × '}dp × tp = "
                         f"{'' if slices == 1 else f'{slices} × '}{dp} × {tp} needs {slices * dp * tp} devices, "
                         f"got {len(devices)}")
    if slices == 1:
        found = {d.slice_index for d in devices if hasattr(d, "slice_index")}
        if len(found) > 1:  # dp would cross the slices: every ZeRO collective over the data-center network
            raise SliceError(f"mesh.slices: 1, but the devices are in {len(found)} slices (Multislice); set "
                             f"mesh.slices to {len(found)}: dp and tp stay inside a slice")
        return jax.make_mesh((dp, tp), (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
    grids = [jax.make_mesh((dp, tp), (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto), devices=group).devices
             for group in slice_groups(devices, slices)]
    return Mesh(np.stack(grids), (SLICE, DP, TP), axis_types=(AxisType.Auto,) * 3)


class SliceError(ZerolmError):
    """The devices cannot be grouped into `mesh.slices` slices: one line naming the key."""


def slice_groups(devices: Sequence[jax.Device], slices: int) -> list[list[jax.Device]]:
    """The devices of each slice, in slice order. A TPU device knows its slice (`slice_index`, Multislice; a TPU
    of one slice has no `slice_index` in the compiler's description and 0 on a VM);
    elsewhere (CPU, GPU: a test or a cluster taken as slices) the processes in order, in `slices` equal
    consecutive groups (`zerolm launch-local --slices N` starts them so, each told its slice in
    MEGASCALE_SLICE_ID as a TPU VM of slice N is), or, in one process, its devices in equal consecutive groups."""
    if all(d.platform == "tpu" and hasattr(d, "slice_index") for d in devices):  # (a CPU device's is always 0)
        found = sorted({d.slice_index for d in devices})
        if len(found) != slices:
            raise SliceError(f"mesh.slices: {slices}, but the devices are in {len(found)} slice(s) "
                             f"({', '.join(map(str, found))}); set mesh.slices to {len(found)}")
        groups = [[d for d in devices if d.slice_index == index] for index in found]
    else:
        processes = sorted({d.process_index for d in devices})
        if len(processes) > 1:
            if len(processes) % slices:
                raise SliceError(f"mesh.slices: {slices} slices do not divide the run's {len(processes)} processes "
                                 "(each slice is a whole number of processes)")
            per = len(processes) // slices
            groups = [[d for d in devices if processes.index(d.process_index) // per == k] for k in range(slices)]
            _check_told_slice(processes, per)
        else:
            per = len(devices) // slices
            ordered = sorted(devices, key=lambda d: d.id)
            groups = [ordered[k * per:(k + 1) * per] for k in range(slices)]
    if len({len(g) for g in groups}) != 1:
        raise SliceError(f"mesh.slices: the {slices} slices hold different numbers of devices "
                         f"({', '.join(str(len(g)) for g in groups)})")
    return groups


def _check_told_slice(processes: list[int], per: int) -> None:
    """A process told its slice (MEGASCALE_SLICE_ID, as a TPU VM of that slice and `zerolm launch-local --slices`
    are) must be in that slice's group of consecutive processes."""
    import os

    told, me = os.environ.get("MEGASCALE_SLICE_ID"), jax.process_index()
    if told is not None and me in processes and told.strip().isdigit() and int(told) != processes.index(me) // per:
        raise SliceError(f"mesh.slices: process {me} is told it is in slice {told} (MEGASCALE_SLICE_ID), but the "
                         f"slices are {len(processes) // per} groups of {per} consecutive processes: it would be in "
                         f"slice {processes.index(me) // per}")


def data_axes(mesh: Mesh | AbstractMesh) -> str | tuple[str, str]:
    """The mesh axes a batch's rows are split over: dp, or (slice, dp) with slices (slice-major: data rank
    slice · dp + dp index)."""
    return (SLICE, DP) if SLICE in mesh.axis_names else DP


def data_ranks(mesh: Mesh | AbstractMesh) -> int:
    """How many ways a batch's rows are split: slices × dp."""
    return mesh.shape[DP] * mesh.shape.get(SLICE, 1)


def _coords(mesh: Mesh, process_index: int | None = None):
    """(mesh coordinate, device) for the devices of one process (default: this one)."""
    me = jax.process_index() if process_index is None else process_index
    return [(c, d) for c, d in np.ndenumerate(mesh.devices) if d.process_index == me]


def this_host_has_first(mesh: Mesh, axis: str | tuple[str, ...], process_index: int | None = None) -> bool:
    """Does this host hold a device at position 0 along every axis other than `axis` (one or several; docs/design.md,
    "Mesh helpers")?

    `this_host_has_first(mesh, data_axes(mesh))`: this host holds a tp = 0 device, so it is one that loads data.
    """
    axes = (axis,) if isinstance(axis, str) else axis
    others = [i for i, name in enumerate(mesh.axis_names) if name not in axes]
    return any(all(c[i] == 0 for i in others) for c, _ in _coords(mesh, process_index))


class _MeshSlicer:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def __getitem__(self, index) -> Mesh:
        index = index if isinstance(index, tuple) else (index,)
        # Integers would drop an axis; keep every axis so the names still line up.
        index = tuple(builtins.slice(i, i + 1) if isinstance(i, int) else i for i in index)
        return Mesh(self.mesh.devices[index], self.mesh.axis_names)


def submesh(mesh: Mesh) -> _MeshSlicer:
    """Index a mesh by axis positions: `submesh(mesh)[:1, :1]` is the first data and tensor rank."""
    return _MeshSlicer(mesh)


def is_first_host(mesh: Mesh) -> bool:
    """Does this host hold the mesh's first device (the first data and tensor rank, `submesh(mesh)[:1, :1]`)?
    That host prints, logs metrics and samples."""
    return submesh(mesh)[:1, :1].devices.flat[0].process_index == jax.process_index()


class HostReads(NamedTuple):
    """Whether a host reads training data from storage, and how many dp blocks of each batch it reads."""

    reads: bool
    dp_blocks: int


def host_reads(mesh: Mesh, process_index: int | None = None) -> HostReads:
    """What this host reads on a (dp, tp) mesh (docs/design.md, "Data on a (dp, tp) mesh").

    Only devices at tp = 0 are fed from storage; a host reads `micro_batch × accum × dp_blocks` rows of
    each step, one block per distinct data rank ((slice, dp) index) it holds at tp = 0. Hosts with none feed
    zeros and receive the real rows over the tp axis.
    """
    tp_axis = mesh.axis_names.index(TP)
    data = [i for i, name in enumerate(mesh.axis_names) if name != TP]
    blocks = len({tuple(c[i] for i in data) for c, _ in _coords(mesh, process_index) if c[tp_axis] == 0})
    return HostReads(blocks > 0, blocks)


class DistributedError(ZerolmError):
    """A multi-process run that cannot start: one line naming the flag or address at fault."""



# What JAX reports, in a process that lives on, when a peer process is gone: gloo's broken connection on
# CPU, the coordination service's heartbeat timeout or unavailable task, a NCCL communicator error.
_PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Gloo ", "heartbeat timeout",
                 "UNAVAILABLE", "NCCL", "CoordinationService", "Socket closed", "connect error")


def is_peer_failure(error: BaseException) -> bool:
    return jax.process_count() > 1 and any(marker in str(error) for marker in _PEER_FAILURE)


def exit_peer_lost(error: BaseException) -> None:
    """One line and exit EXIT_PEER_LOST, at once: JAX's own shutdown would wait on the dead peer at a
    barrier and then abort with a C++ stack dump. The run lock dies with the process; an unfinished
    save stays a temporary directory that the next run removes."""
    import os
    import sys

    first = first_line(error, 240)
    print(f"\nerror: process {jax.process_index()} lost a peer process of the run ({first}); the last complete "
          f"checkpoint stays the latest; exiting with code {EXIT_PEER_LOST} (restart the run to resume)",
          file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


@contextlib.contextmanager
def exit_if_a_peer_fails() -> Iterator[None]:
    """A peer process's failure raised inside stops this process at once (`exit_peer_lost`), before what encloses
    the block cleans up: a cleanup would wait on the dead peer. Anything else goes on as it is."""
    try:
        yield
    except Exception as e:
        if is_peer_failure(e):
            exit_peer_lost(e)
        raise


SHUTDOWN_LIMIT_S = 20


def bound_shutdown(limit_s: int = SHUTDOWN_LIMIT_S) -> None:
    """Leaving a multi-process run: JAX's distributed shutdown (at interpreter exit) waits for every
    peer at a barrier, and while JAX's preemption notifier owns SIGTERM a process waiting there for a
    dead peer ignores SIGTERM. So: SIGTERM back to its default (it ends the process), and the kernel
    ends it with SIGALRM if it is still there `limit_s` seconds from now. Call it last, on the way out."""
    import signal

    if jax.process_count() > 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(limit_s)


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None, *,
                           heartbeat_timeout_s: int = 10, init_timeout_s: int = 120) -> None:
    """Join a multi-process run. With no arguments on a TPU VM slice or SLURM, JAX detects the cluster;
    elsewhere (e.g. 127.0.0.1 in tests) pass all three. CPU collectives go through gloo.

    `heartbeat_timeout_s`: JAX's coordination service declares a process dead after this long without a
    heartbeat, and the others stop (JAX's default, 100 s, leaves a slice idle for minutes).
    `init_timeout_s`: how long to wait for the coordinator. JAX aborts from C++ when it cannot reach one,
    so a process other than 0 first waits for the coordinator's port itself, and says which address
    it could not reach."""
    if coordinator is None and num_processes is None and process_id is None:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s, initialization_timeout=init_timeout_s)
        return
    if coordinator is None or num_processes is None or process_id is None:
        raise DistributedError("--coordinator, --num-processes and --process-id go together (or use --distributed "
                               "on a TPU VM slice or under SLURM)")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"--coordinator {coordinator}: expected HOST:PORT, e.g. 127.0.0.1:12355")
    if num_processes < 1:
        raise DistributedError(f"--num-processes {num_processes}: must be at least 1")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id {process_id}: must be in 0 .. {num_processes - 1} (--num-processes)")
    if process_id == 0:
        _check_can_listen(int(port), coordinator)
    else:
        _wait_for_coordinator(host, int(port), coordinator, init_timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s, initialization_timeout=init_timeout_s)


def _check_can_listen(port: int, coordinator: str) -> None:
    import socket

    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(f"--coordinator {coordinator}: process 0 cannot listen on port {port} "
                                   f"({e.strerror}); pick a free port") from None


def _wait_for_coordinator(host: str, port: int, coordinator: str, timeout_s: int) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(f"--coordinator {coordinator}: not reachable within {timeout_s} s ({e.strerror or e}); "
                                       "is process 0 running there? (--init-timeout sets the wait)") from None
            time.sleep(0.5)


def on_process_0(fn: Callable[[], T], errors: tuple[type[Exception], ...]) -> T | None:
    """Run `fn` on process 0 alone (file-system work every process must agree on: locking, moving
    checkpoints). Returns its result there and None elsewhere; if it raised one of `errors`, every
    process raises it, with process 0's message, so that all of them stop together."""
    result, failure = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except errors as e:
            failure = e
    if jax.process_count() > 1:
        message = np.zeros(4096, np.uint8)
        if failure is not None:
            encoded = np.frombuffer(str(failure).encode()[:4095], np.uint8)
            message[:len(encoded)] = encoded
            message[-1] = next(i for i, kind in enumerate(errors) if isinstance(failure, kind)) + 1
        message = np.asarray(multihost_utils.broadcast_one_to_all(message))
        if failure is None and message[-1]:
            failure = errors[int(message[-1]) - 1](bytes(message[:-1]).rstrip(b"\0").decode(errors="replace"))
    if failure is not None:
        raise failure
    return result


def axis_share(name: str, spread: int, size: int) -> str:
    """A mesh axis, or the share of it one replica group covers: `dp`, `dp(4/32)`."""
    return name if spread == size else f"{name}({spread}/{size})"


def axis_names(labels) -> tuple[str, ...]:
    """The mesh axes of `axes_label`'s labels, whole or a share: ("dp(8/32)",) -> ("dp",)."""
    return tuple(label.split("(")[0] for label in labels)
