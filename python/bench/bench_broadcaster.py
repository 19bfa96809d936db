"""ferrocomm's metadata broadcaster against torch.distributed's
broadcast_object_list (on a gloo group, as engines broadcast CPU metadata,
and on the NCCL group), rank 0 sending to every other rank of one node.

    torchrun --nproc_per_node=8 python/bench/bench_broadcaster.py
    torchrun --nproc_per_node=2 python/bench/bench_broadcaster.py --sizes 64,4K,1M --json out.json

Every subject moves the same Python object, a list holding one bytes
payload: torch pickles it inside broadcast_object_list; the ferrocomm rows
pickle it with ``pickle.dumps`` and send the bytes (pickling is the
caller's), through the shared-memory ring (slots of the largest size) or
through the socket alone (slots of 0 bytes).

- msgs/s: the writer sends a stream of messages back to back; from a gloo
  barrier before the first to one after every reader has the last.
- latency: one message at a time, each after a barrier and 50 us more (the
  readers are waiting by then), stamped with the writer's
  ``time.monotonic_ns()`` and taken off each reader's on arrival (one host,
  one clock); p50 and p99 over every reader's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time

import torch
import torch.distributed as dist

import ferrocomm


def parse_bytes(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B")
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


class Subject:
    """One way of moving an object from rank 0 to the others."""

    def __init__(self, name, send, recv):
        self.name, self.send, self.recv = name, send, recv


def torch_subject(name, group, device):
    def send(obj):
        dist.broadcast_object_list([obj], src=0, group=group, device=device)

    def recv():
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group, device=device)
        return box[0]

    return Subject(name, send, recv)


def ferrocomm_subject(name, bc):
    return Subject(name, lambda obj: bc.send(pickle.dumps(obj)), lambda: pickle.loads(bc.recv()))


def check(obj, m: int, size: int) -> None:
    payload = obj[1]
    if len(payload) != size or (size and payload[-1] != m & 0xFF):
        raise AssertionError(f"message #{m} of {size} bytes arrived wrong ({len(payload)} bytes)")


def message(m: int, size: int) -> list:
    payload = bytearray(size)
    if size:
        payload[-1] = m & 0xFF
    return [time.monotonic_ns(), bytes(payload)]


def stream(s: Subject, rank: int, size: int, n: int, cpu) -> float:
    """Seconds to stream `n` messages of `size` bytes to every reader."""
    dist.barrier(group=cpu)
    start = time.perf_counter()
    for m in range(n):
        if rank == 0:
            s.send(message(m, size))
        else:
            check(s.recv(), m, size)
    dist.barrier(group=cpu)
    return time.perf_counter() - start


def latencies(s: Subject, rank: int, size: int, n: int, cpu) -> list:
    """This reader's one-way latencies in microseconds (none on rank 0)."""
    out = []
    payload_for = [message(m, size)[1] for m in range(2)]
    for m in range(n):
        dist.barrier(group=cpu)
        if rank == 0:
            until = time.perf_counter() + 50e-6
            while time.perf_counter() < until:
                pass
            s.send([time.monotonic_ns(), payload_for[m % 2]])
        else:
            obj = s.recv()
            arrived = time.monotonic_ns()
            check(obj, m % 2, size)
            out.append((arrived - obj[0]) / 1e3)
    return out


def percentile(sorted_values: list, p: float) -> float:
    return sorted_values[round((len(sorted_values) - 1) * p)] if sorted_values else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,4K,1M", help="payload sizes (K, M suffixes)")
    ap.add_argument("--samples", type=int, default=1000, help="latency samples per row (200 at 1 MiB and up)")
    ap.add_argument("--no-nccl", action="store_true", help="CPU only: a gloo default group, no NCCL row")
    ap.add_argument("--json", help="write the rows here (rank 0)")
    args = ap.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.no_nccl:
        # CPU metadata only: no GPU needed, any number of ranks on one host.
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cpu = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = ferrocomm.from_torch(backend="host" if args.no_nccl else "auto")
    # Slots hold the largest pickled payload with room for the pickle's frame.
    ring = comm.broadcaster(max(sizes) + 4096)
    socket_only = comm.broadcaster(0)
    subjects = [
        ferrocomm_subject("ferrocomm-ring", ring),
        ferrocomm_subject("ferrocomm-socket", socket_only),
        torch_subject("torch-gloo", cpu, torch.device("cpu")),
    ]
    if not args.no_nccl:
        subjects.append(torch_subject("torch-nccl", None, torch.device("cuda", local)))

    rows = []
    if rank == 0:
        print(f"# rank 0 to {world - 1} readers; ring slots of {ring.max_bytes} bytes")
        print(f"{'subject':>18} {'bytes':>9} {'msgs/s':>10} {'MB/s':>9} {'p50_us':>9} {'p99_us':>9}")
    for size in sizes:
        n = min(20000, max(200, (64 << 20) // max(size, 1)))
        samples = 200 if size >= 1 << 20 else args.samples
        for s in subjects:
            stream(s, rank, size, 20, cpu)  # warm-up
            secs = stream(s, rank, size, n, cpu)
            mine = latencies(s, rank, size, samples, cpu)
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=cpu)
            if rank == 0:
                lat = sorted(v for part in gathered for v in part)
                row = {
                    "subject": s.name,
                    "bytes": size,
                    "world": world,
                    "msgs_per_s": n / secs,
                    "mb_per_s": n * size / secs / 1e6,
                    "p50_us": percentile(lat, 0.5),
                    "p99_us": percentile(lat, 0.99),
                }
                rows.append(row)
                print(
                    f"{s.name:>18} {size:>9} {row['msgs_per_s']:>10.0f} {row['mb_per_s']:>9.1f} "
                    f"{row['p50_us']:>9.1f} {row['p99_us']:>9.1f}",
                    flush=True,
                )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ring.close()
    socket_only.close()
    comm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
