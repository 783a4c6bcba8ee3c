"""Checkpoints with orbax: asynchronous, sharded, atomic, and restorable on another device count.

A checkpoint is a step directory written by an orbax CheckpointManager, holding two items:
  state  params, the dp-sharded optimizer state (each process writes its own shards) and the step
  meta   JSON: the resolved config, the dp it was saved on, the dataset/tokenizer identity, tokens
         seen, the last loss, the wandb run id, the time
Locally, orbax writes into a temporary directory and renames it when complete; on gs://, which has no
rename, it writes the step's directory in place and marks it complete with a last object,
`commit_success.txt`. Either way a save cut short by a crash is never listed, and what it left is
removed by the next run that locks the directory (`remove_unfinished`).

Damage after the fact (a truncated or deleted file, a disk that lost a block) is caught by
`verify`: once a save is durable, process 0 records the size of every file in it
(`zerolm_files.json`), and a checkpoint whose files no longer match, or whose metadata cannot be
read, is damaged. `--resume auto` moves a damaged checkpoint aside (`<dir>.damaged/`, never deleted)
and takes the newest intact one before it. A read that fails for another reason (out of memory, permission,
storage, a bug) is not damage and moves nothing: zerolm.checkpoint.errors tells which.

The data loader's position is not stored separately: the batch of step s is a pure function of
(seed, s) (see data/loader.py), so the step is the position.

Elastic restore: the optimizer state is saved in the ZeRO layout of the (dp, tp) it was trained on
(see sharding.Layout). Leaves split along an axis have the parameter's shape whatever the mesh is, and
restore straight into the new sharding. Leaves packed into dp·tp padded blocks change shape with the
mesh: they are restored whole and repacked (sharding.Table.restore_target decides which).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import absl.logging
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zerolm.checkpoint.compatible import check_compatible
from zerolm.checkpoint.errors import CheckpointError, DamagedCheckpoint, classified
from zerolm.checkpoint.meta import FORMAT, CheckpointMeta
from zerolm.core import storage
from zerolm.core.errors import first_line
from zerolm.parallel.sharding import with_shardings
from zerolm.parallel.zero import TrainState, Zero

SKIP = ocp.PLACEHOLDER  # a leaf of a restore target that is not read (`Checkpoints.restore_part`)
FILE_LIST = "zerolm_files.json"  # relative path -> bytes of every file of a durable checkpoint
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's marker of a local save not yet finalized
COMMIT_FILE = "commit_success.txt"  # orbax's marker of a finalized save on gs://


@contextlib.contextmanager
def quiet_orbax():
    """absl WARNING/INFO lines from orbax ("Given directory is read only" ...) say nothing to a user."""
    verbosity = absl.logging.get_verbosity()
    absl.logging.set_verbosity(absl.logging.ERROR)
    try:
        yield
    finally:
        absl.logging.set_verbosity(verbosity)


class SaveFailed(storage.StorageFault):
    """A checkpoint could not be written (a full disk, a lost permission, storage that stopped answering):
    the run must stop now, and the checkpoint before stays the latest (orbax finalizes a save only once it
    is complete)."""


def _free_space(directory: epath.Path) -> str:
    import shutil

    if storage.is_remote(directory):
        return f"the storage endpoint is {storage.endpoint()}"
    try:
        return f"{shutil.disk_usage(str(directory)).free / 2**20:,.1f} MiB free there"
    except OSError:
        return "free space unknown"


@functools.cache  # once per process
def _replica_parallel_for_large_arrays_only(min_bytes: int = 2**20) -> None:
    """orbax writes a replicated array (ZeRO-1's parameters) as one slice per replica, in parallel. Each
    slice is an op JAX compiles on first use, about 50 ms each: 4 s of a small model's first save spent
    on arrays that are written as fast whole. Slices of at least `min_bytes` only; orbax's own handler
    otherwise (its array metadata store, which restores PRNG keys, is kept). Quietly: orbax's "overriding
    jax.Array" warning says nothing to a user."""
    current = ocp.type_handlers.get_type_handler(jax.Array)
    with quiet_orbax():
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=min_bytes,
            array_metadata_store=getattr(current, "_array_metadata_store", None)), override=True)


