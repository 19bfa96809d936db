"""One-sided windows on the symmetric heap, on CPU (host backend, NumPy):
three processes in a ring, each puts a row into the next rank's window,
signals it, waits for the previous rank's signal and reads its row. The
same code runs on GPUs with torch tensors (torch.from_dlpack). Run it as
it is (it starts the ranks itself):

    python python/examples/host_windows.py
"""

import os
import sys

import numpy as np

import ferrocomm


def rank_main() -> None:
    comm = ferrocomm.init(backend="host")
    r, w = comm.rank, comm.size
    nxt, prv = (r + 1) % w, (r - 1) % w
    rows = comm.heap_tensor((w, 4), np.int32)  # symmetric: same offset on every rank
    win = comm.new_window()
    win.tensor_register(rows)
    win.put(np.arange(4, dtype=np.int32) + 100 * r, nxt, target_offset=4 * r)  # elements
    win.signal(nxt)
    win.wait_signal(prv)
    mine = np.from_dlpack(rows)  # the heap memory itself, no copy
    assert (mine[prv] == np.arange(4) + 100 * prv).all(), mine
    theirs = np.from_dlpack(win.map_remote_tensor(nxt))  # the next rank's buffer, mapped here
    assert (theirs[r] == np.arange(4) + 100 * r).all(), theirs
    print(f"rank {r}: got {mine[prv].tolist()} from rank {prv}", flush=True)
    del mine, theirs  # views hold the memory: free and finalize refuse while they live
    comm.barrier()
    win.free()  # frees in the same order on every rank
    rows.free()
    comm.finalize()


if __name__ == "__main__":
    if "RANK" in os.environ:  # one rank, started by a launcher (torchrun, or _launch below)
        rank_main()
    else:
        from _launch import launch  # this folder's _launch.py: this script again, as 3 local ranks

        sys.exit(launch(__file__, world=3))
