"""ferrocomm against torch's NCCL (torch.distributed) and torch symmetric
memory, in one torchrun job, under CUDA graphs, on torch tensors.

    torchrun --nproc_per_node=2 python/bench/bench_torch.py
    torchrun --nproc_per_node=2 python/bench/bench_torch.py --collectives all_reduce --min-bytes 4K --max-bytes 64M

Method (as the baselines in shared/baselines): each subject's call is
captured K times into one CUDA graph after a warm-up on a side stream; the
graph is replayed after a barrier, each replay timed with CUDA events; the
time per op is the median replay time / K. busbw is algbw x 2(n-1)/n for
all-reduce and x (n-1)/n for all-gather, reduce-scatter and all-to-all
(bytes: the all-reduce buffer, the all-gather output, the reduce-scatter
input, the all-to-all buffer). Every subject reads and writes the same
tensors; rank 0 prints one table.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import ferrocomm
import ferrocomm.torch  # noqa: F401  (registers the backend "ferrocomm")


def parse_bytes(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B")
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def graph_time(fn, k: int, reps: int) -> float:
    """Median microseconds per op of `fn` captured `k` times in a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(k):
            fn()
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / k)
    times.sort()
    return times[len(times) // 2]


def eager_time(fn, k: int, reps: int) -> float:
    """Median microseconds per op of `fn` called `k` times in a row, eagerly
    (Python and launch overhead included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(k):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / k)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter,all_to_all")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=20, help="ops per graph")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="add eager (no graph) rows for ferrocomm and NCCL")
    ap.add_argument("--no-symm-mem", action="store_true")
    ap.add_argument("--no-pg", action="store_true", help="no eager rows through torch.distributed on ferrocomm")
    ap.add_argument("--fused", action="store_true", help="add all-reduce + residual + RMSNorm rows (unfused vs fused)")
    ap.add_argument("--json", help="write the rows here (rank 0)")
    args = ap.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    comm = ferrocomm.from_torch()
    comm.prepare()
    fc_group = dist.new_group(backend="ferrocomm") if args.eager and not args.no_pg else None
    symm = None
    if not args.no_symm_mem:
        try:
            import torch.distributed._symmetric_memory as symm

            gname = dist.group.WORLD.group_name
        except Exception as e:  # noqa: BLE001  (an optional baseline)
            print(f"torch symmetric memory unavailable: {e}")
            symm = None

    sizes = []
    b = parse_bytes(args.min_bytes)
    while b <= parse_bytes(args.max_bytes):
        sizes.append(b)
        b *= 4
    colls = args.collectives.split(",")
    rows = []

    def add(coll, impl, nbytes, us):
        factor = 2 * (world - 1) / world if coll == "all_reduce" else (world - 1) / world
        rows.append(dict(collective=coll, impl=impl, bytes=nbytes, us=us, busbw=nbytes * factor / (us * 1e-6) / 1e9))

    for nbytes in sizes:
        n = nbytes // esize
        reps = args.reps if nbytes < (1 << 24) else max(5, args.reps // 4)
        k = args.k if nbytes < (1 << 26) else max(4, args.k // 4)
        if "all_reduce" in colls:
            x = torch.randn(n, device="cuda").to(dtype)
            add("all_reduce", "ferrocomm", nbytes, graph_time(lambda: comm.all_reduce(x), k, reps))
            add("all_reduce", "nccl", nbytes, graph_time(lambda: dist.all_reduce(x), k, reps))
            if args.eager:
                add("all_reduce", "ferrocomm-eager", nbytes, eager_time(lambda: comm.all_reduce(x), k, reps))
                add("all_reduce", "nccl-eager", nbytes, eager_time(lambda: dist.all_reduce(x), k, reps))
            if fc_group is not None:
                # The same call through torch.distributed on the ferrocomm backend.
                add("all_reduce", "ferrocomm-pg-eager", nbytes,
                    eager_time(lambda: dist.all_reduce(x, group=fc_group), k, reps))
            if symm is not None and nbytes <= (1 << 26):
                buf = symm.empty(n, device="cuda", dtype=dtype)
                symm.rendezvous(buf, gname)
                buf.copy_(x)
                if nbytes <= (1 << 22):
                    out = torch.empty_like(buf)
                    add("all_reduce", "symm-mem-1shot", nbytes, graph_time(
                        lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", gname, out), k, reps))
                add("all_reduce", "symm-mem-2shot", nbytes, graph_time(
                    lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", gname), k, reps))
                del buf
            del x
        if "all_gather" in colls:
            out = torch.empty(n, device="cuda", dtype=dtype)
            inp = torch.randn(n // world, device="cuda").to(dtype)
            add("all_gather", "ferrocomm", nbytes, graph_time(lambda: comm.all_gather_single(out, inp), k, reps))
            add("all_gather", "nccl", nbytes, graph_time(lambda: dist.all_gather_into_tensor(out, inp), k, reps))
        if "reduce_scatter" in colls:
            big = torch.randn(n, device="cuda").to(dtype)
            small = torch.empty(n // world, device="cuda", dtype=dtype)
            add("reduce_scatter", "ferrocomm", nbytes, graph_time(
                lambda: comm.reduce_scatter_single(small, big), k, reps))
            add("reduce_scatter", "nccl", nbytes, graph_time(lambda: dist.reduce_scatter_tensor(small, big), k, reps))
        if "all_to_all" in colls:
            src = torch.randn(n, device="cuda").to(dtype)
            dst = torch.empty_like(src)
            add("all_to_all", "ferrocomm", nbytes, graph_time(lambda: comm.all_to_all_single(dst, src), k, reps))
            add("all_to_all", "nccl", nbytes, graph_time(lambda: dist.all_to_all_single(dst, src), k, reps))
        torch.cuda.empty_cache()

    if args.fused:
        # One transformer layer's end under tensor parallelism, per
        # (hidden, tokens): NCCL all-reduce then `x + residual` and
        # F.rms_norm (unfused, the anchor), ferrocomm's all-reduce then the
        # same torch ops, and ferrocomm's fused kernel. bytes = the
        # all-reduce's; "vs nccl" compares with the unfused NCCL row.
        for hidden, tokens in [(4096, 1), (4096, 32), (4096, 128), (4096, 2048), (8192, 1), (8192, 128), (8192, 2048)]:
            x = torch.randn(tokens, hidden, device="cuda").to(dtype)
            res = torch.randn(tokens, hidden, device="cuda").to(dtype)
            w = torch.randn(hidden, device="cuda").to(dtype)
            normed = torch.empty_like(x)
            ar = torch.empty_like(x)
            nbytes = x.numel() * esize

            def unfused_nccl():
                ar.copy_(x)
                dist.all_reduce(ar)
                r2 = ar + res
                res.copy_(r2)
                normed.copy_(torch.nn.functional.rms_norm(r2, (hidden,), w, 1e-6))

            def unfused_ferrocomm():
                comm.all_reduce_into(ar, x)
                r2 = ar + res
                res.copy_(r2)
                normed.copy_(torch.nn.functional.rms_norm(r2, (hidden,), w, 1e-6))

            def fused():
                comm.all_reduce_fused(x, res, w, 1e-6, norm_out=normed)

            name = f"ar+rmsnorm h{hidden} t{tokens}"
            add(name, "nccl", nbytes, graph_time(unfused_nccl, k, reps))
            add(name, "ferrocomm-unfused", nbytes, graph_time(unfused_ferrocomm, k, reps))
            add(name, "ferrocomm-fused", nbytes, graph_time(fused, k, reps))

    dist.barrier()
    if rank == 0:
        nccl = {(r["collective"], r["bytes"]): r["us"] for r in rows if r["impl"] == "nccl"}
        print(f"world {world}, {args.dtype}, CUDA graphs of {args.k} ops, median of {args.reps} replays; "
              f"ferrocomm {ferrocomm.__version__} ({comm.backend}, NCCL underneath: {comm.has_vendor_library}), "
              f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"{'collective':24s} {'bytes':>10s} {'impl':17s} {'us':>9s} {'busbw GB/s':>11s} {'vs nccl':>8s}")
        for r in rows:
            base = nccl.get((r["collective"], r["bytes"]))
            ratio = f"{r['us'] / base:7.2f}x" if base else ""
            print(f"{r['collective']:24s} {r['bytes']:10d} {r['impl']:17s} {r['us']:9.2f} {r['busbw']:11.1f} {ratio:>8s}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=world, dtype=args.dtype, k=args.k, rows=rows), f, indent=1)
    dist.barrier()
    comm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
