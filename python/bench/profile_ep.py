"""Where EP dispatch + combine spends its time: per-kernel GPU durations and
the gaps between them, from torch's profiler (CUPTI activity records, which
do not serialise kernels the way a replaying profiler would, so the ranks'
spinning kernels still meet).

    torchrun --nproc_per_node=2 python/bench/profile_ep.py [--tokens 1,128,4096]

For each token count: the same shape as `ferrocomm-bench --ep` (hidden 7168,
top-8 of 256 experts, bf16 rows), dispatch + combine captured K times in one
CUDA graph, replayed after warm-up under the profiler. Rank 0 prints, per
kernel name, the count and the median and largest duration, then the mean
time per dispatch + combine and how much of it no kernel ran (launch gaps).
A kernel's record runs from when its blocks are scheduled: with dependent
launches (sm_90 and up) the next kernel's record starts before the previous
one ends (and a record's duration then holds its wait for the previous
kernel), so the time "in kernels" is the union of the records, not their
sum. A spinning kernel's record also holds the time its peers took to
arrive, so the profiler is started once on every rank before anything is
timed (on 2x H200 the first profiled pair had held a 0.4 s wait).
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import ferrocomm  # noqa: E402


def kernels_of(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("fc_"):
            out.append((e.name, e.time_range.start, e.time_range.end - e.time_range.start))
    return sorted(out, key=lambda k: k[1])


def covered(ks: list[tuple[str, float, float]]) -> float:
    """Time (us) inside at least one record: the union, not the sum."""
    total = 0.0
    end = None  # the furthest end so far
    for _, start, dur in ks:
        stop = start + dur
        if end is None or start >= end:
            total += dur
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,128,4096")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--k", type=int, default=10, help="dispatch + combine pairs per graph")
    args = ap.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    comm = ferrocomm.from_torch(timeout=120)
    W, r = comm.size, comm.rank
    H, E, K = args.hidden, args.experts, args.topk
    # The profiler's first start, on every rank, before any timed replay.
    with profile(activities=[ProfilerActivity.CUDA]):
        torch.cuda.synchronize()
    dist.barrier()
    for T in [int(t) for t in args.tokens.split(",")]:
        buf = comm.ep_buffer(num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K)
        g = torch.Generator(device="cuda").manual_seed(1234 + r)
        x = torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16)
        # Distinct experts per token, spread over every rank.
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).to(torch.int32)
        w = torch.full((T, K), 1.0 / K, device="cuda")
        exp = torch.zeros((W * T, H), dtype=torch.bfloat16, device="cuda")
        out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
        # Warm-up outside the graph (loads the kernels), then capture.
        for _ in range(3):
            buf.dispatch(x, idx, w)
            buf.combine(exp, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(args.k):
                buf.dispatch(x, idx, w)
                buf.combine(exp, out)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        replays = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        ks = kernels_of(prof)
        if r == 0:
            per = defaultdict(list)
            for name, _, dur in ks:
                per[name].append(dur)
            pairs = replays * args.k
            print(f"tokens {T}: {len(ks)} kernels in {replays} replays of {args.k} dispatch + combine pairs")
            for name, durs in sorted(per.items()):
                durs.sort()
                print(f"  {name:<24} n={len(durs):>4} median {durs[len(durs) // 2]:9.2f} us  max {durs[-1]:9.2f} us")
            if ks:
                span = max(st + d for _, st, d in ks) - ks[0][1]
                busy = covered(ks)
                total = sum(d for _, _, d in ks)
                print(f"  per pair: {span / pairs:.2f} us span, {busy / pairs:.2f} us in kernels, "
                      f"{(span - busy) / pairs:.2f} us between kernels "
                      f"(the records add up to {total / pairs:.2f} us: they overlap)")
            print(f"RESULT profile_ep tokens={T} kernels={len(ks)}", flush=True)
        del graph
        torch.cuda.synchronize()
        dist.barrier()
        buf.free()
    comm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
