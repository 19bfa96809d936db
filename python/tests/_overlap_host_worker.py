"""One rank of test_overlap_host.py: `python _overlap_host_worker.py SCENARIO`
runs one of the chunked operations' scenarios below on the host backend
and exits 0 only if it returned."""

from __future__ import annotations

import sys
import traceback

import numpy as np

import ferrocomm
from ferrocomm import ops


def rows(rank: int, n: int, salt: int) -> np.ndarray:
    """Rank `rank`'s values: random float32, the same on every rank that asks."""
    return np.random.default_rng(salt * 1_000_003 + rank * 7919 + n).standard_normal(n).astype(np.float32)


def chunked_ops() -> None:
    """Several calls in a row of each operation on the communicator's
    stream, checked against NumPy: the all-gather bit for bit, the
    reduce-scatter against the f32 sum in rank order (bit for bit too)."""
    comm = ferrocomm.init(backend="host", timeout=60)
    W, r = comm.size, comm.rank
    n = 1031
    out = comm.heap_tensor((W * n,), "float32")
    ag = ops.ChunkedAllGather(comm, out)
    assert ag.shard_count == n, ag.shard_count
    gathered = np.from_dlpack(out)
    rs = ops.ChunkedReduceScatter(comm, n, np.float32)
    assert rs.chunk_count == n
    for it in range(3):
        mine = rows(r, n, it)
        ag.start(mine)
        for i in range(W):
            ag.wait_chunk((r - i) % W)
        parts = rows(r, W * n, 100 + it).reshape(W, n)
        for i in range(1, W + 1):
            rs.put_chunk((r + i) % W, parts[(r + i) % W])
        result = np.empty(n, dtype=np.float32)
        rs.finish(result, "sum" if it != 1 else "avg")
        comm.barrier()  # after the operations on the same stream: they have run
        want = np.concatenate([rows(q, n, it) for q in range(W)])
        assert np.array_equal(gathered, want), f"all-gather call {it}"
        everyone = [rows(q, W * n, 100 + it).reshape(W, n)[r] for q in range(W)]
        total = everyone[0].copy()
        for x in everyone[1:]:
            total = (total + x).astype(np.float32)
        if it == 1:
            total = (total / np.float32(W)).astype(np.float32)
        assert np.array_equal(result, total), f"reduce-scatter call {it}: {np.abs(result - total).max()}"
    # Bad arguments are errors on the calling rank, nothing queued.
    for bad, needle in [
        (lambda: ag.wait_chunk(W), "not in a world"),
        (lambda: ag.start(np.zeros(n + 1, np.float32)), "expected"),
        (lambda: rs.put_chunk(W, np.zeros(n, np.float32)), "world"),
        (lambda: rs.finish(np.zeros(n, np.float32)), "were not put"),
    ]:
        try:
            bad()
        except ferrocomm.InvalidArgument as e:
            assert needle in str(e), e
        else:
            raise AssertionError(f"accepted: {needle}")
    ag.start(rows(r, n, 9))
    try:
        if W > 1:
            ag.start(rows(r, n, 9))
            raise AssertionError("a second start before the waits was accepted")
    except ferrocomm.InvalidArgument as e:
        assert "never waited" in str(e), e
    ag.wait_all()
    comm.barrier()
    rs.free()
    ag.free()
    del gathered
    out.free()
    comm.finalize()


def main() -> int:
    name = sys.argv[1]
    try:
        globals()[name](*sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    print(f"rank ok: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