class Checkpoints:
    """The checkpoints of one run directory (local path or gs://)."""

    def __init__(self, directory: str | epath.Path, *, keep: int = 3, keep_every: int | None = None,
                 read_only: bool = False):
        self.directory = _path(directory)
        if storage.is_remote(self.directory):
            storage.quiet_tensorstore_credentials(str(self.directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_every, create=not read_only, read_only=read_only,
            enable_async_checkpointing=True)
        _replica_parallel_for_large_arrays_only()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._unrecorded: list[int] = []  # saves whose file list is written once they are durable
        self._failed = False  # a save failed (SaveFailed raised): nothing more to wait for
        self._closed = False
        # Raises StorageFault once the storage is known to have failed (the run lock's lease could not be
        # renewed): a wait for a save in flight stops then, instead of for as long as the clients retry.
        self.health: Callable[[], None] = lambda: None

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: CheckpointMeta, *, wait: bool = False) -> None:
        """Start an asynchronous save; the step continues while it is written."""
        step = meta.step
        if self._unrecorded:
            self.wait()  # orbax would wait for the previous save here anyway
        with self._failure(step):
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta.to_json())), force=True)
        self._unrecorded.append(step)
        if wait:
            self.wait()

    def check(self) -> None:
        """Raise SaveFailed if a save in the background has failed (called every step: cheap)."""
        if self._unrecorded:
            with self._failure(self._unrecorded[-1]):
                self.manager.check_for_errors()

    @contextlib.contextmanager
    def _failure(self, step: int, *, complete: bool = False):
        """A failed write becomes SaveFailed, naming the checkpoint that stays the latest. `complete`: the
        save of `step` was already durable (what failed was recording its files)."""
        try:
            yield
        except SaveFailed:
            raise
        except Exception as e:  # orbax and TensorStore raise many types for a failed write
            self._unrecorded = []
            self._failed = True
            try:
                latest = [s for s in self.steps() if s != step or complete]
            except Exception:  # the storage that failed the save may not answer this either
                latest = [step] if complete else []
            kept = (f"the checkpoint of step {latest[-1]} stays the latest" if latest else
                    "there is no earlier checkpoint")
            if isinstance(e, storage.StorageFault):  # the storage is known to have failed (the lease)
                raise SaveFailed(f"{e}; the save of step {step} is abandoned and {kept}") from None
            what = (f"recording the files of the checkpoint of step {step} (complete)" if complete else
                    f"saving the checkpoint of step {step}")
            raise SaveFailed(f"{self.directory}: {what} failed ({first_line(e)}); "
                             f"{_free_space(self.directory)}; {kept}; stopping the run") from None

    def wait(self) -> None:
        """Until the save in flight is durable; then record its files."""
        if self._failed:
            return
        with self._failure(self._unrecorded[-1] if self._unrecorded else -1):
            while self.manager.is_saving_in_progress():
                self.health()
                time.sleep(0.05)
            self.manager.wait_until_finished()
        for step in self._unrecorded:
            path = self.directory / str(step)
            if jax.process_index() == 0:
                with self._failure(step, complete=True):
                    files = storage.sizes(path)
                    if files:
                        storage.write_atomic(path / FILE_LIST, json.dumps({"files": files}))
        self._unrecorded = []

    def close(self) -> None:
        """Wait for the save in flight, then close. After a failed save nothing is waited for: orbax's
        threads may still be retrying a storage that is gone, and the process is about to exit."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if not self._failed:
                self.manager.close()

    def verify(self, step: int) -> None:
        """Raise DamagedCheckpoint if a file recorded at save time is missing or changed size, or the
        metadata cannot be read. A checkpoint without a file list (killed between its save and the
        record) is checked by restoring it."""
        where = self.directory / str(step)
        record = where / FILE_LIST
        with classified(step, where, f"read {FILE_LIST}"):
            recorded = json.loads(record.read_text()) if record.exists() else None
            present = storage.sizes(where) if recorded is not None else {}  # one listing (on gs://, not one a file)
        if recorded is not None:
            files = recorded.get("files") if isinstance(recorded, dict) else None
            if not isinstance(files, dict):
                raise DamagedCheckpoint(step, where, f"{FILE_LIST} lists no files")
            for name, size in sorted(files.items()):
                if name not in present:
                    raise DamagedCheckpoint(step, where, f"{name} is missing")
                if (actual := present[name]) != size:
                    raise DamagedCheckpoint(step, where, f"{name} has {actual} bytes, {size} when it was saved")
        self.meta(step)

    def meta(self, step: int) -> CheckpointMeta:
        where = self.directory / str(step)
        with classified(step, where, "read its metadata"):
            saved = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        try:
            return CheckpointMeta.from_json(dict(saved))
        except (TypeError, ValueError) as e:  # a record without its required fields (or not a record)
            raise DamagedCheckpoint(step, where, f"its metadata is incomplete ({first_line(e)})") from None

    def readable_meta(self, step: int) -> CheckpointMeta:
        """The metadata of a checkpoint in the format this zerolm reads."""
        meta = self.meta(step)
        if meta.format != FORMAT:
            raise CheckpointError(f"{self.directory / str(step)}: checkpoint format {meta.format}, this "
                                  f"zerolm reads format {FORMAT} (c_attn's kernel became (layers, d, 3, d) for tensor "
                                  "parallelism); use it with the zerolm that wrote it, or start over with --resume "
                                  "never --overwrite")
        return meta

    def param_count(self, step: int) -> int:
        """How many parameters checkpoint `step` holds, from its arrays' recorded shapes (nothing restored)."""
        with quiet_orbax(), classified(step, self.directory / str(step), "read its arrays' shapes"):
            tree = ocp.PyTreeCheckpointer().metadata(self.directory / str(step) / "state").item_metadata
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree["params"]))

    def restore_params(self, step: int, target: Any) -> Any:
        """Only the parameters of `step`, into `target` (abstract arrays with the shardings wanted,
        e.g. from `sharding.with_shardings`): for evaluation, sampling and export, whatever mesh the
        run trained on. The optimizer state is not read."""
        target = {"params": target}
        args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        with classified(step, self.directory / str(step), "restore its parameters"):
            return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]

    def restore_part(self, step: int, target: TrainState) -> TrainState:
        """The leaves of `step` that `target` names (abstract arrays with the shardings wanted, in the layout the
        checkpoint was saved in: zerolm.parallel.sharding.Table.restore_target); a leaf that is SKIP is not read and
        comes back SKIP. E.g. the master weights alone of a mixed-precision optimizer state."""
        args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        with classified(step, self.directory / str(step), "restore it"):
            return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]

    def restore(self, step: int, zero: Zero, model_config: dict, ema: float | None = None
                ) -> tuple[TrainState, CheckpointMeta]:
        """Restore `step` into `zero`'s mesh and shardings (`ema`: the train.ema its optimizer was built with).
        Checks the model first; writes nothing."""
        meta = self.readable_meta(step)
        where = self.directory / str(step)
        check_compatible(meta, where, model_config, zero.precision, ema)
        saved_dp, saved_tp = meta.dp, meta.tp
        opt_target, repack = zero.table.restore_target(saved_dp, saved_tp, meta.stage)
        target = TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=zero.table.replicated),
                            params=with_shardings(zero.working_params, zero.table.param_shardings),
                            opt_state=opt_target)
        with classified(step, where, "restore it"):
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        state = restored["state"]
        state = state.replace(opt_state=repack(state.opt_state))
        return state, meta


_path = storage.path


def remove_unfinished(directory: str | epath.Path) -> list[str]:
    """Delete what saves that never finished left (their run died mid-save): orbax's temporary
    directories locally; on gs://, step directories without orbax's `commit_success.txt`.

    Only safe while holding the directory's run lock: a live run's save in flight looks the same."""
    directory = _path(directory)
    if storage.is_remote(directory):
        steps: dict[str, set[str]] = {}
        for name in storage.sizes(directory):
            top, _, rest = name.partition("/")
            if top.isdigit() and rest:
                steps.setdefault(top, set()).add(rest)
        unfinished = sorted((directory / top for top, files in steps.items() if COMMIT_FILE not in files),
                            key=lambda p: int(p.name))
    elif directory.exists():
        unfinished = sorted(p for p in directory.iterdir() if TMP_SUFFIX in p.name)
    else:
        return []
    for p in unfinished:
        storage.remove_tree(p)
    return [p.name for p in unfinished]
