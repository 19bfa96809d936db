"""Run a scenario on N ranks, each its own Python process, rendezvousing
the way a launcher's ranks do: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
and FERROCOMM_TOKEN in the environment (rank 0 hosts the store)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def launch(
    world: int, scenario: str, *args: str, timeout: float = 120, env: dict | None = None, worker: str = "_worker.py"
) -> list[RankResult]:
    """Start `world` workers running `scenarios.<scenario>(comm, *args)` (or
    what another `worker` script beside this file runs) and wait for all of
    them (killing the lot after `timeout` seconds)."""
    base = dict(os.environ)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        FERROCOMM_TOKEN=secrets.token_hex(16),
        PYTHONUNBUFFERED="1",
    )
    base.pop("FERROCOMM_TOKEN_FILE", None)
    base.update(env or {})
    procs = []
    for rank in range(world):
        e = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / worker), scenario, *args],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[launcher] killed after {timeout} s"
        results.append(RankResult(rank, p.returncode, out))
    return results


def expect_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        text = "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.output}" for r in results)
        raise AssertionError(f"ranks {[r.rank for r in bad]} failed:\n{text}")


def why_no_cuda(world: int, shared_ok: bool = False) -> str | None:
    """Why `world` ranks cannot run on CUDA here through torch (None when
    they can): no torch, no CUDA, too few GPUs (unless `shared_ok` and
    FERROCOMM_TEST_SHARE_GPU=1 lets ranks share one), or a ferrocomm built
    without its cuda backend."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    sharing = shared_ok and os.environ.get("FERROCOMM_TEST_SHARE_GPU") == "1"
    if torch.cuda.device_count() < world and not sharing:
        return f"{torch.cuda.device_count()} GPU(s), the tests need {world}"
    import ferrocomm

    if "cuda" not in ferrocomm.BACKENDS:
        return "ferrocomm was built without the cuda backend"
    return None


def gpu_env() -> dict:
    """This environment for GPU ranks: unbuffered output, and never NVLink
    multicast (it can take a shared host's GPUs down; ferrocomm does not
    use it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return env
