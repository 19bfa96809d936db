"""Expert-parallel (MoE) dispatch and combine on CPU (host backend, NumPy):
each rank routes its tokens to the ranks owning their top-k experts, the
experts scale the rows they received, and combine brings each token's
rows home, summed. The same calls run on GPUs with torch tensors (bf16 or
fp8 rows, on torch's current stream). Run it as it is (it starts the ranks
itself):

    python python/examples/host_ep.py
"""

import os
import sys

import numpy as np

import ferrocomm


def to_bf16(a: np.ndarray) -> np.ndarray:
    """NumPy has no bfloat16: rows travel as their bits in uint16 (rounded to nearest even)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rank_main() -> None:
    comm = ferrocomm.init(backend="host")
    r, w = comm.rank, comm.size
    num_experts, hidden, topk, tokens = 4 * w, 128, 2, 5
    buf = comm.ep_buffer(num_experts=num_experts, hidden=hidden, max_tokens_per_rank=8, topk=topk)
    rng = np.random.default_rng(r)
    x = rng.integers(-4, 5, (tokens, hidden)).astype(np.float32)  # small integers: every sum below is exact
    topk_idx = np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(tokens)]).astype(np.int32)
    topk_weights = np.full((tokens, topk), 0.5, np.float32)

    got = buf.dispatch(to_bf16(x), topk_idx, topk_weights)

    # This rank's experts: expert e multiplies a row by e + 1, weighted by
    # the router. Source s's rows are s * max + i for i < recv_counts[s];
    # recv_topk_idx holds local expert ids (-1: another rank's expert).
    expert_out = np.zeros((w * buf.max_tokens_per_rank, hidden), np.uint16)
    first = r * buf.experts_per_rank
    for s in range(w):
        start = s * buf.max_tokens_per_rank
        for row in range(start, start + got.recv_counts[s]):
            ids, weights = got.recv_topk_idx[row].tolist(), got.recv_topk_weights[row].tolist()
            scale = sum(wt * (first + j + 1) for j, wt in zip(ids, weights) if j >= 0)
            expert_out[row] = to_bf16(from_bf16(got.recv_x[row]) * scale)

    out = np.empty((tokens, hidden), np.uint16)
    buf.combine(expert_out, out)  # each token's rows from every rank it went to, summed
    want = x * (topk_weights * (topk_idx + 1)).sum(axis=1, keepdims=True)
    assert (from_bf16(out) == want).all(), (from_bf16(out)[:, :4], want[:, :4])
    print(f"rank {r}: sent {got.send_counts.tolist()} tokens to ranks {list(range(w))}, "
          f"received {got.recv_counts.tolist()}; combined rows match", flush=True)
    del got  # the received arrays (and slices of them) are the buffer's memory: free refuses while they live
    comm.barrier()
    buf.free()  # frees in the same order on every rank
    comm.finalize()


if __name__ == "__main__":
    if "RANK" in os.environ:  # one rank, started by a launcher (torchrun, or _launch below)
        rank_main()
    else:
        from _launch import launch  # this folder's _launch.py: this script again, as 2 local ranks

        sys.exit(launch(__file__, world=2))
