"""Every collective on the host backend, at worlds 2 and 3, each rank its
own process, checked bit for bit against NumPy; and the failure cases that
need several ranks (mismatched calls, a killed rank)."""

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from _ranks import expect_ok, launch


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["all_reduce", "data_movement", "reductions_to", "point_to_point"])
def test_collectives(world, scenario):
    expect_ok(launch(world, scenario))


@pytest.mark.parametrize("world", [2, 3])
def test_fused_all_reduce_epilogues(world):
    expect_ok(launch(world, "fused"))


@pytest.mark.parametrize("world", [2, 3])
def test_fused_nvfp4(world):
    """NVFP4 outputs (swizzled and linear scale factors, with and without
    norm_out) against the format's definition in NumPy."""
    expect_ok(launch(world, "fused_nvfp4", timeout=120))


@pytest.mark.parametrize("world", [2, 3])
def test_fused_moe_finalize(world):
    """all_reduce_fused's MoE-finalize prologue (float16 and bfloat16, top-1
    and top-8, shared expert or not, out-of-range indices) against the NumPy
    reference of its rounding order."""
    expect_ok(launch(world, "fused_moe", timeout=180))


def test_fused_moe_finalize_bad_input():
    expect_ok(launch(2, "fused_moe_errors"))


def test_split_and_lifecycle():
    expect_ok(launch(3, "split_and_lifecycle"))


def test_rank_zero_keeps_the_store_until_the_others_leave():
    results = launch(3, "rank_zero_leaves_first", timeout=60)
    expect_ok(results)
    # Rank 0's exit waited for the others' finalize, and said nothing.
    assert "closing the store" not in results[0].output, results[0].output


def test_mismatch_raises_on_every_rank():
    results = launch(2, "mismatch", timeout=60)
    expect_ok(results)


def test_killed_peer_raises_comm_timeout():
    results = launch(3, "killed_peer", timeout=90)
    survivors, dead = results[:-1], results[-1]
    assert dead.returncode == 17, dead.output
    expect_ok(survivors)
    assert all("raised CommTimeout" in r.output for r in survivors), [r.output for r in survivors]
    # Rank 0 waited for the dead rank at exit for its timeout (3 s), no
    # longer, and named it.
    assert "closing the store at exit" in survivors[0].output, survivors[0].output
    assert "never arrived: [2]" in survivors[0].output, survivors[0].output


def test_python_store_object():
    from store_helpers import serve

    authkey = secrets.token_hex(8)
    address, _ = serve(authkey.encode())
    expect_ok(launch(2, "python_store", address, authkey))


@pytest.mark.parametrize("world", [2, 3])
def test_heap_and_windows(world):
    expect_ok(launch(world, "heap_window"))


def test_window_bad_input():
    expect_ok(launch(2, "window_errors"))


def test_window_peer_never_signals():
    results = launch(2, "window_never_signalled", timeout=60)
    expect_ok(results)
    assert "raised CommTimeout" in results[0].output, results[0].output


def test_window_two_threads():
    """Two threads of one rank on one window: a call waiting in Rust (a
    collective tensor_register, a free waiting for queued work) and calls
    from the other thread meanwhile. A lock held while the GIL is released
    hung here; the launcher kills the ranks after the timeout."""
    results = launch(2, "window_threads", timeout=60)
    expect_ok(results)


def run_example(name: str) -> str:
    """python/examples/`name` as a user runs it (it starts its own ranks):
    its stdout, which the ranks share (their lines may interleave)."""
    example = Path(__file__).resolve().parents[1] / "examples" / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    p = subprocess.run([sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_windows_example_runs():
    """python/examples/host_windows.py (the window example of docs/usage.md, "Python")."""
    out = run_example("host_windows.py")
    assert sorted(re.findall(r"rank (\d): got", out)) == ["0", "1", "2"], out


@pytest.mark.parametrize("world", [2, 3])
def test_ep_dispatch_combine(world):
    """EP dispatch + combine, bf16 and fp8 rows, against the NumPy reference."""
    expect_ok(launch(world, "ep", timeout=180))


def test_ep_bad_input():
    expect_ok(launch(2, "ep_errors"))


def test_ep_peer_never_dispatches():
    results = launch(2, "ep_never_dispatched", timeout=60)
    expect_ok(results)
    assert "raised CommTimeout" in results[0].output, results[0].output


def test_ep_example_runs():
    """python/examples/host_ep.py (the EP example of docs/usage.md, "EP dispatch and combine")."""
    out = run_example("host_ep.py")
    assert sorted(re.findall(r"rank (\d): sent", out)) == ["0", "1"], out
    assert out.count("combined rows match") == 2, out


def test_allreduce_example_runs():
    """python/examples/host_allreduce.py (the README's CPU example; CI also
    runs it from a fresh install)."""
    out = run_example("host_allreduce.py")
    assert sorted(re.findall(r"rank (\d): all_reduce", out)) == ["0", "1"], out
