"""Communicator.reduce_scatter_fused (the sequence-parallel fused epilogue)
on the host backend, each rank its own process, at worlds 2 and 3: both
output forms, residual add, RMSNorm and per-token INT8, checked bit for bit
against a NumPy reference of the stated order (the all-reduce form's
values on the same rows), and its argument errors.

This file is also the ranks' worker: ``python test_fused_sp.py SCENARIO``."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ranks import expect_ok, launch  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_fused(world):
    expect_ok(launch(world, "sp_fused", timeout=120, worker=Path(__file__).name))


def test_reduce_scatter_fused_bad_input():
    expect_ok(launch(2, "sp_fused_errors", worker=Path(__file__).name))


# ---------------------------------------------------------------- the ranks


def int8_per_token(normed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token INT8 of normed rows as stored (docs/protocol.md, "Fused
    epilogues"): scale = fmax(amax / 127, 1 / (127 * 512)) in f32, codes
    rint(v / scale) clamped to +-127."""
    v = normed.astype(np.float32)
    amax = np.max(np.abs(v), axis=1).astype(np.float32)
    scale = np.maximum(amax / np.float32(127.0), np.float32(1.0) / np.float32(127.0 * 512.0)).astype(np.float32)
    q = np.clip(np.rint(v / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def sp_fused() -> None:
    """Each rank's shard outputs and the gathered ones, against the
    all-reduce form's values on the same rows computed in NumPy: sum in
    rank order (f32, rounded once), residual add (rounded), RMSNorm in the
    lane order, INT8 per token."""
    import scenarios
    from scenarios import gen, reference, rms_norm_reference, same

    comm = scenarios.comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    for shard, hidden in [(1, 8), (3, 24), (2, 264)]:
        tokens = shard * W
        n = tokens * hidden
        ins = [gen(q, n, np.float16, 91, "normal").reshape(tokens, hidden) for q in range(W)]
        full_res = gen(100, n, np.float16, 92, "normal").reshape(tokens, hidden)
        w = gen(101, hidden, np.float16, 93, "normal")
        ar = reference([x.reshape(-1) for x in ins], "sum").reshape(tokens, hidden)
        want_res = (ar.astype(np.float32) + full_res.astype(np.float32)).astype(np.float16)
        want_norm = rms_norm_reference(want_res, w, 1e-6)
        want_q, want_scale = int8_per_token(want_norm)
        mine = slice(r * shard, (r + 1) * shard)
        what = f"{tokens}x{hidden} world {W} rank {r}"

        # Residual add alone: the shard.
        residual = full_res[mine].copy()
        ar_out = np.zeros((shard, hidden), np.float16)
        comm.reduce_scatter_fused(ins[r].copy(), residual, output="shard", allreduce_out=ar_out)
        same(residual, want_res[mine], f"sp residual_add {what}")
        same(ar_out, ar[mine], f"sp allreduce_out {what}")

        for output, rows in (("gathered", slice(0, tokens)), ("shard", mine)):
            count = rows.stop - rows.start
            residual = full_res[mine].copy()
            normed = np.zeros((count, hidden), np.float16)
            comm.reduce_scatter_fused(ins[r].copy(), residual, w, 1e-6, output=output, norm_out=normed)
            same(residual, want_res[mine], f"sp {output} residual {what}")
            same(normed, want_norm[rows], f"sp {output} rms_norm {what}")

            residual = full_res[mine].copy()
            residual_out = np.zeros_like(residual)
            q = np.zeros((count, hidden), np.int8)
            scale = np.zeros(count, np.float32)
            comm.reduce_scatter_fused(
                ins[r].copy(), residual, w, 1e-6, output=output, pattern="residual_rms_norm_int8_per_token",
                residual_out=residual_out, quant_out=q, scale=scale,
            )
            same(residual, full_res[mine], f"sp {output} residual_in untouched {what}")
            same(residual_out, want_res[mine], f"sp {output} int8 residual_out {what}")
            same(q, want_q[rows], f"sp {output} int8 codes {what}")
            same(scale, want_scale[rows], f"sp {output} int8 scales {what}")
    comm.finalize()


def sp_fused_errors() -> None:
    """Refused before anything runs: tokens not a multiple of the world,
    a full residual, gathered rows for a shard, an unknown output form."""
    import ferrocomm
    import scenarios

    comm = scenarios.comm_from_env(timeout=30)
    W = comm.size
    hidden = 16
    x = np.ones((2 * W, hidden), np.float16)
    res = np.zeros((2, hidden), np.float16)
    w = np.ones(hidden, np.float16)
    cases = [
        ("ragged tokens", lambda: comm.reduce_scatter_fused(np.ones((2 * W + 1, hidden), np.float16), res,
                                                           output="shard"), "not a multiple of the world size"),
        ("full residual", lambda: comm.reduce_scatter_fused(x, np.zeros((2 * W, hidden), np.float16),
                                                           output="shard"), "residual_in must be"),
        ("gathered rows on a shard", lambda: comm.reduce_scatter_fused(
            x, res, w, 1e-6, output="shard", norm_out=np.zeros((2 * W, hidden), np.float16)), "norm_out must be"),
        ("gathered residual add", lambda: comm.reduce_scatter_fused(x, res), "no normed rows to gather"),
        ("unknown output", lambda: comm.reduce_scatter_fused(x, res, output="rows"), "unknown sequence-parallel"),
    ]
    for what, call, want in cases:
        try:
            call()
        except ferrocomm.InvalidArgument as e:
            if want not in str(e):
                raise AssertionError(f"{what}: wrong message {e}") from e
        else:
            raise AssertionError(f"{what}: accepted")
    comm.finalize()


if __name__ == "__main__":
    name = sys.argv[1]
    try:
        globals()[name](*sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)
    print(f"rank ok: {name}")
    sys.exit(0)
