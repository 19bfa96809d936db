"""GPU scenarios of ``ferrocomm.ops`` (run by test_overlap_torch.py through
_gpu_worker.py as ``overlap_torch_scenarios:NAME``): all_gather_matmul and
matmul_reduce_scatter against references built from every rank's inputs,
which each rank regenerates from seeds (so no NCCL is needed and ranks may
share a GPU), then one CUDA graph captured and replayed with new data.

Tolerances, relative to the largest magnitude of the reference:
- float32: 1e-5. The chunked products are the same dot products as the
  reference's, but cuBLAS may pick another kernel (split-K, tile order) for
  a chunk's shape than for the whole, so sums may associate differently;
  TF32 is off (torch's default for matmul), so the differences are a few
  f32 ulps of K-term sums.
- bfloat16: 2e-2. Every product is rounded to bf16 (8 significant bits,
  relative step 2^-8 = 3.9e-3) in the chunk and in the reference, possibly
  from differently ordered f32 sums, and a reduce-scatter adds a second
  rounding of the sum; a few bf16 steps stay under 2e-2.
"""

from __future__ import annotations

import os

import torch

import ferrocomm
from ferrocomm import ops


def setup() -> ferrocomm.Communicator:
    local = int(os.environ["LOCAL_RANK"])
    # FERROCOMM_TEST_SHARE_GPU=1: ranks may share a GPU (no NCCL here).
    device = local % torch.cuda.device_count()
    torch.cuda.set_device(device)
    comm = ferrocomm.init(backend="cuda", device=device, timeout=120)
    assert comm.backend == "cuda", comm
    return comm


def data(rank: int, shape, dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(salt * 1_000_003 + rank * 7919 + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype).cuda()


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def close(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got.float() - want.float()).abs().max().item()
    scale = max(want.float().abs().max().item(), 1.0)
    assert err <= TOL[dtype] * scale, f"{what}: max error {err} > {TOL[dtype]} x {scale}"


def ag_reference(shards, bs, gather_dim: int):
    a = torch.cat(shards, dim=gather_dim)
    return a, [torch.matmul(a, b) for b in bs]


def rs_reference(inputs, b, scatter_dim: int, rank: int, world: int, op: str):
    prods = [torch.matmul(a, b).float() for a in inputs]
    total = prods[0]
    for p in prods[1:]:
        total = total + p
    if op == "avg":
        total = total / world
    return total.chunk(world, dim=scatter_dim)[rank].to(inputs[0].dtype)


def overlap_vs_reference() -> None:
    comm = setup()
    W, r = comm.size, comm.rank
    cases = [
        # (A shard / A shape, gather or scatter dim, N list)
        ((64, 96), 0, [128]),
        ((8, 24, 64), 1, [80, 48]),
        ((6, 16, 32), 0, [40]),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for salt, (shape, dim, ns) in enumerate(cases):
            k = shape[-1]
            bs = [data(0, (k, n), dtype, 100 + salt + j) for j, n in enumerate(ns)]
            for it in range(3):  # calls in a row reuse the cached buffers
                shards = [data(q, shape, dtype, 10 * salt + it) for q in range(W)]
                a, outs = ops.all_gather_matmul(shards[r], bs, dim, comm=comm)
                want_a, want = ag_reference(shards, bs, dim)
                assert torch.equal(a, want_a), f"all_gather_matmul {dtype} {shape} dim {dim}: A differs"
                for j, (o, w) in enumerate(zip(outs, want)):
                    close(o, w, dtype, f"all_gather_matmul {dtype} {shape} dim {dim} B{j} call {it}")
            # matmul_reduce_scatter: A's scatter dim is W times the shard's.
            full = list(shape)
            full[dim] *= W
            for op in ("sum", "avg"):
                inputs = [data(q, full, dtype, 500 + 10 * salt) for q in range(W)]
                got = ops.matmul_reduce_scatter(inputs[r], bs[0], dim, comm=comm, reduce_op=op)
                want = rs_reference(inputs, bs[0], dim, r, W, op)
                close(got, want, dtype, f"matmul_reduce_scatter {dtype} {full} dim {dim} {op}")
    try:
        ops.all_gather_matmul(shards[r], bs, len(shape) - 1, comm=comm)
    except ferrocomm.InvalidArgument as e:
        assert "last" in str(e), e
    else:
        raise AssertionError("gather_dim = the last dim was accepted")
    torch.cuda.synchronize()
    ops.release(comm)
    comm.finalize()


def overlap_graph_replay(replays: str = "20") -> None:
    """Both operations captured into one CUDA graph (their buffers made by
    an eager call first), replayed with new inputs copied in each time."""
    comm = setup()
    W, r = comm.size, comm.rank
    dtype = torch.bfloat16
    shard_shape, full_shape, k, n = (128, 256), (128 * W, 256), 256, 192
    b = data(0, (k, n), dtype, 7)
    a_shard = data(r, shard_shape, dtype, 0)
    a_full = data(r, full_shape, dtype, 0)
    ops.all_gather_matmul(a_shard, [b], 0, comm=comm)
    ops.matmul_reduce_scatter(a_full, b, 0, comm=comm)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a_out, (ag_out,) = ops.all_gather_matmul(a_shard, [b], 0, comm=comm)
        rs_out = ops.matmul_reduce_scatter(a_full, b, 0, comm=comm)
    for it in range(int(replays)):
        shards = [data(q, shard_shape, dtype, it + 1) for q in range(W)]
        fulls = [data(q, full_shape, dtype, 1000 + it) for q in range(W)]
        a_shard.copy_(shards[r])
        a_full.copy_(fulls[r])
        g.replay()
        torch.cuda.synchronize()
        want_a, (want_ag,) = ag_reference(shards, [b], 0)
        assert torch.equal(a_out, want_a), f"replay {it}: gathered A differs"
        close(ag_out, want_ag, dtype, f"replay {it}: all_gather_matmul")
        close(rs_out, rs_reference(fulls, b, 0, r, W, "sum"), dtype, f"replay {it}: matmul_reduce_scatter")
    del g
    torch.cuda.synchronize()
    ops.release(comm)
    comm.finalize()
