"""What each rank of a multi-process host test runs (see _ranks.py).

Every rank draws every rank's input from (salt, rank, size), so each can
compute the exact result in NumPy and compare it bit for bit. Float
reductions follow ferrocomm's rule: widen to f32, combine in rank order
0..n-1, (divide for avg), round once to the dtype.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import numpy as np

import ferrocomm
from ferrocomm import ReduceOp

REDUCIBLE_FLOATS = [np.float32, np.float16]
MOVED = [np.float32, np.float16, np.int32, np.int8, np.uint8, np.int64, np.float64, np.bool_]
SIZES = [1, 7, 1000, 65537]


def gen(rank: int, n: int, dtype, salt: int = 0, kind: str = "small") -> np.ndarray:
    """Rank `rank`'s input: small integers (exact in every reducible dtype),
    or Gaussian floats (`kind="normal"`), or factors for prod."""
    rng = np.random.default_rng([salt, rank, n])
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if dtype == np.uint8:
        return rng.integers(0, 256, n).astype(np.uint8)
    if kind == "normal":
        return rng.standard_normal(n).astype(dtype)
    if kind == "prod":
        return rng.choice(np.array([-2.0, -1.0, 0.5, 1.0, 2.0]), n).astype(dtype)
    return rng.integers(-8, 9, n).astype(dtype)


def reference(inputs: list[np.ndarray], op: str, factors: list[float] | None = None) -> np.ndarray:
    """ferrocomm's reduction of `inputs` (one per rank, in rank order)."""
    dtype = inputs[0].dtype
    if dtype == np.int32:
        acc = inputs[0].copy()
        for x in inputs[1:]:
            acc = {
                "sum": lambda a, b: a + b,
                "min": np.minimum,
                "max": np.maximum,
                "band": np.bitwise_and,
                "bor": np.bitwise_or,
                "bxor": np.bitwise_xor,
            }[op](acc, x)
        return acc.astype(np.int32)
    wide = [x.astype(np.float32) for x in inputs]
    if op == "premul_sum":
        wide = [w * np.float32(f) for w, f in zip(wide, factors)]
    acc = wide[0].copy()
    for w in wide[1:]:
        if op in ("sum", "avg", "premul_sum"):
            acc = acc + w
        elif op == "prod":
            acc = acc * w
        elif op == "min":
            acc = np.minimum(acc, w)
        elif op == "max":
            acc = np.maximum(acc, w)
    if op == "avg":
        acc = acc / np.float32(len(inputs))
    return acc.astype(dtype)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
        raise AssertionError(f"{what}: {bad.size} bytes differ (first at byte {bad[:5]}): got {got[:8]} want {want[:8]}")


def comm_from_env(**kw) -> ferrocomm.Communicator:
    return ferrocomm.init(backend="host", **kw)


# ---------------------------------------------------------------- scenarios


def all_reduce() -> None:
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    salt = 1
    for dtype in REDUCIBLE_FLOATS:
        for op in ["sum", "prod", "min", "max", "avg"]:
            for n in SIZES:
                salt += 1
                kind = "prod" if op == "prod" else "small"
                ins = [gen(q, n, dtype, salt, kind) for q in range(W)]
                t = ins[r].copy()
                comm.all_reduce(t, getattr(ReduceOp, op.upper()))
                same(t, reference(ins, op), f"all_reduce {op} {np.dtype(dtype)} n={n}")
        # premul_sum: each rank scales its own input by its own factor.
        factors = [0.25 * (q + 1) for q in range(W)]
        ins = [gen(q, 1000, dtype, 99) for q in range(W)]
        t = ins[r].copy()
        comm.all_reduce(t, ReduceOp.premul_sum(factors[r]))
        same(t, reference(ins, "premul_sum", factors), f"premul_sum {np.dtype(dtype)}")
        # ... and the factor as a one-element array of the dtype.
        t = ins[r].copy()
        comm.all_reduce(t, ReduceOp.premul_sum(np.array([factors[r]], dtype=dtype)))
        same(t, reference(ins, "premul_sum", factors), f"premul_sum (tensor factor) {np.dtype(dtype)}")
    for op in ["sum", "min", "max", "band", "bor", "bxor"]:
        for n in SIZES:
            salt += 1
            ins = [gen(q, n, np.int32, salt) for q in range(W)]
            t = ins[r].copy()
            comm.all_reduce(t, op)  # ops by name work too
            same(t, reference(ins, op), f"all_reduce {op} int32 n={n}")
    # Gaussian f32: rank-order f32 accumulation is still bitwise reproducible.
    ins = [gen(q, 4099, np.float32, 7, "normal") for q in range(W)]
    t = ins[r].copy()
    comm.all_reduce(t)
    same(t, reference(ins, "sum"), "all_reduce sum of Gaussian f32")
    # 2-D and 0-d arrays, async work, timeouts as timedelta.
    ins = [gen(q, 24, np.float32, 8).reshape(4, 6) for q in range(W)]
    t = ins[r].copy()
    work = comm.all_reduce(t, async_op=True, timeout=datetime.timedelta(seconds=30))
    assert work.wait() is True and work.is_completed(), "async all_reduce"
    same(t, reference(ins, "sum"), "all_reduce 2-D async")
    # Out of place: the input is only read (it may be read-only).
    src = ins[r].copy()
    src.setflags(write=False)
    out = np.zeros_like(src)
    comm.all_reduce_into(out, src)
    same(out, reference(ins, "sum"), "all_reduce_into")
    same(src, ins[r], "all_reduce_into leaves its input alone")
    s = np.array(float(r + 1), dtype=np.float32)
    comm.all_reduce(s)
    assert float(s) == W * (W + 1) / 2, f"0-d all_reduce: {s}"
    empty = np.zeros(0, dtype=np.float32)
    comm.all_reduce(empty)
    comm.finalize()


def data_movement() -> None:
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    salt = 1000
    for dtype in MOVED:
        for n in [1, 7, 4097]:
            salt += 1
            ins = [gen(q, n, dtype, salt) for q in range(W)]
            name = f"{np.dtype(dtype)} n={n}"
            # broadcast (from the last rank)
            t = ins[r].copy()
            comm.broadcast(t, root=W - 1)
            same(t, ins[W - 1], f"broadcast {name}")
            # all_gather (list) and all_gather_single
            outs = [np.zeros(n, dtype) for _ in range(W)]
            comm.all_gather(outs, ins[r])
            for q in range(W):
                same(outs[q], ins[q], f"all_gather[{q}] {name}")
            whole = np.zeros(n * W, dtype)
            comm.all_gather_single(whole, ins[r])
            same(whole, np.concatenate(ins), f"all_gather_single {name}")
            # gather / scatter to and from rank 0
            outs = [np.zeros(n, dtype) for _ in range(W)] if r == 0 else []
            comm.gather(outs, ins[r], root=0)
            if r == 0:
                for q in range(W):
                    same(outs[q], ins[q], f"gather[{q}] {name}")
            blocks = [gen(q, n, dtype, salt + 7) for q in range(W)]
            out = np.zeros(n, dtype)
            comm.scatter(out, blocks if r == 0 else [], root=0)
            same(out, blocks[r], f"scatter {name}")
            # all_to_all_single: block q of rank s's input lands in block s on rank q
            a2a = [gen(q, n * W, dtype, salt + 11) for q in range(W)]
            out = np.zeros(n * W, dtype)
            comm.all_to_all_single(out, a2a[r])
            want = np.concatenate([a2a[s][r * n : (r + 1) * n] for s in range(W)])
            same(out, want, f"all_to_all_single {name}")
    # all_to_all with lists of different lengths per peer: rank s sends s+q+1 to q.
    length = lambda s, q: s + q + 1  # noqa: E731
    sends = [[gen(s * 10 + q, length(s, q), np.float32, 5) for q in range(W)] for s in range(W)]
    outs = [np.zeros(length(s, r), np.float32) for s in range(W)]
    comm.all_to_all(outs, sends[r])
    for s in range(W):
        same(outs[s], sends[s][r], f"all_to_all from {s}")
    # all_to_all_v_single on 2-D tensors: splits count rows, as torch's do.
    cols = 3
    rows = lambda s, q: (s + 2 * q) % 3 + 1  # noqa: E731
    inputs = [
        np.concatenate([gen(s * 10 + q, rows(s, q) * cols, np.int64, 6).reshape(-1, cols) for q in range(W)])
        for s in range(W)
    ]
    out = np.zeros((sum(rows(s, r) for s in range(W)), cols), np.int64)
    comm.all_to_all_v_single(out, inputs[r], [rows(s, r) for s in range(W)], [rows(r, q) for q in range(W)])
    want = []
    for s in range(W):
        start = sum(rows(s, q) for q in range(r))
        want.append(inputs[s][start : start + rows(s, r)])
    same(out, np.concatenate(want), "all_to_all_v_single 2-D")
    comm.finalize()


