"""GPU tests of ``ferrocomm.ops`` (all_gather_matmul, matmul_reduce_scatter)
at world 2 under torchrun: float32 and bfloat16, several shapes and dims,
against references from every rank's inputs (tolerances in
overlap_torch_scenarios.py), and one CUDA graph capture replayed with new
data. Ranks may share a GPU (FERROCOMM_TEST_SHARE_GPU=1): no NCCL is used.

They skip, saying why, where torch, CUDA or the GPUs are missing; with
FERROCOMM_REQUIRE_GPU=1 they fail instead. Run on a GPU machine:

    FERROCOMM_REQUIRE_GPU=1 python -m pytest python/tests/test_overlap_torch.py -v
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
LAUNCH_TIMEOUT = float(os.environ.get("FERROCOMM_PY_TEST_TIMEOUT", "600"))


@pytest.fixture(scope="module", autouse=True)
def need_gpus():
    why = why_no_cuda(WORLD, shared_ok=True)
    if why is not None:
        if os.environ.get("FERROCOMM_REQUIRE_GPU") == "1":
            pytest.fail(f"FERROCOMM_REQUIRE_GPU=1 but {why}")
        pytest.skip(why)


def _torchrun(scenario: str, *args: str) -> str:
    name = f"overlap_torch_scenarios:{scenario}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
        f"--master_port={free_port()}", str(HERE / "_gpu_worker.py"), name, *args,
    ]
    p = subprocess.run(
        cmd, env=gpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LAUNCH_TIMEOUT
    )
    print(p.stdout)
    assert p.returncode == 0, f"{scenario} failed (exit {p.returncode}):\n{p.stdout[-6000:]}"
    assert p.stdout.count(f"rank ok: {name}") == WORLD, p.stdout[-3000:]
    return p.stdout


def test_overlap_matches_reference():
    _torchrun("overlap_vs_reference")


def test_overlap_graph_capture_and_replay():
    _torchrun("overlap_graph_replay", "20")
