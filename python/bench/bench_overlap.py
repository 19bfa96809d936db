"""ferrocomm.ops' overlapped GEMM + collective beside torch's fused
symmetric-memory ops and the unfused NCCL pair, at a Llama-70B TP shape:
hidden 8192, ffn 28672, tokens 2048..16384.

    torchrun --nproc_per_node=2 python/bench/bench_overlap.py
    torchrun --nproc_per_node=2 python/bench/bench_overlap.py --tokens 4096,8192 --dtype bfloat16

Rows (one line each, printed by rank 0):
- all_gather_matmul: A_shard [tokens/world, hidden] gathered along dim 0,
  times W [hidden, ffn/world]: ferrocomm.ops.all_gather_matmul,
  torch.ops.symm_mem.fused_all_gather_matmul, and NCCL's
  all_gather_into_tensor then one matmul;
- matmul_reduce_scatter: [tokens, ffn/world] @ [ffn/world, hidden],
  reduce-scattered along dim 0: ferrocomm.ops.matmul_reduce_scatter,
  torch.ops.symm_mem.fused_matmul_reduce_scatter, and one matmul then
  NCCL's reduce_scatter_tensor.

Method: each subject is called eagerly on torch's current stream; after
`--warmup` calls and a barrier, `--iters` calls are each timed with CUDA
events; the median is printed (ms), with the matmul's TFLOP/s. NVLink
multicast is off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0):
it can take a shared host's GPUs down, and ferrocomm does not use it.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ferrocomm  # noqa: E402
from ferrocomm import ops  # noqa: E402


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,4096,8192,16384")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = ferrocomm.from_torch()
    group = dist.group.WORLD.group_name
    symm = None
    try:
        from torch.distributed import _symmetric_memory as symm

        symm.enable_symm_mem_for_group(group)
    except (ImportError, AttributeError, RuntimeError) as e:
        symm = None
        if rank == 0:
            print(f"# torch symmetric memory unavailable: {e}")
    dtype = getattr(torch, args.dtype)
    hidden, ffn_shard = args.hidden, args.ffn // world
    if rank == 0:
        print(f"# world {world}, {args.dtype}, hidden {hidden}, ffn {args.ffn}; median ms of {args.iters}")

    def row(op: str, tokens: int, subject: str, ms: float, flops: float) -> None:
        if rank == 0:
            print(f"{op:22s} tokens={tokens:6d} {subject:24s} {ms:9.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s", flush=True)

    for tokens in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(rank)
        # all-gather + matmul
        a_shard = torch.randn(tokens // world, hidden, device="cuda", dtype=dtype, generator=g)
        w = torch.randn(hidden, ffn_shard, device="cuda", dtype=dtype, generator=g) / hidden**0.5
        gathered = torch.empty(tokens, hidden, device="cuda", dtype=dtype)
        flops = 2.0 * tokens * hidden * ffn_shard
        subjects = [("ferrocomm", lambda: ops.all_gather_matmul(a_shard, [w], 0, comm=comm))]
        if symm is not None:
            subjects.append(("torch_symm_mem", lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w], 0, group)))

        def nccl_ag():
            dist.all_gather_into_tensor(gathered, a_shard)
            return gathered @ w

        subjects.append(("nccl+matmul", nccl_ag))
        for name, fn in subjects:
            row("all_gather_matmul", tokens, name, median_ms(fn, args.warmup, args.iters), flops)
        del a_shard, w, gathered
        # matmul + reduce-scatter
        a = torch.randn(tokens, ffn_shard, device="cuda", dtype=dtype, generator=g)
        w2 = torch.randn(ffn_shard, hidden, device="cuda", dtype=dtype, generator=g) / ffn_shard**0.5
        out = torch.empty(tokens // world, hidden, device="cuda", dtype=dtype)
        flops = 2.0 * tokens * ffn_shard * hidden
        subjects = [("ferrocomm", lambda: ops.matmul_reduce_scatter(a, w2, 0, comm=comm))]
        if symm is not None:
            subjects.append(
                ("torch_symm_mem", lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w2, "sum", 0, group))
            )

        def nccl_rs():
            dist.reduce_scatter_tensor(out, a @ w2)
            return out

        subjects.append(("matmul+nccl", nccl_rs))
        for name, fn in subjects:
            row("matmul_reduce_scatter", tokens, name, median_ms(fn, args.warmup, args.iters), flops)
        del a, w2, out
        torch.cuda.synchronize()
        # Each shape's buffers go before the next's (the heap is finite).
        ops.release(comm)
    dist.barrier()
    comm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