def rms_norm_f32(rows: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ferrocomm's RMSNorm order (docs/protocol.md, "Fused epilogues") on
    float32 rows and weight, before the rounding: per row, 32 f32 partials
    (pack i of 8 elements into partial i % 32, element by element), a
    butterfly over the partials, rstd = 1/sqrt(ss/hidden + eps),
    y = (x * rstd) * w, all in f32."""
    tokens, hidden = rows.shape
    out = np.empty((tokens, hidden), np.float32)
    for t in range(tokens):
        row = rows[t].astype(np.float32)
        p = np.zeros(32, dtype=np.float32)
        for i in range(hidden // 8):
            for e in row[8 * i : 8 * i + 8]:
                p[i % 32] = np.float32(p[i % 32] + np.float32(e * e))
        for m in (16, 8, 4, 2, 1):
            p = np.array([np.float32(p[l] + p[l ^ m]) for l in range(32)], dtype=np.float32)
        ss = p[0]
        rstd = np.float32(1.0) / np.sqrt(np.float32(ss / np.float32(hidden)) + np.float32(eps))
        out[t] = (row * np.float32(rstd)) * w.astype(np.float32)
    return out


def rms_norm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm_f32 of rows of a NumPy float dtype, rounded once to it."""
    return rms_norm_f32(x.astype(np.float32), w.astype(np.float32), eps).astype(x.dtype)


def fused() -> None:
    """all_reduce_fused on NumPy float16 rows: residual add and RMSNorm,
    bit for bit against the stated order."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    for tokens, hidden in [(1, 8), (5, 24), (3, 264)]:
        n = tokens * hidden
        ins = [gen(q, n, np.float16, 77, "normal").reshape(tokens, hidden) for q in range(W)]
        res = gen(100, n, np.float16, 78, "normal").reshape(tokens, hidden)
        w = gen(101, hidden, np.float16, 79, "normal")
        ar = reference([x.reshape(-1) for x in ins], "sum").reshape(tokens, hidden)
        want_res = (ar.astype(np.float32) + res.astype(np.float32)).astype(np.float16)
        residual = res.copy()
        comm.all_reduce_fused(ins[r].copy(), residual)
        same(residual, want_res, f"fused residual_add {tokens}x{hidden}")
        residual = res.copy()
        normed = np.zeros_like(res)
        comm.all_reduce_fused(ins[r].copy(), residual, w, 1e-6, norm_out=normed)
        same(residual, want_res, f"fused residual {tokens}x{hidden}")
        same(normed, rms_norm_reference(want_res, w, 1e-6), f"fused rms_norm {tokens}x{hidden}")
    try:
        comm.all_reduce_fused(ins[r].copy(), res.copy(), w, 1e-6)
    except ferrocomm.InvalidArgument:
        pass
    else:
        raise AssertionError("a norm without norm_out must be refused")
    comm.finalize()


# NVFP4 outputs of the fused epilogue: the format from its definition
# (docs/protocol.md, "NVFP4 outputs"), independent of the Rust twin.
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E4M3_VALUES = [m * 2.0**-9 if e == 0 else (8 + m) * 2.0 ** (e - 10) for e in range(16) for m in range(8)][:0x7F]


def nearest_code(table: list[float], a: float) -> int:
    """The code of |a| in an ascending table of magnitudes: nearest, ties to
    the even code, saturated to the last."""
    if a >= table[-1]:
        return len(table) - 1
    hi = next(i for i, v in enumerate(table) if v >= a)
    if table[hi] == a or hi == 0:
        return hi
    lo = hi - 1
    dl, dh = a - table[lo], table[hi] - a
    return lo if dl < dh else hi if dh < dl else (lo if lo % 2 == 0 else hi)


def nvfp4_block(y: np.ndarray, gs: np.float32) -> tuple[bytes, int]:
    """16 normed values (float32) -> 8 bytes of e2m1 codes and the e4m3
    scale factor: sf = e4m3(gs * (amax * (1/6))), out = 1 / (sf * (1/gs))
    (0 if sf is 0), codes e2m1(y * out); every step rounded to f32."""
    f = np.float32
    amax = f(np.fmax.reduce(np.abs(y), initial=f(0)))
    sfv = f(gs * f(amax * f(f(1) / f(6))))
    sf = nearest_code(E4M3_VALUES, float(sfv))
    v = f(E4M3_VALUES[sf])
    out = f(f(1) / f(v * f(f(1) / gs))) if v != 0 else f(0)
    codes = []
    for x in y:
        q = f(x * out)
        codes.append(nearest_code(E2M1_VALUES, abs(float(q))) | (8 if np.signbit(q) else 0))
    return bytes(codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)), sf


def sf_offset(layout: str, m: int, k: int, cols: int) -> int:
    if layout == "linear":
        return m * cols + k
    return (m // 128) * ((cols + 3) // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def fused_nvfp4() -> None:
    """all_reduce_fused with NVFP4 outputs (both layouts, with and without
    norm_out) on NumPy float16 rows, bit for bit against the format's
    definition; the swizzled padding is left as it was."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    gs = np.float32(336.0)
    for (tokens, hidden), layout in [((3, 48), "swizzled"), ((130, 32), "swizzled"), ((5, 64), "linear")]:
        n, cols = tokens * hidden, hidden // 16
        ins = [gen(q, n, np.float16, 81, "normal").reshape(tokens, hidden) for q in range(W)]
        res = gen(100, n, np.float16, 82, "normal").reshape(tokens, hidden)
        w = gen(101, hidden, np.float16, 83, "normal")
        ar = reference([x.reshape(-1) for x in ins], "sum").reshape(tokens, hidden)
        want_res = (ar.astype(np.float32) + res.astype(np.float32)).astype(np.float16)
        normed = rms_norm_reference(want_res, w, 1e-6).astype(np.float32)
        sf_bytes = ((tokens + 127) // 128 * 128) * ((cols + 3) // 4 * 4) if layout == "swizzled" else tokens * cols
        want_q = bytearray()
        want_sf = np.full(sf_bytes, 0xAA, np.uint8)
        for m in range(tokens):
            for k in range(cols):
                codes, sf = nvfp4_block(normed[m, 16 * k : 16 * k + 16], gs)
                want_q += codes
                want_sf[sf_offset(layout, m, k, cols)] = sf
        for with_norm in (False, True):
            what = f"fused nvfp4 {tokens}x{hidden} {layout} norm_out={with_norm}"
            residual = res.copy()
            quant = np.zeros((tokens, hidden // 2), np.uint8)
            sfs = np.full(sf_bytes, 0xAA, np.uint8)
            norm_out = np.zeros_like(res) if with_norm else None
            comm.all_reduce_fused(
                ins[r].copy(), residual, w, 1e-6, pattern="residual_rms_norm_nvfp4", norm_out=norm_out,
                quant_out=quant, scale=np.array([gs], np.float32), sf_out=sfs, sf_layout=layout,
            )
            same(residual, want_res, f"{what} residual")
            same(quant.reshape(-1), np.frombuffer(bytes(want_q), np.uint8), f"{what} quant_out")
            same(sfs, want_sf, f"{what} sf_out")
            if with_norm:
                same(norm_out, normed.astype(np.float16), f"{what} norm_out")
    # hidden not a multiple of 16, and an unknown layout, are refused.
    x = gen(r, 24, np.float16, 84, "normal").reshape(1, 24)
    for kw in ({}, {"sf_layout": "rowwise"}):
        try:
            comm.all_reduce_fused(
                x, x.copy(), w[:24], 1e-6, pattern="rms_nvfp4", quant_out=np.zeros(12, np.uint8),
                scale=np.array([gs], np.float32), sf_out=np.zeros(512, np.uint8), **kw,
            )
        except ferrocomm.InvalidArgument as e:
            assert ("multiple of 16" in str(e)) if not kw else ("layout" in str(e)), e
        else:
            raise AssertionError(f"nvfp4 with hidden 24 {kw} must be refused")
    comm.finalize()


# MoE finalize (all_reduce_fused's prologue): each rank's rows finalized
# from its experts' output in the stated order (docs/protocol.md, "MoE
# finalize"), then all-reduced, residual added and normed as above. float16
# rows are NumPy arrays; bfloat16 ones (NumPy has none) are heap tensors,
# written and read as their bits. Values are carried as uint16 bits.

class Half:
    """float16 or bfloat16: rounding float32 to its bits and back, and
    tensors of it a fused call takes."""

    NAN = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # the canonical NaNs ferrocomm writes

    def __init__(self, comm: ferrocomm.Communicator, name: str) -> None:
        self.comm, self.name = comm, name

    def bits(self, f: np.ndarray) -> np.ndarray:
        """float32 to the dtype's bits, nearest even, NaN canonical."""
        f = np.asarray(f, np.float32)
        b = f.astype(np.float16).view(np.uint16) if self.name == "float16" else bf16_bits(f)
        return np.where(np.isnan(f), np.uint16(self.NAN[self.name]), b).astype(np.uint16)

    def f32(self, bits: np.ndarray) -> np.ndarray:
        bits = np.asarray(bits, np.uint16)
        return bits.view(np.float16).astype(np.float32) if self.name == "float16" else bf16_float(bits)

    def tensor(self, bits: np.ndarray):
        """A new tensor of this dtype holding `bits` (a bfloat16 heap
        tensor is collective: every rank makes the same ones in order)."""
        if self.name == "float16":
            return bits.astype(np.uint16).view(np.float16).copy()
        t = self.comm.heap_tensor(bits.shape, "bfloat16")
        self.write(t, bits)
        return t

    def write(self, t, bits: np.ndarray) -> None:
        view = t.view(np.uint16) if self.name == "float16" else np.from_dlpack(t.bits())
        view[...] = bits

    def read(self, t) -> np.ndarray:
        return (t.view(np.uint16) if self.name == "float16" else np.from_dlpack(t.bits())).copy()


def moe_finalize_reference(h: Half, experts: np.ndarray, idx: np.ndarray, scales: np.ndarray,
                           shared: np.ndarray | None) -> np.ndarray:
    """One rank's finalized rows (bits, tokens x hidden): per element
    acc = shared (or +0), then for k in order acc = acc + f32(scale * x),
    the product rounded before the add (NumPy never fuses them), an index
    outside [0, permuted_rows) skipping its term; rounded once."""
    rows, hidden = experts.shape
    tokens, topk = idx.shape
    e = h.f32(experts)
    out = np.empty((tokens, hidden), np.uint16)
    for t in range(tokens):
        acc = h.f32(shared[t]) if shared is not None else np.zeros(hidden, np.float32)
        for k in range(topk):
            p = int(idx[t, k])
            if 0 <= p < rows:
                acc = acc + np.float32(scales[t, k]) * e[p]
        out[t] = h.bits(acc)
    return out


def fused_moe() -> None:
    """all_reduce_fused with the MoE-finalize prologue, bit for bit against
    the stated order: float16 and bfloat16, top-1 and top-8, with and
    without a shared expert, out-of-range permuted indices (skipped), the
    router weights in float32 and in the dtype, a flat index with topk
    given, both kernel families; residual add (with allreduce_out) and
    RMSNorm."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    eps = 1e-6
    case = 0
    for dt in ("float16", "bfloat16"):
        h = Half(comm, dt)
        for topk in (1, 8):
            for with_shared in (False, True):
                case += 1
                tokens, hidden = [(5, 264), (4, 24)][(topk == 8) ^ with_shared]
                pairs = tokens * topk
                rows = pairs + 3  # rows no token routes to
                what = f"fused moe {dt} topk={topk} shared={with_shared} {tokens}x{hidden} ({rows} expert rows)"
                # The routing and weights are the same on every rank (tensor
                # parallelism); the experts' and shared expert's partial
                # outputs differ by rank.
                rng = np.random.default_rng([91, case])
                idx = rng.permutation(rows)[:pairs].astype(np.int32).reshape(tokens, topk)
                # Out of range, skipped: token 0's odd k (its only one at
                # top-1), and the last token's last.
                outside = [-1, rows, 2**31 - 1, -(2**31)]
                if topk == 1:
                    idx[0, 0] = -1
                for k in range(1, topk, 2):
                    idx[0, k] = outside[(k // 2) % 4]
                idx[tokens - 1, topk - 1] = rows + 5
                raw_scales = (0.5 * rng.standard_normal((tokens, topk))).astype(np.float32)
                res = h.bits(rng.standard_normal((tokens, hidden)))
                w = h.bits(rng.standard_normal(hidden))

                def rank_data(q):
                    g = np.random.default_rng([92, case, q])
                    experts = h.bits(g.standard_normal((rows, hidden)))
                    shared = h.bits(g.standard_normal((tokens, hidden))) if with_shared else None
                    return experts, shared

                data = [rank_data(q) for q in range(W)]
                experts_t = h.tensor(data[r][0])
                shared_t = h.tensor(data[r][1]) if with_shared else None
                residual_t = h.tensor(res)
                w_t = h.tensor(w)
                aux_t = h.tensor(np.zeros((tokens, hidden), np.uint16))  # allreduce_out, then norm_out
                dt_scales = h.bits(raw_scales)
                dt_scales_t = h.tensor(dt_scales)

                def want(scales_f32):
                    xs = [moe_finalize_reference(h, e, idx, scales_f32, sh) for e, sh in data]
                    acc = h.f32(xs[0])
                    for x in xs[1:]:
                        acc = acc + h.f32(x)
                    ar = h.bits(acc)
                    residual = h.bits(h.f32(ar) + h.f32(res))
                    normed = h.bits(rms_norm_f32(h.f32(residual), h.f32(w), eps))
                    return ar, residual, normed

                want_f32 = want(raw_scales)
                want_dt = want(h.f32(dt_scales))
                calls = [
                    # (scales, their reference, pattern, algo hint, flat index)
                    (raw_scales, want_f32, "residual_add", "oneshot", False),
                    (dt_scales_t, want_dt, "residual_rms_norm", "twoshot", True),
                    (raw_scales, want_f32, "residual_rms_norm", None, False),
                ]
                for scales, (ar, residual, normed), pattern, algo, flat in calls:
                    label = f"{what} {pattern} algo={algo or 'auto'} scales={'float32' if scales is raw_scales else dt}"
                    h.write(residual_t, res)
                    h.write(aux_t, np.full((tokens, hidden), 0x7E01, np.uint16))
                    kw = dict(
                        expanded_idx_to_permuted_idx=idx.reshape(-1) if flat else idx,
                        expert_scales=scales,
                        shared_expert_output=shared_t,
                        hints={"algo": algo} if algo else None,
                    )
                    if flat:
                        kw["topk"] = topk
                    if pattern == "residual_add":
                        comm.all_reduce_fused(experts_t, residual_t, allreduce_out=aux_t, **kw)
                        same(h.read(aux_t), ar, f"{label}: allreduce_out")
                    else:
                        comm.all_reduce_fused(experts_t, residual_t, w_t, eps, norm_out=aux_t, **kw)
                        same(h.read(aux_t), normed, f"{label}: norm_out")
                    same(h.read(residual_t), residual, f"{label}: residual")
                # Async, and the experts' rows untouched.
                h.write(residual_t, res)
                work = comm.all_reduce_fused(
                    experts_t, residual_t, expanded_idx_to_permuted_idx=idx, expert_scales=raw_scales,
                    shared_expert_output=shared_t, async_op=True,
                )
                work.wait()
                same(h.read(residual_t), want_f32[1], f"{what} async_op: residual")
                same(h.read(experts_t), data[r][0], f"{what}: the experts' output is only read")
    comm.barrier()  # rank 0 hosts the store: nobody leaves while others still use it
    comm.finalize()


def fused_moe_errors() -> None:
    """Bad MoE-finalize arguments are refused with InvalidArgument (a
    ValueError) on every rank, before anything is queued: the
    communicator works on afterwards."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    tokens, hidden, topk = 3, 16, 2
    rows = tokens * topk + 1
    experts = np.ones((rows, hidden), np.float16)
    residual = np.zeros((tokens, hidden), np.float16)
    idx = np.arange(tokens * topk, dtype=np.int32).reshape(tokens, topk)
    scales = np.full((tokens, topk), 0.5, np.float32)
    shared = np.ones((tokens, hidden), np.float16)

    def refused(what, needle, args=(experts, residual), **kw):
        try:
            comm.all_reduce_fused(*args, **kw)
        except ferrocomm.InvalidArgument as e:
            assert isinstance(e, ValueError), type(e)
            assert needle in str(e), f"{what}: {needle!r} not in {e}"
            if r == 0:
                print(f"refused {what}: {e}", flush=True)
        else:
            raise AssertionError(f"{what} must be refused")

    moe = dict(expanded_idx_to_permuted_idx=idx, expert_scales=scales)
    refused("the index alone", "expert_scales missing", expanded_idx_to_permuted_idx=idx)
    refused("the scales alone", "expanded_idx_to_permuted_idx missing", expert_scales=scales, topk=topk)
    refused("a shared expert alone", "expanded_idx_to_permuted_idx and expert_scales missing",
            shared_expert_output=shared)
    refused("topk alone", "missing (given: topk)", topk=2)
    refused("topk 0", "topk = 0 must be 1 to 32", topk=0, **moe)
    refused("topk 33", "topk = 33 must be 1 to 32", topk=33, **moe)
    refused("topk -1", "topk = -1 must be 1 to 32", topk=-1, **moe)
    refused("topk 2.0", "must be an int", topk=2.0, **moe)
    refused("topk True", "must be an int", topk=True, **moe)
    refused("topk against the index's shape", "is 3 x 2, not tokens x topk (topk = 1)", topk=1, **moe)
    refused("a flat index without topk", "give topk",
            expanded_idx_to_permuted_idx=idx.reshape(-1), expert_scales=scales.reshape(-1))
    refused("an int64 index", "expanded_idx_to_permuted_idx must be 6 x i32",
            expanded_idx_to_permuted_idx=idx.astype(np.int64), expert_scales=scales)
    refused("float64 scales", "expert_scales must be 6 x f32 or 6 x f16",
            expanded_idx_to_permuted_idx=idx, expert_scales=scales.astype(np.float64))
    refused("int32 scales", "expert_scales must be", expanded_idx_to_permuted_idx=idx,
            expert_scales=scales.astype(np.int32))
    refused("a flat index of another token count", "expanded_idx_to_permuted_idx must be 6 x i32",
            expanded_idx_to_permuted_idx=idx[:2].reshape(-1), expert_scales=scales.reshape(-1), topk=2)
    refused("a shared expert of float32", "shared_expert_output must be",
            shared_expert_output=shared.astype(np.float32), **moe)
    refused("a shared expert of other rows", "shared_expert_output must be", shared_expert_output=shared[:2], **moe)
    refused("experts' rows of another width", "has rows of 24 but residual rows of 16",
            args=(np.ones((rows, hidden + 8), np.float16), residual), **moe)
    refused("experts' rows not whole", "not a whole number of rows",
            args=(np.ones(rows * hidden + 8, np.float16), residual.reshape(-1)), **moe)
    refused("allreduce_out = input", "overlaps", allreduce_out=experts[:tokens], **moe)
    refused("norm_out over the shared expert", "overlaps", args=(experts, residual, np.ones(hidden, np.float16)),
            norm_out=shared, shared_expert_output=shared, **moe)
    # The native layer checks the same by itself.
    native = comm._host_comm()
    for what, kw, needle in [
        ("native: the index alone", dict(expanded_idx_to_permuted_idx=idx), "topk missing"),
        ("native: no topk", dict(expanded_idx_to_permuted_idx=idx, expert_scales=scales), "topk missing"),
        ("native: topk -3", dict(expanded_idx_to_permuted_idx=idx, expert_scales=scales, topk=-3), "topk = -3"),
        ("native: a shared expert alone", dict(shared_expert_output=shared), "shared_expert_output given"),
    ]:
        try:
            native.all_reduce_fused(experts, residual, residual, "residual_add", hidden, **kw)
        except ferrocomm.InvalidArgument as e:
            assert needle in str(e), f"{what}: {needle!r} not in {e}"
        else:
            raise AssertionError(f"{what} must be refused")
    # Nothing was queued: the communicator goes on, an empty call included.
    comm.all_reduce_fused(np.ones((0, hidden), np.float16), np.zeros((0, hidden), np.float16),
                          expanded_idx_to_permuted_idx=np.zeros((0, topk), np.int32),
                          expert_scales=np.zeros((0, topk), np.float32))
    comm.all_reduce_fused(experts, residual, **moe)
    same(residual, np.full((tokens, hidden), W * 2 * 0.5, np.float16), "a MoE call after the refused ones")
    comm.barrier()
    comm.finalize()


def reductions_to() -> None:
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    for dtype, op in [(np.float32, "sum"), (np.float16, "max"), (np.int32, "bxor"), (np.float32, "avg")]:
        for n in [1, 5, 3001]:
            name = f"{op} {np.dtype(dtype)} n={n}"
            # reduce to the last rank (in place there)
            ins = [gen(q, n, dtype, 21) for q in range(W)]
            t = ins[r].copy()
            comm.reduce(t, root=W - 1, op=op)
            if r == W - 1:
                same(t, reference(ins, op), f"reduce {name}")
            # reduce_scatter_single: block q of every rank's input, reduced, on rank q
            ins = [gen(q, n * W, dtype, 22) for q in range(W)]
            out = np.zeros(n, dtype)
            comm.reduce_scatter_single(out, ins[r], op=op)
            same(out, reference([x[r * n : (r + 1) * n] for x in ins], op), f"reduce_scatter_single {name}")
            # reduce_scatter with a list
            lists = [[gen(q * 10 + k, n, dtype, 23) for k in range(W)] for q in range(W)]
            out = np.zeros(n, dtype)
            comm.reduce_scatter(out, lists[r], op=op)
            same(out, reference([lists[q][r] for q in range(W)], op), f"reduce_scatter {name}")
    comm.finalize()


def point_to_point() -> None:
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    # A ring as one batch (it cannot deadlock on its own order).
    nxt, prv = (r + 1) % W, (r - 1) % W
    mine = gen(r, 513, np.float32, 31)
    got = np.zeros(513, np.float32)
    works = comm.batch_isend_irecv([ferrocomm.P2POp("isend", mine, nxt), ferrocomm.P2POp("irecv", got, prv)])
    for w in works:
        w.wait()
    same(got, gen(prv, 513, np.float32, 31), "ring batch")
    # Plain send/recv: rank 0 to rank 1, then back, with async work.
    if r == 0:
        comm.send(gen(0, 100, np.int32, 32), dst=1)
        back = np.zeros(100, np.int32)
        w = comm.recv(back, src=1, async_op=True)
        w.wait(timeout=30)
        same(back, gen(1, 100, np.int32, 32), "recv from 1")
    elif r == 1:
        t = np.zeros(100, np.int32)
        comm.recv(t, src=0)
        same(t, gen(0, 100, np.int32, 32), "recv from 0")
        comm.send(gen(1, 100, np.int32, 32), dst=0)
    comm.barrier()
    comm.barrier(async_op=True).wait()
    comm.finalize()


def split_and_lifecycle() -> None:
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    assert comm.backend == "host" and comm.get_size() == W and comm.get_rank() == r
    # The group of every rank but 0, in reverse order.
    members = list(range(W - 1, 0, -1))
    sub = comm.split(members, name="tail")
    if r == 0:
        assert sub is None, "rank 0 is not in the split"
    else:
        assert sub.size == W - 1 and sub.rank == members.index(r) and sub.name == "tail", repr(sub)
        t = np.full(10, float(r), np.float32)
        sub.all_reduce(t)
        assert float(t[0]) == sum(members), t
        sub.finalize()
    # The parent still works after the split.
    t = np.ones(4, np.float32)
    comm.all_reduce(t)
    assert float(t[0]) == W
    comm.finalize()
    try:
        comm.all_reduce(t)
    except ferrocomm.Finalized:
        pass
    else:
        raise AssertionError("a call after finalize must raise Finalized")
    try:
        comm.finalize()
    except ferrocomm.Finalized:
        pass
    else:
        raise AssertionError("a second finalize must raise Finalized")


def rank_zero_leaves_first() -> None:
    """Rank 0 hosts the store and returns right after a split it takes
    part in, dropping its communicator unfinalized; the others go on using
    the store a second later (a split of their own and a collective on it).
    ferrocomm keeps rank 0's store until they have finalized: its exit
    waits for them rather than closing the store under them."""
    comm = comm_from_env(timeout=30)
    W, r = comm.size, comm.rank
    rest = comm.split(list(range(1, W)), name="rest")
    if r == 0:
        print(f"rank 0 returns at {time.monotonic():.3f}", flush=True)
        return
    time.sleep(1.0)
    again = rest.split(list(range(rest.size)), name="again")
    t = np.full(6, float(r), np.float32)
    again.all_reduce(t)
    assert float(t[0]) == sum(range(1, W)), t
    again.finalize()
    rest.finalize()
    comm.finalize()
    print(f"rank {r} finalized at {time.monotonic():.3f}", flush=True)


def mismatch() -> None:
    """Ranks disagree on the count: an error on every rank, never a hang."""
    comm = comm_from_env(timeout=5)
    t = np.ones(8 if comm.rank == 0 else 16, np.float32)
    try:
        comm.all_reduce(t)
    except ferrocomm.FerrocommError as e:
        assert isinstance(e, (ferrocomm.Mismatch, ferrocomm.CommTimeout, ferrocomm.Aborted)), repr(e)
        print(f"raised {type(e).__name__}: {e}")
        return
    raise AssertionError("mismatched all_reduce did not raise")


def killed_peer() -> None:
    """The last rank dies before the collective: the others get CommTimeout
    (naming the missing rank where the kernels know it) within about twice
    the timeout, and the communicator is aborted afterwards."""
    comm = comm_from_env(timeout=3)
    t = np.ones(1024, np.float32)
    comm.all_reduce(t)
    if comm.rank == comm.size - 1:
        os._exit(17)
    start = time.monotonic()
    try:
        comm.all_reduce(t)
    except ferrocomm.CommTimeout as e:
        took = time.monotonic() - start
        print(f"raised CommTimeout after {took:.1f} s: {e} (missing={e.missing})")
        assert took < 2 * 3 + 2, took
        assert isinstance(e, TimeoutError)
    else:
        raise AssertionError("all_reduce with a dead peer did not raise")
    try:
        comm.all_reduce(t)
    except (ferrocomm.Aborted, ferrocomm.CommTimeout):
        pass
    else:
        raise AssertionError("the communicator must be unusable after the timeout")


def python_store(address: str, authkey: str) -> None:
    """The communicator over a Python store object (what from_torch does
    with torch's store), here a dict served by a multiprocessing manager."""
    from store_helpers import ManagerStore

    store = ManagerStore.connect(address, authkey)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = ferrocomm.from_store(store, rank, world, backend="host", timeout=60)
    t = np.full(33, float(rank + 1), np.float32)
    comm.all_reduce(t)
    assert float(t[0]) == world * (world + 1) / 2, t
    outs = [np.zeros(3, np.int64) for _ in range(world)]
    comm.all_gather(outs, np.full(3, rank, np.int64))
    assert [int(o[0]) for o in outs] == list(range(world)), outs
    comm.finalize()


# ---------------------------------------------------------------- symmetric heap, windows


def heap_window() -> None:
    """heap_tensor (symmetric, zeroed, NumPy views in place), a ring of
    put/signal/wait_signal over 3 rounds with every value checked,
    map_remote_tensor, and the rules of freeing and finalizing."""
    import struct

    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    rounds, n = 3, 5
    rows = comm.heap_tensor((rounds, W, n), np.int32)
    assert rows.shape == (rounds, W, n) and rows.dtype == "int32" and rows.nbytes == rounds * W * n * 4, rows
    offsets = np.zeros(W, np.int64)
    comm.all_gather_single(offsets, np.array([rows.offset], np.int64))
    assert (offsets == rows.offset).all(), f"heap offsets differ between ranks: {offsets}"
    view = np.from_dlpack(rows)
    assert view.shape == (rounds, W, n) and view.dtype == np.int32 and not view.any(), view
    assert view.ctypes.data == rows.data_ptr(), "the NumPy view must be the heap memory itself"
    ctx = comm.device_ctx_bytes()
    assert len(ctx) == 104 and struct.unpack_from("=II", ctx, 96) == (r, W), ctx[96:]

    win = comm.new_window()
    win.tensor_register(rows)
    nxt, prv = (r + 1) % W, (r - 1) % W
    value = lambda k, q: np.arange(n, dtype=np.int32) + 1000 * k + 10 * q  # noqa: E731
    for k in range(rounds):
        win.put(value(k, r), nxt, (k * W + r) * n)
        win.signal(nxt)
        win.wait_signal(prv)
        same(view[k, prv], value(k, prv), f"round {k}: what rank {prv} put")
    # Only the slots the previous rank put into were written.
    want = np.zeros((rounds, W, n), np.int32)
    for k in range(rounds):
        want[k, prv] = value(k, prv)
    same(view, want, "the whole window after the ring")
    # Async work and a heap tensor as the source, into the next rank's
    # last slot of round 0 ... after a barrier, as nobody reads it meanwhile.
    src = comm.heap_tensor((n,), "int32")
    np.from_dlpack(src)[:] = 7 + r
    comm.barrier()
    win.put(src, nxt, (0 * W + nxt) * n, async_op=True).wait()
    win.signal(nxt, async_op=True).wait()
    win.wait_signal(prv, async_op=True).wait(timeout=30)
    same(view[0, r], np.full(n, 7 + prv, np.int32), "async put from a heap tensor")

    # The next rank's buffer as mapped here holds what this rank put.
    remote_t = win.map_remote_tensor(nxt)
    assert remote_t.rank == nxt and remote_t.shape == (rounds, W, n), remote_t
    remote = np.from_dlpack(remote_t)
    for k in range(rounds):
        same(remote[k, r], value(k, r), f"map_remote_tensor({nxt}) round {k}")
    same(remote[0, nxt], np.full(n, 7 + r, np.int32), "map_remote_tensor: the async put")

    # Views hold the memory: deregister, free and finalize refuse meanwhile.
    for what, call in [("tensor_deregister", win.tensor_deregister), ("window free", win.free)]:
        try:
            call()
        except ferrocomm.InvalidArgument:
            pass
        else:
            raise AssertionError(f"{what} with a map_remote_tensor view held must be refused")
    del remote
    comm.barrier()  # every rank has read before buffers go
    win.tensor_deregister()
    try:
        np.from_dlpack(remote_t)
    except ferrocomm.InvalidArgument:
        pass
    else:
        raise AssertionError("a view of a deregistered window must be refused")
    win.tensor_register(rows)  # registered again, then freed with the window
    try:
        rows.free()
    except ferrocomm.InvalidArgument:
        pass
    else:
        raise AssertionError("free of a heap tensor registered in a window must be refused")
    # Frees in the same order on every rank: the window, then the tensors.
    win.free()
    del view
    rows.free()
    src.free()
    assert rows.freed and "freed" in repr(rows)
    try:
        rows.free()
    except ferrocomm.InvalidArgument:
        pass
    else:
        raise AssertionError("a second free must be refused")
    # The memory went back: the next allocation reuses the first offset.
    again = comm.heap_tensor(rounds * W * n, "float32")
    assert again.offset == rows.offset, (again.offset, rows.offset)
    # Never freed: stays until finalize, which refuses while a view is held.
    held = np.from_dlpack(again)
    try:
        comm.finalize()
    except ferrocomm.InvalidArgument as e:
        assert "still held" in str(e), e
    else:
        raise AssertionError("finalize with a DLPack view of the heap held must be refused")
    del held
    comm.barrier()  # rank 0 hosts the store: nobody leaves while others still use it
    comm.finalize()
    try:
        np.from_dlpack(again)
    except ferrocomm.Finalized:
        pass
    else:
        raise AssertionError("a heap tensor of a finalized communicator must not export")


def window_errors() -> None:
    """Bad input raises InvalidArgument on the rank that gave it, nothing queued."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    buf = comm.heap_tensor((W, 4), np.float32)
    win = comm.new_window()

    def refused(what, call, exc=ferrocomm.InvalidArgument):
        try:
            call()
        except exc as e:
            print(f"{what}: {type(e).__name__}: {e}")
        else:
            raise AssertionError(f"{what} must raise {exc.__name__}")

    refused("put without a buffer", lambda: win.put(np.ones(4, np.float32), 0, 0))
    refused("map_remote_tensor without a buffer", lambda: win.map_remote_tensor(0))
    refused("heap_tensor of a bad dtype", lambda: comm.heap_tensor(4, "complex64"))
    refused("heap_tensor of a negative shape", lambda: comm.heap_tensor((2, -1), "float32"))
    win.tensor_register(buf)
    refused("register twice", lambda: win.tensor_register(buf))
    refused("put past the end", lambda: win.put(np.ones(5, np.float32), (r + 1) % W, 4 * W - 4))
    refused("put at a negative offset", lambda: win.put(np.ones(1, np.float32), 0, -1))
    refused("put to a rank out of range", lambda: win.put(np.ones(1, np.float32), W, 0))
    refused("put to rank -1", lambda: win.put(np.ones(1, np.float32), -1, 0))
    refused("put of another dtype", lambda: win.put(np.ones(1, np.int32), 0, 0))
    refused("signal to a rank out of range", lambda: win.signal(W))
    refused("wait_signal on a rank out of range", lambda: win.wait_signal(W + 3))
    refused("map_remote_tensor of a rank out of range", lambda: win.map_remote_tensor(W))
    refused("a stream on the host backend", lambda: win.signal(0, stream=1))
    refused("DLPack copy=True", lambda: buf.__dlpack__(copy=True), BufferError)
    # Nothing was queued: a ring still works afterwards.
    win.put(np.full(4, r, np.float32), (r + 1) % W, 4 * r)
    win.signal((r + 1) % W)
    win.wait_signal((r - 1) % W)
    same(np.from_dlpack(buf)[(r - 1) % W], np.full(4, (r - 1) % W, np.float32), "ring after refusals")
    comm.barrier()
    win.tensor_deregister()
    # On the host backend only heap (or ferrocomm-allocated) memory can be
    # mapped by other processes: a plain NumPy array is refused on every rank.
    refused("register a NumPy array", lambda: win.tensor_register(np.zeros(4, np.float32)), ferrocomm.Unsupported)
    win.free()
    refused("a freed window", lambda: win.signal(0))
    buf.free()
    comm.barrier()  # the refused registration used the store, which rank 0 hosts
    comm.finalize()


def window_never_signalled() -> None:
    """Rank 0 waits for a signal rank 1 never sends: CommTimeout naming rank
    1 after the short timeout."""
    comm = comm_from_env(timeout=60)
    buf = comm.heap_tensor(8, "int64")
    win = comm.new_window()
    win.tensor_register(buf)
    if comm.rank == 1:
        time.sleep(6)  # long enough for rank 0's wait to time out; then gone
        return
    start = time.monotonic()
    try:
        win.wait_signal(1, timeout=2)
    except ferrocomm.CommTimeout as e:
        took = time.monotonic() - start
        print(f"raised CommTimeout after {took:.1f} s: {e} (missing={e.missing})")
        assert e.missing == [1], e.missing
        assert "1" in str(e), str(e)
        assert took < 2 * 2 + 2, took
    else:
        raise AssertionError("wait_signal on a peer that never signals did not raise")


def window_threads(phases: str = "123") -> None:
    """Two Python threads of rank 0 on one window (world 2). A window call
    that waits in Rust with the GIL released (a collective tensor_register
    while rank 1 comes late; a free that waits for a queued wait_signal)
    must not hold a lock that the other thread, holding the GIL, then
    waits for: the first would never get the GIL back. Each phase names
    itself, and a rank still here after 40 s prints its threads' stacks
    (the launcher kills the ranks at its timeout), so a hang says where.
    `phases` picks some of the three (a plain registration stands in for
    phase 1)."""
    import faulthandler
    import threading

    faulthandler.dump_traceback_later(40, exit=False)
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    assert W == 2, W
    n, rounds = 4, 50
    buf = comm.heap_tensor((W, n), np.int32)
    win = comm.new_window()

    class InThread(threading.Thread):
        """fn(*args) on a thread of its own; join() re-raises its error."""

        def __init__(self, fn, *args):
            super().__init__(daemon=True)
            self.fn, self.args, self.error, self.value = fn, args, None, None
            self.start()

        def run(self):
            try:
                self.value = self.fn(*self.args)
            except BaseException as e:  # noqa: BLE001 - re-raised by join
                self.error = e

        def join(self, timeout=50):
            super().join(timeout)
            assert not self.is_alive(), f"{self.fn.__name__} on the other thread is still running"
            if self.error is not None:
                raise self.error
            return self.value

    print(f"rank {r}: phase 1, repr during a tensor_register waiting for rank 1", flush=True)
    if "1" not in phases:
        win.tensor_register(buf)
    elif r == 0:
        other = InThread(win.tensor_register, buf)
        time.sleep(1.0)  # the thread is in the collective, waiting for rank 1
        text = repr(win)  # the window's state, while the other thread registers
        other.join()
        assert "registered" in text and "registered" in repr(win), (text, repr(win))
    else:
        time.sleep(3.0)
        win.tensor_register(buf)

    print(f"rank {r}: phase 2, waits on one thread, repr and map_remote_tensor on another", flush=True)
    if "2" not in phases:
        pass
    elif r == 0:

        def waits():
            for _ in range(rounds):
                win.wait_signal(1)

        other = InThread(waits)
        done = time.monotonic() + 30
        while other.is_alive() and time.monotonic() < done:
            repr(win)
            np.from_dlpack(win.map_remote_tensor(1))  # let go at once
            time.sleep(0.001)
        other.join()
        same(np.from_dlpack(buf)[1], np.full(n, rounds - 1, np.int32), "the last put of rank 1")
    else:
        for k in range(rounds):
            win.put(np.full(n, k, np.int32), 0, n)
            win.signal(0)

    print(f"rank {r}: phase 3, map_remote_tensor during a free waiting for a queued wait_signal", flush=True)
    if "3" not in phases:
        win.free()
    elif r == 0:
        work = win.wait_signal(1, async_op=True)
        other = InThread(win.free)  # waits for the wait_signal, so for rank 1
        time.sleep(1.0)
        try:
            win.map_remote_tensor(1)
        except ferrocomm.InvalidArgument as e:
            assert "freed" in str(e), e
        else:
            raise AssertionError("map_remote_tensor of a window being freed must be refused")
        other.join()
        work.wait(timeout=30)
        assert "freed" in repr(win), repr(win)
    else:
        time.sleep(3.0)
        win.signal(0)
        win.free()

    comm.barrier()  # rank 0 hosts the store: nobody leaves while others still use it
    buf.free()
    comm.finalize()
    faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------- expert parallel (EP)
#
# The reference follows ferrocomm::ep::reference: a token goes once to each
# rank owning one of its ids in 0..num_experts (ids < 0: none; larger ones
# are ignored), in source order; combine sums a token's rows over those
# ranks in rank order in f32 (the first term as it is) and rounds to bf16
# once. bf16 lives in NumPy as its bits (uint16).

EP_POISON = 0x7FC1  # a NaN: any stale expert_out row combine read would show


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits, rounded to nearest even (finite values)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_float(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


class EpCase:
    def __init__(self, world: int, payload: str, hidden: int = 256, max_tokens: int = 6, per_rank: int = 4,
                 topk: int = 3) -> None:
        self.world, self.payload, self.hidden, self.max, self.topk = world, payload, hidden, max_tokens, topk
        self.num_experts = per_rank * world
        self.per_rank = per_rank
        self.scale_cols = hidden // 128 if payload == "float8_e4m3fn" else 0

    def tokens(self, rnd: int, rank: int) -> int:
        """Each rank its own count: all, a few, none on the last rank."""
        return [self.max, 1 + rank, 0 if rank == self.world - 1 else self.max - rank][rnd % 3]

    def inputs(self, rnd: int, rank: int) -> dict:
        """Rank `rank`'s dispatch inputs in round `rnd` (every rank can make them)."""
        n, k = self.tokens(rnd, rank), self.topk
        rng = np.random.default_rng([77, rnd, rank, self.world])
        if self.payload == "bfloat16":
            x = bf16_bits(rng.uniform(-4, 4, (n, self.hidden)))
        else:
            x = rng.integers(0, 256, (n, self.hidden)).astype(np.uint8)
        scales = (0.5 + 1.5 * rng.random((n, self.scale_cols))).astype(np.float32)
        pick = rng.integers(0, 16, (n, k))
        idx = rng.integers(0, self.num_experts, (n, k))
        idx = np.where(pick < 2, -1, np.where(pick == 2, self.num_experts + pick % 3, idx)).astype(np.int32)
        if rnd == 0 and rank == 0 and n > 0:
            idx[0] = [-1, self.num_experts, self.num_experts + 7][:k] + [-1] * max(0, k - 3)  # goes nowhere
        w = rng.random((n, k)).astype(np.float32)
        return dict(n=n, x=x, scales=scales, idx=idx, w=w)

    def owners(self, ids: np.ndarray) -> set:
        return {int(e) // self.per_rank for e in ids if 0 <= e < self.num_experts}

    def dispatch(self, rank: int, inputs: list) -> dict:
        """What `rank` receives when rank s dispatches inputs[s]."""
        rows, k = self.world * self.max, self.topk
        r = dict(
            counts=np.zeros(self.world, np.int32),
            x=np.zeros((rows, self.hidden), inputs[0]["x"].dtype),
            scales=np.zeros((rows, self.scale_cols), np.float32),
            idx=np.zeros((rows, k), np.int32),
            w=np.zeros((rows, k), np.float32),
            src=np.zeros(rows, np.int32),
        )
        for s, inp in enumerate(inputs):
            for t in range(inp["n"]):
                ids = inp["idx"][t]
                if rank not in self.owners(ids):
                    continue
                row = s * self.max + r["counts"][s]
                r["counts"][s] += 1
                r["x"][row], r["scales"][row], r["src"][row] = inp["x"][t], inp["scales"][t], t
                for j, e in enumerate(ids):
                    mine = 0 <= e < self.num_experts and e // self.per_rank == rank
                    r["idx"][row, j] = e - rank * self.per_rank if mine else -1
                    r["w"][row, j] = inp["w"][t, j] if mine else 0.0
        return r

    def experts(self, counts, x, scales, idx, w) -> np.ndarray:
        """The test's experts: bf16 rows from each received row (payload,
        scales, local ids, weights); stale rows are poison."""
        out = np.full((self.world * self.max, self.hidden), EP_POISON, np.uint16)
        for s, c in enumerate(counts):
            for row in range(s * self.max, s * self.max + int(c)):
                wsum, local = np.float32(0), 0
                for j in range(self.topk):
                    if idx[row, j] >= 0:
                        wsum, local = np.float32(wsum + w[row, j]), local + 1
                if self.payload == "bfloat16":
                    v = bf16_float(x[row])
                else:
                    v = x[row].view(np.int8).astype(np.float32) * np.repeat(scales[row], 128)
                out[row] = bf16_bits(v * wsum + np.float32(local * 0.125))
        return out

    def combine(self, rank: int, inputs: list, expert_outs: list) -> np.ndarray:
        """What `rank`'s combine writes when rank r combines expert_outs[r]."""
        inp = inputs[rank]
        sent = [0] * self.world
        out = np.zeros((inp["n"], self.hidden), np.uint16)
        for t in range(inp["n"]):
            acc = None
            for r in sorted(self.owners(inp["idx"][t])):
                v = bf16_float(expert_outs[r][rank * self.max + sent[r]])
                sent[r] += 1
                acc = v.copy() if acc is None else (acc + v).astype(np.float32)
            if acc is not None:
                out[t] = bf16_bits(acc)
        return out


def ep() -> None:
    """Dispatch + combine at every payload against the NumPy reference:
    three rounds with each rank's own token count (0 included), -1 and
    out-of-range ids, async_op, num_tokens below the rows given, DeepEP's
    (x, scales) pair; then the buffer's lifetime rules."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    for payload in ["bfloat16", "float8_e4m3fn"]:
        case = EpCase(W, payload)
        buf = comm.ep_buffer(num_experts=case.num_experts, hidden=case.hidden, max_tokens_per_rank=case.max,
                             topk=case.topk, dtype=payload)
        assert (buf.num_experts, buf.hidden, buf.max_tokens_per_rank, buf.topk, buf.dtype) == (
            case.num_experts, case.hidden, case.max, case.topk, payload), buf
        assert buf.experts_per_rank == case.per_rank and buf.layout["total"] > 0, buf.layout
        first = None
        for rnd in range(3):
            inputs = [case.inputs(rnd, s) for s in range(W)]
            mine = inputs[r]
            x, kw = mine["x"], {}
            if rnd == 2:
                # A static batch of max rows, of which the first n are this round's.
                x = np.zeros((case.max, case.hidden), mine["x"].dtype)
                x[: mine["n"]] = mine["x"]
                kw["num_tokens"] = mine["n"]
            if payload == "float8_e4m3fn":
                scales = np.zeros((len(x), case.scale_cols), np.float32)
                scales[: mine["n"]] = mine["scales"]
                if rnd == 1:
                    x = (x, scales)  # DeepEP's spelling
                else:
                    kw["scales"] = scales
            out = buf.dispatch(x, mine["idx"], mine["w"], async_op=(rnd == 1), **kw)
            if rnd == 1:
                assert out.work is not None and out.work.name == "ep_dispatch", out.work
                out.work.wait(timeout=30)
            else:
                assert out.work is None
            assert out.num_tokens == mine["n"], (out.num_tokens, mine["n"])
            if first is None:
                first = out.recv_x
            assert out.recv_x is first, "every dispatch returns the same arrays"
            want = case.dispatch(r, inputs)
            same(out.recv_counts, want["counts"], f"{payload} round {rnd}: recv_counts")
            sent = np.array([sum(q in case.owners(ids) for ids in mine["idx"]) for q in range(W)], np.int32)
            same(out.send_counts, sent, f"{payload} round {rnd}: send_counts")
            assert out.recv_x.dtype == (np.uint16 if payload == "bfloat16" else np.uint8), out.recv_x.dtype
            assert out.recv_x.shape == (W * case.max, case.hidden), out.recv_x.shape
            for s in range(W):
                rows = slice(s * case.max, s * case.max + int(want["counts"][s]))
                what = f"{payload} round {rnd} from rank {s}"
                same(out.recv_x[rows], want["x"][rows], f"{what}: recv_x")
                same(out.recv_topk_idx[rows], want["idx"][rows], f"{what}: recv_topk_idx")
                same(out.recv_topk_weights[rows], want["w"][rows], f"{what}: recv_topk_weights")
                same(out.recv_src_index[rows], want["src"][rows], f"{what}: recv_src_index")
                if payload == "float8_e4m3fn":
                    same(out.recv_scales[rows], want["scales"][rows], f"{what}: recv_scales")
                else:
                    assert out.recv_scales is None
            expert_out = case.experts(out.recv_counts, out.recv_x, out.recv_scales, out.recv_topk_idx,
                                      out.recv_topk_weights)
            all_outs = []
            for q in range(W):
                rq = case.dispatch(q, inputs)
                all_outs.append(case.experts(rq["counts"], rq["x"], rq["scales"], rq["idx"], rq["w"]))
            same(expert_out, all_outs[r], f"{payload} round {rnd}: this rank's experts")
            res = np.full((mine["n"], case.hidden), 0xFFFF, np.uint16)  # every row must be written
            work = buf.combine(expert_out, res, async_op=(rnd == 1))
            if rnd == 1:
                work.wait(timeout=30)
                del work  # a Work holds the buffer until it goes
            same(res, case.combine(r, inputs, all_outs), f"{payload} round {rnd}: combine")
            if rnd == 0 and r == 0:
                assert not res[0].any(), "a token whose ids are all out of range combines to 0"
        # Views hold the memory: free (and finalize) refuse while they live.
        try:
            buf.free()
        except ferrocomm.InvalidArgument as e:
            assert "still held" in str(e), e
        else:
            raise AssertionError("free of an EP buffer whose dispatch results are held must be refused")
        del out, first
        buf.free()
        assert buf.freed and "freed" in repr(buf), repr(buf)
        try:
            buf.dispatch(np.zeros((1, case.hidden), np.uint16), np.zeros((1, case.topk), np.int32),
                         np.zeros((1, case.topk), np.float32))
        except ferrocomm.InvalidArgument as e:
            assert "freed" in str(e), e
        else:
            raise AssertionError("dispatch on a freed EP buffer must be refused")
    # Raw views: DLPack in place, bits() for NumPy, the same memory.
    buf = comm.ep_buffer(num_experts=2 * W, hidden=8, max_tokens_per_rank=2, topk=1)
    views = buf.received()
    assert views["recv_x"].dtype == "bfloat16" and views["recv_x"].shape == (2 * W, 8), views["recv_x"]
    bits = views["recv_x"].bits()
    assert bits.dtype == "uint16" and bits.data_ptr() == views["recv_x"].data_ptr(), bits
    ids = np.full((1, 1), (r + 1) % W * 2, np.int32)  # one token to the next rank's first expert
    buf.dispatch(bf16_bits(np.full((1, 8), r + 1.5)), ids, np.ones((1, 1), np.float32))
    got = np.from_dlpack(bits)
    prv = (r - 1) % W
    same(got[prv * 2], bf16_bits(np.full(8, prv + 1.5)), "a raw view of recv_x")
    same(np.from_dlpack(views["recv_counts"]), np.eye(W, dtype=np.int32)[prv], "a raw view of recv_counts")
    back = np.zeros((1, 8), np.uint16)
    expert = np.zeros((2 * W, 8), np.uint16)
    expert[prv * 2] = got[prv * 2]
    buf.combine(expert, back)
    same(back[0], bf16_bits(np.full(8, r + 1.5)), "combine of an identity expert")
    try:
        comm.finalize()
    except ferrocomm.InvalidArgument as e:
        assert "still held" in str(e), e
    else:
        raise AssertionError("finalize with a DLPack view of an EP buffer held must be refused")
    del got
    comm.barrier()  # rank 0 hosts the store: nobody leaves while others still use it
    comm.finalize()  # an EP buffer never freed goes with the heap
    try:
        np.from_dlpack(bits)
    except ferrocomm.Finalized:
        pass
    else:
        raise AssertionError("a view of a finalized communicator's EP buffer must not export")


def ep_errors() -> None:
    """Bad EP input raises InvalidArgument (a ValueError) on the rank that
    gave it, before anything is queued; bad configs on every rank."""
    comm = comm_from_env(timeout=60)
    W, r = comm.size, comm.rank
    E, H, M, K = 2 * W, 128, 4, 2

    def refused(what, call, needle="", exc=ferrocomm.InvalidArgument):
        try:
            call()
        except exc as e:
            assert isinstance(e, ValueError) or exc is not ferrocomm.InvalidArgument, type(e)
            assert needle in str(e), f"{what}: {needle!r} not in {e}"
            print(f"{what}: {type(e).__name__}: {e}")
        else:
            raise AssertionError(f"{what} must raise {exc.__name__}")

    make = lambda **kw: comm.ep_buffer(**{**dict(num_experts=E, hidden=H, max_tokens_per_rank=M, topk=K), **kw})  # noqa: E731
    refused("experts not divisible by the world", lambda: make(num_experts=2 * W + 1), "not divisible")
    refused("topk above num_experts", lambda: make(topk=E + 1), "exceeds num_experts")
    refused("zero hidden", lambda: make(hidden=0), "must be positive")
    refused("negative max_tokens_per_rank", lambda: make(max_tokens_per_rank=-1), "negative")
    refused("fp8 rows of a hidden not a multiple of 128", lambda: make(hidden=200, dtype="fp8"), "multiple")
    refused("a float16 payload", lambda: make(dtype=np.float16), "bfloat16 or float8_e4m3fn")
    refused("more rows than a dispatch's signal counts", lambda: make(max_tokens_per_rank=1 << 20), "below 2^20")
    refused("more than the heap holds", lambda: make(hidden=7168, max_tokens_per_rank=(1 << 20) - 1), "out of memory")

    buf = make()
    n = 3
    x = np.ones((n, H), np.uint16)
    idx = np.array([[(r * 2 + t) % E, -1] for t in range(n)], np.int32)
    w = np.ones((n, K), np.float32)
    expert, out = np.zeros((W * M, H), np.uint16), np.zeros((n, H), np.uint16)
    refused("combine before dispatch", lambda: buf.combine(expert, out), "no dispatch")
    refused("x of float32", lambda: buf.dispatch(x.astype(np.float32), idx, w), "x is float32, want bfloat16")
    refused("x of real float16", lambda: buf.dispatch(x.view(np.float16), idx, w), "x is float16")
    refused("x of another width", lambda: buf.dispatch(np.ones((n, H + 1), np.uint16), idx, w), "want rows of 128")
    refused("x flat", lambda: buf.dispatch(np.ones(n * H, np.uint16), idx, w), "rows of 128")
    refused("x of too many tokens", lambda: buf.dispatch(np.ones((M + 1, H), np.uint16), np.zeros((M + 1, K), np.int32),
                                                         np.zeros((M + 1, K), np.float32)), "max_tokens_per_rank")
    refused("topk_idx of int64", lambda: buf.dispatch(x, idx.astype(np.int64), w), "int32")
    refused("topk_idx of too few rows", lambda: buf.dispatch(x, idx[:2], w), "at least 3")
    refused("topk_idx of another topk", lambda: buf.dispatch(x, np.zeros((n, K + 1), np.int32), w), "rows of 2")
    refused("topk_weights of float64", lambda: buf.dispatch(x, idx, w.astype(np.float64)), "float32")
    refused("negative num_tokens", lambda: buf.dispatch(x, idx, w, num_tokens=-1), "negative")
    refused("num_tokens past the rows given", lambda: buf.dispatch(x, idx, w, num_tokens=n + 1), "at least 4")
    refused("scales for bf16 rows", lambda: buf.dispatch(x, idx, w, scales=np.ones((n, 1), np.float32)), "no scales")
    refused("scales twice", lambda: buf.dispatch((x, w), idx, w, scales=w), "twice")
    refused("a stream on the host backend", lambda: buf.dispatch(x, idx, w, stream=1), "stream")
    refused("not a tensor", lambda: buf.dispatch([[1.0]], idx, w), "expected a tensor")
    fp8 = make(dtype="float8_e4m3fn")
    x8 = np.ones((n, H), np.uint8)
    refused("fp8 rows without scales", lambda: fp8.dispatch(x8, idx, w), "need their scales")
    refused("fp8 rows of bf16 bits", lambda: fp8.dispatch(x, idx, w, scales=np.ones((n, 1), np.float32)),
            "x is 16-bit integers, want float8_e4m3fn")
    refused("fp8 scales of another width", lambda: fp8.dispatch(x8, idx, w, scales=np.ones((n, 2), np.float32)),
            "rows of 1")

    # Nothing was queued: a good round still works, and the alternation holds.
    got = buf.dispatch(x, idx, w)
    refused("dispatch twice", lambda: buf.dispatch(x, idx, w), "must alternate")
    refused("expert_out of float32", lambda: buf.combine(expert.astype(np.float32), out), "expert_out is float32")
    refused("expert_out of too few rows", lambda: buf.combine(expert[:-1], out), f"at least {W * M}")
    refused("out of too few rows", lambda: buf.combine(expert, out[:2]), "at least 3 rows")
    ro = np.zeros((n, H), np.uint16)
    ro.flags.writeable = False
    refused("a read-only out", lambda: buf.combine(expert, ro), "read-only")
    refused("out inside the buffer", lambda: buf.combine(expert, got.recv_x[:n]), "overlaps")
    expert[: W * M] = got.recv_x  # identity experts: each token comes back once per owner rank
    buf.combine(expert, out)
    same(out, x, "combine after the refusals")
    del got
    fp8.free()  # frees in the same order on every rank: the later buffer first
    buf.free()
    refused("free twice", buf.free, "freed")
    comm.barrier()
    comm.finalize()


def ep_never_dispatched() -> None:
    """Rank 0 dispatches; rank 1 never does: CommTimeout naming rank 1
    after the short timeout."""
    comm = comm_from_env(timeout=60)
    buf = comm.ep_buffer(num_experts=4, hidden=64, max_tokens_per_rank=2, topk=1)
    if comm.rank == 1:
        time.sleep(6)  # long enough for rank 0's dispatch to time out; then gone
        return
    start = time.monotonic()
    try:
        buf.dispatch(np.ones((2, 64), np.uint16), np.array([[2], [3]], np.int32), np.ones((2, 1), np.float32),
                     timeout=2)
    except ferrocomm.CommTimeout as e:
        took = time.monotonic() - start
        print(f"raised CommTimeout after {took:.1f} s: {e} (missing={e.missing})")
        assert e.missing == [1], e.missing
        assert took < 2 * 2 + 2, took
    else:
        raise AssertionError("a dispatch whose peer never dispatches did not raise")


if __name__ == "__main__":
    print("run through _worker.py", file=sys.stderr)


# The broadcaster's, kept in their own file.
from broadcaster_scenarios import (  # noqa: E402,F401
    broadcaster_killed_reader,
    broadcaster_messages,
    broadcaster_stalled_reader,
)
