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
