"""GPU tests: torch tensors on CUDA at world 2 (torchrun), against torch's
NCCL; CUDA graph capture and replay; the vLLM drop-in; a killed rank.

They skip, saying why, where torch, CUDA or two GPUs are missing; with
FERROCOMM_REQUIRE_GPU=1 they fail instead. Run on a GPU machine:

    FERROCOMM_REQUIRE_GPU=1 python -m pytest python/tests/test_gpu_torch.py -v
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import free_port, gpu_env, why_no_cuda

HERE = Path(__file__).resolve().parent
WORLD = int(os.environ.get("FERROCOMM_GPU_WORLD", "2"))


@pytest.fixture(scope="module", autouse=True)
def need_gpus():
    why = why_no_cuda(WORLD)
    if why is not None:
        if os.environ.get("FERROCOMM_REQUIRE_GPU") == "1":
            pytest.fail(f"FERROCOMM_REQUIRE_GPU=1 but {why}")
        pytest.skip(why)


# FERROCOMM_PY_TEST_TIMEOUT bounds each launch (seconds), for CI jobs with a budget.
LAUNCH_TIMEOUT = float(os.environ.get("FERROCOMM_PY_TEST_TIMEOUT", "600"))


def _torchrun(scenario: str, *args: str, timeout: float = LAUNCH_TIMEOUT) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
        f"--master_port={free_port()}", str(HERE / "_gpu_worker.py"), scenario, *args,
    ]
    p = subprocess.run(cmd, env=gpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print(p.stdout)
    assert p.returncode == 0, f"{scenario} failed (exit {p.returncode}):\n{p.stdout[-6000:]}"
    assert p.stdout.count(f"rank ok: {scenario}") == WORLD, p.stdout[-3000:]
    return p.stdout


def _spawn(scenario: str, timeout: float = min(180.0, LAUNCH_TIMEOUT)) -> list:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_gpu_worker.py"), scenario],
            env=dict(gpu_env(), RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), MASTER_PORT=port),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += "\n[test] killed: the scenario hung"
        outs.append((p.returncode, out))
    for rc, out in outs:
        print(f"--- exit {rc}\n{out}")
    return outs


def test_collectives_match_nccl():
    _torchrun("collectives_vs_nccl")


def test_graph_capture_and_replay():
    out = _torchrun("graph_replay", "300")
    assert "300 replays, 0 wrong" in out


def test_vllm_custom_allreduce_dropin():
    _torchrun("vllm_dropin")


def test_heap_window_ring():
    _torchrun("heap_window_torch")


@pytest.mark.parametrize("scenario", ["killed_rank", "killed_rank_stream_ordered"])
def test_killed_rank_raises(scenario):
    outs = _spawn(scenario)
    assert outs[-1][0] == 17, outs[-1][1]
    for rc, out in outs[:-1]:
        assert rc == 0, out
        assert "CommTimeout" in out, out


def test_ep_dispatch_combine_torch():
    _torchrun("ep_torch")
