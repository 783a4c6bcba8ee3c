"""One process of a multi-process test run (started by the tests, one per process, on 127.0.0.1).

    python tests/multihost_worker.py loader --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I \
        --devices 4 --dataset DIR --out DIR

Writes, per mesh layout, the global batches it assembled (gathered to every process) and how many
rows this process read from storage.
"""

import argparse
import os
import sys

from xla_flags import cpu_flags


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("task", choices=["loader"])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume-step", type=int, default=3)
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = cpu_flags(args.devices)
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from zerolm.data.loader import BatchLoader
    from zerolm.data.shards import PreparedDataset
    from zerolm.parallel.mesh import DP, TP, initialize_distributed, make_mesh

    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    meshes = {
        "dp8_tp1": make_mesh(8, 1),
        "dp4_tp2": make_mesh(4, 2),
        # Host h holds every device at tp = h: only host 0 may read (docs/design.md's 2x2 case, scaled).
        "dp4_tp2_tp_by_host": Mesh(np.array(by_process).reshape(args.num_processes, -1).T, (DP, TP)),
    }
    results = {}
    for name, mesh in meshes.items():
        split = PreparedDataset(args.dataset).split("train")
        loader = BatchLoader(split, mesh, global_batch_size=16, micro_batch_size=2, seed=7)
        straight = [multihost_utils.process_allgather(loader.global_batch(s), tiled=True) for s in range(6)]
        results[f"{name}.rows_read"] = np.array(split.rows_read)  # before any read-ahead thread runs
        resumed_loader = BatchLoader(split, mesh, global_batch_size=16, micro_batch_size=2, seed=7)
        it = resumed_loader.batches(start_step=args.resume_step)
        resumed = [multihost_utils.process_allgather(next(it)[0], tiled=True) for _ in range(3)]
        results[f"{name}.straight"] = np.stack(straight)
        results[f"{name}.resumed"] = np.stack(resumed)
    np.savez(os.path.join(args.out, f"process{args.process_id}.npz"), **results)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    sys.exit(main())
