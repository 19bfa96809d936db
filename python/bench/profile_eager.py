"""Where the CPU time of one eager ``all_reduce`` from Python goes.

    torchrun --nproc_per_node=1 python/bench/profile_eager.py --sizes 1K,64K,16M

Times, with ``time.perf_counter`` over many back-to-back calls after a
warm-up (us per call, the median of ``--reps`` rounds), the whole call and
each step of its path: the Python wrapper's preparation (``prepare``,
``as_op``), routing and the stream lookup (``_route``), the native
``CallOpts``, and the native call alone; then torch's ProcessGroupNCCL on the
same tensor. ``--cprofile`` adds a cProfile listing of the whole call. The
GPU work of a call at world 1 is a short copy, so the CPU sets the pace.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

import ferrocomm
from ferrocomm._call import call_opts
from ferrocomm._comm import as_op
from ferrocomm._tensors import prepare


def per_call_us(fn, n: int, reps: int) -> float:
    """Median over `reps` rounds of the CPU microseconds per call of `fn`
    called `n` times in a row; the stream is drained between rounds."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) * 1e6 / n)
        torch.cuda.synchronize()
    rounds.sort()
    return rounds[len(rounds) // 2]


def parse_bytes(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B")
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1K,64K,16M")
    ap.add_argument("--n", type=int, default=500, help="calls per round")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    comm = ferrocomm.from_torch()
    comm.prepare()
    native = comm._native
    stream = torch._C._cuda_getCurrentRawStream(local)
    print(f"# eager profile: world {dist.get_world_size()}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"# {'bytes':>10} {'step':<34} {'us/call':>8}")
    for nbytes in [parse_bytes(s) for s in args.sizes.split(",")]:
        x = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
        opts = call_opts(False, None, None, stream)
        steps = [
            ("ferrocomm all_reduce (whole call)", lambda: comm.all_reduce(x)),
            ("  prepare(x)", lambda: prepare(x)),
            ("  as_op('sum')", lambda: as_op("sum")),
            ("  _route(x, None)", lambda: comm._route(x, None)),
            ("  call_opts(...)", lambda: call_opts(False, None, None, stream)),
            ("  native all_reduce", lambda: native.all_reduce(x, "SUM", None, opts=opts)),
            ("torch NCCL all_reduce", lambda: dist.all_reduce(x)),
        ]
        for name, fn in steps:
            print(f"  {nbytes:>10} {name:<34} {per_call_us(fn, args.n, args.reps):8.2f}", flush=True)
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.n):
                comm.all_reduce(x)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    comm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
