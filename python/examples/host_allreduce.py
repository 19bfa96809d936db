"""ferrocomm on CPU arrays, anywhere: two processes on this machine, the host
backend, NumPy. Run it as it is (it starts both ranks itself):

    python python/examples/host_allreduce.py

or start each rank yourself with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
and FERROCOMM_TOKEN set (torchrun sets all but the token).
"""

import os
import sys

import numpy as np

import ferrocomm


def rank_main() -> None:
    comm = ferrocomm.init(backend="host")
    r, w = comm.rank, comm.size
    x = np.full(1 << 16, r + 1, dtype=np.float32)
    comm.all_reduce(x)  # in place: every rank gets 1 + 2 + ... + w
    assert x[0] == w * (w + 1) / 2, x[:4]
    gathered = np.empty(w * 4, dtype=np.int32)
    comm.all_gather_single(gathered, np.arange(4, dtype=np.int32) + 10 * r)
    # Fused all-reduce + residual add + RMSNorm on float16 rows.
    rows = np.ones((2, 8), dtype=np.float16)
    residual = np.zeros_like(rows)
    normed = np.empty_like(rows)
    comm.all_reduce_fused(rows, residual, np.ones(8, dtype=np.float16), 1e-6, norm_out=normed)
    assert residual[0, 0] == w and abs(float(normed[0, 0]) - 1.0) < 1e-2, (residual[0, 0], normed[0, 0])
    print(f"rank {r}: all_reduce -> {x[0]}, all_gather -> {gathered.tolist()}, fused rms_norm ok", flush=True)
    comm.finalize()


if __name__ == "__main__":
    if "RANK" in os.environ:  # one rank, started by a launcher (torchrun, or _launch below)
        rank_main()
    else:
        from _launch import launch  # this folder's _launch.py: this script again, as 2 local ranks

        sys.exit(launch(__file__, world=2))
