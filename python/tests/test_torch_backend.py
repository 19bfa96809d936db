"""ferrocomm as a torch.distributed backend: ``init_process_group("ferrocomm")``
and torch's own APIs on it (every collective, DDP, FSDP2, DTensor, a killed
rank), on CPU tensors (ferrocomm's host backend) and CUDA tensors.

Needs torch; the CUDA cases need a GPU (ranks may share one:
FERROCOMM_TEST_SHARE_GPU=1). They skip, saying why, where those are
missing, and fail instead with FERROCOMM_REQUIRE_TORCH=1 (CPU cases) or
FERROCOMM_REQUIRE_GPU=1 (CUDA cases). CI has no torch; the GPU machine
runs them (ci/gpu-cuda.sh, step `torch`):

    FERROCOMM_REQUIRE_GPU=1 python -m pytest python/tests/test_torch_backend.py -v
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import free_port, gpu_env, launch, why_no_cuda

HERE = Path(__file__).resolve().parent
WORLD = int(os.environ.get("FERROCOMM_TORCH_WORLD", "2"))
TIMEOUT = float(os.environ.get("FERROCOMM_PY_TEST_TIMEOUT", "300"))


def _why_not(kind: str) -> str | None:
    if kind == "cuda":
        return why_no_cuda(WORLD, shared_ok=True)
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed"
    return None


def _need(kind: str) -> None:
    why = _why_not(kind)
    if why is None:
        return
    flag = "FERROCOMM_REQUIRE_GPU" if kind == "cuda" else "FERROCOMM_REQUIRE_TORCH"
    if os.environ.get(flag) == "1" or os.environ.get("FERROCOMM_REQUIRE_GPU") == "1":
        pytest.fail(f"{flag}=1 but {why}")
    pytest.skip(why)


def _torchrun(scenario: str, kind: str) -> str:
    name = f"torch_backend_scenarios:{scenario}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
        f"--master_port={free_port()}", str(HERE / "_gpu_worker.py"), name, kind,
    ]
    p = subprocess.run(cmd, env=gpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    print(p.stdout)
    assert p.returncode == 0, f"{scenario} on {kind} failed (exit {p.returncode}):\n{p.stdout[-6000:]}"
    assert p.stdout.count(f"rank ok: {name}") == WORLD, p.stdout[-3000:]
    return p.stdout


KINDS = ["cpu", "cuda"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", ["collectives", "ddp", "fsdp", "dtensor"])
def test_torch_api_on_ferrocomm(scenario: str, kind: str) -> None:
    _need(kind)
    _torchrun(scenario, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_freed_and_reused_address(kind: str) -> None:
    _need(kind)
    _torchrun("reused_address", kind)


def test_cpu_gloo_cuda_ferrocomm() -> None:
    _need("cuda")
    _torchrun("mixed", "cuda")


@pytest.mark.parametrize("kind", KINDS)
def test_killed_rank_raises_within_the_timeout(kind: str) -> None:
    _need(kind)
    outs = launch(
        WORLD, "torch_backend_scenarios:killed_rank", kind, timeout=120, env=gpu_env(), worker="_gpu_worker.py"
    )
    for r in outs:
        print(f"--- rank {r.rank} exit {r.returncode}\n{r.output}")
    assert outs[-1].returncode == 17, outs[-1].output
    for r in outs[:-1]:
        assert r.returncode == 0 and "raised" in r.output, r.output
