"""What each rank of a GPU test runs (see test_gpu_torch.py): torch tensors
on CUDA, ferrocomm beside torch's NCCL process group, results compared with
NCCL's (exactly where both must agree: small integers, data movement;
within an fp64 bound otherwise), CUDA graph capture and replay, the vLLM
drop-in, and a killed rank."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import ferrocomm
from ferrocomm import ReduceOp

FLOATS = [torch.bfloat16, torch.float16, torch.float32]


def setup(timeout: float = 120) -> ferrocomm.Communicator:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    comm = ferrocomm.from_torch(timeout=timeout)
    assert comm.backend == "cuda" and comm.device == local, comm
    assert comm.rank == dist.get_rank() and comm.size == dist.get_world_size()
    return comm


def ints(rank: int, n: int, dtype, salt: int = 0, lo: int = -8, hi: int = 9) -> torch.Tensor:
    """Rank `rank`'s input: small integers, exact in every dtype."""
    g = torch.Generator().manual_seed(salt * 1_000_003 + rank * 7919 + n)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype).cuda()


def normal(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(salt * 1_000_003 + rank * 7919 + n + 17)
    return torch.randn(n, generator=g).to(dtype).cuda()


def equal_across_ranks(t: torch.Tensor, what: str) -> None:
    """Bitwise the same on every rank (ferrocomm's determinism promise)."""
    # As bytes: torch's NCCL group gathers uint8 but not int16.
    bits = t.contiguous().view(torch.uint8)
    got = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(got, bits.contiguous())
    for q, g in enumerate(got):
        assert torch.equal(g, got[0]), f"{what}: rank {q} differs from rank 0"


def eps(dtype) -> float:
    return {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}[dtype]


def collectives_vs_nccl() -> None:
    comm = setup()
    W, r = comm.size, comm.rank
    print(f"ferrocomm {ferrocomm.__version__} on {comm!r}, NCCL underneath: {comm.has_vendor_library}", flush=True)
    sizes = [1, 7, 1024, 65537, 1 << 20, (1 << 23) + 3]
    for dtype in FLOATS:
        for n in sizes:
            name = f"{dtype} n={n}"
            # Small integers: every order of summation is exact, so NCCL's
            # result and ferrocomm's must be the same bits.
            x = ints(r, n, dtype, 1)
            y = x.clone()
            comm.all_reduce(x)
            dist.all_reduce(y)
            assert torch.equal(x, y), f"all_reduce sum {name} differs from NCCL"
            for op, top in [(ReduceOp.MAX, dist.ReduceOp.MAX), (ReduceOp.MIN, dist.ReduceOp.MIN)]:
                x = ints(r, n, dtype, 2)
                y = x.clone()
                comm.all_reduce(x, op)
                dist.all_reduce(y, top)
                assert torch.equal(x, y), f"all_reduce {op} {name} differs from NCCL"
            # Gaussian data: within the fp64 bound, and the same bits on every rank.
            x = normal(r, n, dtype, 3)
            ref = sum(normal(q, n, dtype, 3).double() for q in range(W))
            comm.all_reduce(x)
            err = (x.double() - ref).abs()
            bound = eps(dtype) * ref.abs() + W * 2**-24 * 8
            assert bool((err <= bound).all()), f"all_reduce {name}: max error {err.max().item()}"
            equal_across_ranks(x, f"all_reduce {name}")
    # avg and premul_sum against the fp64 reference
    n = 4097
    for dtype in FLOATS:
        ins = [normal(q, n, dtype, 4) for q in range(W)]
        x = ins[r].clone()
        comm.all_reduce(x, ReduceOp.AVG)
        ref = sum(t.double() for t in ins) / W
        assert bool(((x.double() - ref).abs() <= eps(dtype) * ref.abs() + 1e-6).all()), f"avg {dtype}"
        x = ins[r].clone()
        comm.all_reduce(x, ReduceOp.premul_sum(0.5))
        ref = sum(t.double() for t in ins) * 0.5
        assert bool(((x.double() - ref).abs() <= 2 * eps(dtype) * ref.abs() + 1e-6).all()), f"premul_sum {dtype}"
    # torch's NCCL group has no bitwise ops: the reference folds every
    # rank's input, gathered through torch.
    fold = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
    for op, f in fold.items():
        x = ints(r, 1000, torch.int32, 5, 0, 1 << 20)
        every = [torch.empty_like(x) for _ in range(W)]
        dist.all_gather(every, x)
        want = every[0]
        for t in every[1:]:
            want = f(want, t)
        comm.all_reduce(x, op)
        assert torch.equal(x, want), f"int32 {op}"

    # Data movement: the same bits as torch's NCCL collectives.
    for dtype in [torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float8_e4m3fn]:
        for n in [1, 1000, 1 << 18]:
            name = f"{dtype} n={n}"
            src = ints(r, n, torch.float32, 6).to(dtype)
            out, want = torch.empty(n * W, dtype=dtype, device="cuda"), torch.empty(n * W, dtype=dtype, device="cuda")
            comm.all_gather_single(out, src)
            dist.all_gather_into_tensor(want.view(torch.uint8) if dtype.itemsize == 1 else want,
                                        src.view(torch.uint8) if dtype.itemsize == 1 else src)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"all_gather_single {name}"
            outs = [torch.empty_like(src) for _ in range(W)]
            comm.all_gather(outs, src)
            assert torch.equal(torch.cat(outs).view(torch.uint8), want.view(torch.uint8)), f"all_gather {name}"
            big = ints(r, n * W, torch.float32, 7).to(dtype)
            a2a, a2a_want = torch.empty_like(big), torch.empty_like(big)
            comm.all_to_all_single(a2a, big)
            dist.all_to_all_single(a2a_want.view(torch.uint8) if dtype.itemsize == 1 else a2a_want,
                                   big.view(torch.uint8) if dtype.itemsize == 1 else big)
            assert torch.equal(a2a.view(torch.uint8), a2a_want.view(torch.uint8)), f"all_to_all_single {name}"
            b = src.clone()
            comm.broadcast(b, root=W - 1)
            b_want = src.clone()
            dist.broadcast(b_want.view(torch.uint8) if dtype.itemsize == 1 else b_want, src=W - 1)
            assert torch.equal(b.view(torch.uint8), b_want.view(torch.uint8)), f"broadcast {name}"
    for dtype in FLOATS:
        n = 3001
        big = ints(r, n * W, dtype, 8)
        out, want = torch.empty(n, dtype=dtype, device="cuda"), torch.empty(n, dtype=dtype, device="cuda")
        comm.reduce_scatter_single(out, big)
        dist.reduce_scatter_tensor(want, big)
        assert torch.equal(out, want), f"reduce_scatter_single {dtype}"
        out.zero_()
        comm.reduce_scatter(out, list(big.chunk(W)))
        assert torch.equal(out, want), f"reduce_scatter {dtype}"
        t, t_want = ints(r, n, dtype, 9), ints(r, n, dtype, 9)
        comm.reduce(t, root=0)
        dist.reduce(t_want, dst=0)
        if r == 0:
            assert torch.equal(t, t_want), f"reduce {dtype}"
    # all_to_all_v_single on 2-D tensors, splits in rows, against torch's.
    cols = 5
    in_rows = [(r + q) % 3 + 1 for q in range(W)]
    out_rows = [(s + r) % 3 + 1 for s in range(W)]
    inp = ints(r, sum(in_rows) * cols, torch.bfloat16, 10).view(-1, cols)
    out = torch.empty(sum(out_rows), cols, dtype=torch.bfloat16, device="cuda")
    want = torch.empty_like(out)
    comm.all_to_all_v_single(out, inp, out_rows, in_rows)
    dist.all_to_all_single(want, inp, out_rows, in_rows)
    assert torch.equal(out, want), "all_to_all_v_single"
    # gather / scatter / send-recv ring / barrier
    src = ints(r, 100, torch.float32, 11)
    outs = [torch.empty_like(src) for _ in range(W)] if r == 0 else []
    comm.gather(outs, src, root=0)
    if r == 0:
        for q in range(W):
            assert torch.equal(outs[q], ints(q, 100, torch.float32, 11)), f"gather[{q}]"
    blocks = [ints(q, 100, torch.float32, 12) for q in range(W)]
    got = torch.empty(100, device="cuda")
    comm.scatter(got, blocks if r == 0 else [], root=0)
    assert torch.equal(got, blocks[r]), "scatter"
    recv = torch.empty(100, device="cuda")
    works = comm.batch_isend_irecv(
        [ferrocomm.P2POp("isend", src, (r + 1) % W), ferrocomm.P2POp(dist.irecv, recv, (r - 1) % W)]
    )
    for w in works:
        w.wait()
    assert torch.equal(recv, ints((r - 1) % W, 100, torch.float32, 11)), "ring"
    comm.barrier()

    # Streams: a side stream (torch's current stream there), an explicit
    # stream=, and async work waited on.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = ints(r, 1 << 16, torch.bfloat16, 13)
        comm.all_reduce(x)
        y = x * 1  # ordered after the all-reduce on the same stream
    torch.cuda.current_stream().wait_stream(side)
    want = sum(ints(q, 1 << 16, torch.bfloat16, 13).float() for q in range(W)).to(torch.bfloat16)
    assert torch.equal(y, want), "all_reduce on a side stream"
    x = ints(r, 1 << 16, torch.bfloat16, 13)
    comm.all_reduce(x, stream=side)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(x, want), "all_reduce with stream="
    x = ints(r, 1 << 16, torch.bfloat16, 13)
    w = comm.all_reduce(x, async_op=True, timeout=datetime.timedelta(seconds=60))
    w.wait()
    assert w.is_completed() and torch.equal(x, want), "async all_reduce"
    # requires_grad tensors (torch refuses to export those through DLPack
    # unless detached: ferrocomm detaches, sharing the storage).
    p = ints(r, 64, torch.float32, 14).requires_grad_()
    comm.all_reduce(p)
    assert torch.equal(p.detach(), sum(ints(q, 64, torch.float32, 14) for q in range(W))), "requires_grad"

    # CPU tensors go to the host twin; a tensor on another GPU is refused.
    c = torch.full((10,), float(r + 1))
    comm.all_reduce(c)
    assert c[0].item() == W * (W + 1) / 2, "CPU tensor through the CUDA communicator"
    if torch.cuda.device_count() > 1:
        other = torch.ones(4, device=f"cuda:{(r + 1) % torch.cuda.device_count()}")
        try:
            comm.all_reduce(other)
        except ferrocomm.InvalidArgument as e:
            print(f"other device refused: {e}", flush=True)
        else:
            raise AssertionError("a tensor on another GPU must be refused")

    # CuPy arrays (if CuPy is there), on CuPy's current stream.
    try:
        import cupy
    except ImportError:
        print("cupy not installed: skipped", flush=True)
    else:
        with cupy.cuda.Device(r):
            a = cupy.full(1000, r + 1, dtype=cupy.float32)
            comm.all_reduce(a)
            assert float(a[0]) == W * (W + 1) / 2, "cupy all_reduce"
    torch.cuda.synchronize()
    comm.finalize()
    dist.destroy_process_group()


def graph_replay(replays: str = "300") -> None:
    """All-reduce (out of place), all-gather and reduce-scatter captured into
    one CUDA graph, replayed with new input each time, every result checked."""
    comm = setup()
    W, r = comm.size, comm.rank
    comm.prepare()
    n = 1 << 16
    dt = torch.bfloat16
    inp = torch.empty(n, dtype=dt, device="cuda")
    out = torch.empty(n, dtype=dt, device="cuda")
    ag = torch.empty(n * W, dtype=dt, device="cuda")
    big = torch.empty(n * W, dtype=dt, device="cuda")
    rs = torch.empty(n, dtype=dt, device="cuda")

    def body():
        comm.all_reduce_into(out, inp)
        comm.all_gather_single(ag, inp)
        comm.reduce_scatter_single(rs, big)

    inp.copy_(ints(r, n, dt, 0))
    big.copy_(ints(r, n * W, dt, 0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    wrong = 0
    for it in range(int(replays)):
        ins = [ints(q, n, dt, it + 1) for q in range(W)]
        bigs = [ints(q, n * W, dt, it + 1) for q in range(W)]
        inp.copy_(ins[r])
        big.copy_(bigs[r])
        g.replay()
        torch.cuda.synchronize()
        want_ar = sum(t.float() for t in ins).to(dt)
        want_rs = sum(t.float() for t in bigs).to(dt)[r * n : (r + 1) * n]
        ok = torch.equal(out, want_ar) and torch.equal(ag, torch.cat(ins)) and torch.equal(rs, want_rs)
        wrong += 0 if ok else 1
    print(f"{replays} replays, {wrong} wrong", flush=True)
    assert wrong == 0
    # The documented teardown order: graphs, then the communicator (NCCL's
    # destroy waits for graphs that hold its work). Each step says it is
    # done, so a hang names its step in the log.
    del g
    torch.cuda.synchronize()
    print("graph released", flush=True)
    comm.finalize()
    print("communicator finalized", flush=True)
    dist.destroy_process_group()
    print("process group destroyed", flush=True)


def vllm_dropin() -> None:
    from ferrocomm.vllm import CustomAllreduce

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cpu_group = dist.new_group(backend="gloo")
    ca = CustomAllreduce(group=cpu_group, device=local)
    assert not ca.disabled, "the drop-in must be enabled on GPUs"
    W, r = ca.world_size, ca.rank
    x = normal(r, 4096 * 8, torch.bfloat16, 20)
    assert ca.should_custom_ar(x)
    assert not ca.should_custom_ar(torch.empty(ca.max_size, dtype=torch.uint8, device="cuda"))
    assert ca.custom_all_reduce(torch.empty(ca.max_size // 2 + 8, dtype=torch.bfloat16, device="cuda")) is None
    y = ca.custom_all_reduce(x)
    assert y is not None and y.data_ptr() != x.data_ptr(), "out of place"
    ref = x.clone()
    dist.all_reduce(ref)
    assert bool(((y.float() - ref.float()).abs() <= 2 * eps(torch.bfloat16) * ref.float().abs() + 1e-2).all())
    equal_across_ranks(y, "custom_all_reduce")
    # Under vLLM's capture context and torch.cuda.graph, replayed with new input.
    static = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            ca.custom_all_reduce(static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with ca.capture():
        with torch.cuda.graph(g):
            out = ca.custom_all_reduce(static)
    for it in range(50):
        ins = [ints(q, static.numel(), torch.bfloat16, 100 + it) for q in range(W)]
        static.copy_(ins[r])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sum(t.float() for t in ins).to(torch.bfloat16)), f"replay {it}"
    # Fused all-reduce + residual add + RMSNorm: the residual is bitwise
    # ferrocomm's all-reduce plus the residual (one rounding each); the
    # normed rows are within a few bf16 ulps of torch's unfused rms_norm.
    tokens, hidden = 32, 4096
    xin = normal(r, tokens * hidden, torch.bfloat16, 30).view(tokens, hidden)
    res = normal(0, tokens * hidden, torch.bfloat16, 31).view(tokens, hidden)
    w = normal(0, hidden, torch.bfloat16, 32)
    ar = torch.empty_like(xin)
    ca.comm.all_reduce_into(ar, xin)
    want_res = (ar.float() + res.float()).to(torch.bfloat16)
    want_norm = torch.nn.functional.rms_norm(want_res.float(), (hidden,), w.float(), 1e-6).to(torch.bfloat16)
    normed, res_after = ca.fused_all_reduce_rms_norm(xin, res, w, 1e-6)
    torch.cuda.synchronize()
    assert res_after.data_ptr() == res.data_ptr(), "residual updated in place"
    assert torch.equal(res, want_res), "fused residual differs from all_reduce + add"
    err = (normed.float() - want_norm.float()).abs()
    assert bool((err <= 4 * eps(torch.bfloat16) * want_norm.float().abs() + 1e-2).all()), f"max err {err.max()}"
    equal_across_ranks(normed, "fused rms_norm")
    print(f"fused all_reduce + add + rms_norm ok ({tokens} x {hidden})", flush=True)
    ca.close()
    dist.destroy_process_group()


def killed_rank() -> None:
    """Not under torchrun (whose agent stops every rank when one dies):
    the test sets RANK/WORLD_SIZE/MASTER_PORT; ranks meet in a torch
    TCPStore. The last rank dies; the others get CommTimeout, from
    Work.wait and, for stream-ordered calls nobody waited on, at the next
    call."""
    r, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(r)
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), W, is_master=(r == 0), timeout=datetime.timedelta(seconds=120)
    )
    comm = ferrocomm.from_store(store, r, W, backend="cuda", device=r, timeout=5)
    x = torch.ones(1 << 20, device="cuda")
    comm.all_reduce(x)
    torch.cuda.synchronize()
    assert x[0].item() == W
    store.set(f"ready{r}", b"1")
    store.wait([f"ready{q}" for q in range(W)])
    if r == W - 1:
        os._exit(17)
    time.sleep(1)
    start = time.monotonic()
    w = comm.all_reduce(x, async_op=True)
    try:
        w.wait()
    except ferrocomm.CommTimeout as e:
        print(f"raised CommTimeout after {time.monotonic() - start:.1f} s: {e} (missing={e.missing})", flush=True)
        assert time.monotonic() - start < 2 * 5 + 5
    else:
        raise AssertionError("all_reduce with a dead peer did not raise")
    try:
        comm.all_reduce(x)
    except (ferrocomm.Aborted, ferrocomm.CommTimeout) as e:
        print(f"next call raised {type(e).__name__}", flush=True)
    else:
        raise AssertionError("the communicator must refuse work after the failure")
    torch.cuda.synchronize()
    os._exit(0)  # skip the store's teardown: its peer is gone


def killed_rank_stream_ordered() -> None:
    """As killed_rank, with only stream-ordered calls: the failure surfaces
    at the next call."""
    r, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(r)
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), W, is_master=(r == 0), timeout=datetime.timedelta(seconds=120)
    )
    comm = ferrocomm.from_store(store, r, W, backend="cuda", device=r, timeout=5)
    x = torch.ones(1 << 20, device="cuda")
    comm.all_reduce(x)
    torch.cuda.synchronize()
    store.set(f"ready{r}", b"1")
    store.wait([f"ready{q}" for q in range(W)])
    if r == W - 1:
        os._exit(17)
    time.sleep(1)
    comm.all_reduce(x)  # queued; its kernel gives up after the timeout
    torch.cuda.synchronize()
    try:
        comm.all_reduce(x)
    except ferrocomm.CommTimeout as e:
        print(f"next call raised CommTimeout: {e}", flush=True)
    else:
        raise AssertionError("the failed stream-ordered call must surface at the next call")
    os._exit(0)


def heap_window_torch() -> None:
    """A ring of window puts into bf16 heap tensors read through
    torch.from_dlpack, on torch's current stream, 3 rounds."""
    comm = setup()
    W, r, n = comm.size, comm.rank, 256
    nxt, prv = (r + 1) % W, (r - 1) % W
    rows = comm.heap_tensor((W, n), torch.bfloat16)
    view = torch.from_dlpack(rows)
    assert view.is_cuda and view.device.index == comm.device and not bool(view.any()), view
    win = comm.new_window()
    win.tensor_register(rows)
    for k in range(3):
        win.put(torch.full((n,), float(10 * k + r), dtype=torch.bfloat16, device="cuda"), nxt, n * r)
        win.signal(nxt)
        win.wait_signal(prv)
        assert bool((view[prv] == 10 * k + prv).all()), f"round {k}: {view[prv][:4]}"
        dist.barrier()  # everyone read this round before the next overwrites it
    peer = torch.from_dlpack(win.map_remote_tensor(nxt))
    assert bool((peer[r] == 20 + r).all()), peer[r][:4]
    del peer, view
    torch.cuda.synchronize()
    dist.barrier()
    win.free()
    rows.free()
    comm.finalize()
    dist.destroy_process_group()


def ep_torch() -> None:
    """EP dispatch + combine on torch tensors (bf16 and fp8 rows) on
    torch's current stream, against the host suite's NumPy reference
    (scenarios.EpCase); then dispatch, an expert and combine captured in one
    CUDA graph and replayed with new inputs. Static batches of
    max_tokens_per_rank rows, each rank dispatching its own num_tokens."""
    import numpy as np

    from scenarios import EpCase

    comm = setup()
    W, r = comm.size, comm.rank
    cuda = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    for payload, dtype in [("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.float8_e4m3fn)]:
        case = EpCase(W, payload)
        M, H, K = case.max, case.hidden, case.topk
        buf = comm.ep_buffer(num_experts=case.num_experts, hidden=H, max_tokens_per_rank=M, topk=K, dtype=dtype)
        for rnd in range(3):
            inputs = [case.inputs(rnd, s) for s in range(W)]
            mine, n = inputs[r], inputs[r]["n"]
            pad = lambda a: np.concatenate([a, np.zeros((M - n,) + a.shape[1:], a.dtype)])  # noqa: E731
            if payload == "bfloat16":
                x, kw = cuda(pad(mine["x"]).view(np.int16)).view(torch.bfloat16), {}
            else:
                x, kw = cuda(pad(mine["x"])).view(torch.float8_e4m3fn), {"scales": cuda(pad(mine["scales"]))}
            got = buf.dispatch(x, cuda(pad(mine["idx"])), cuda(pad(mine["w"])), num_tokens=n, **kw)
            assert got.recv_x.is_cuda and got.recv_x.dtype == dtype, got.recv_x
            want = case.dispatch(r, inputs)
            counts = got.recv_counts.cpu().numpy()
            assert (counts == want["counts"]).all(), (payload, rnd, counts, want["counts"])
            bits = got.recv_x.view(torch.int16 if payload == "bfloat16" else torch.uint8).cpu().numpy()
            recv_x = bits.view(np.uint16) if payload == "bfloat16" else bits
            idx, wts = got.recv_topk_idx.cpu().numpy(), got.recv_topk_weights.cpu().numpy()
            scales = got.recv_scales.cpu().numpy() if got.recv_scales is not None else None
            for s in range(W):
                rows = slice(s * M, s * M + int(counts[s]))
                assert (recv_x[rows] == want["x"][rows]).all(), f"{payload} round {rnd}: recv_x from {s}"
                assert (idx[rows] == want["idx"][rows]).all(), f"{payload} round {rnd}: recv_topk_idx from {s}"
                assert (wts[rows] == want["w"][rows]).all(), f"{payload} round {rnd}: recv_topk_weights from {s}"
            all_outs = []
            for q in range(W):
                rq = case.dispatch(q, inputs)
                all_outs.append(case.experts(rq["counts"], rq["x"], rq["scales"], rq["idx"], rq["w"]))
            mine_out = case.experts(counts, recv_x, scales, idx, wts)
            assert (mine_out == all_outs[r]).all(), f"{payload} round {rnd}: this rank's experts"
            out = torch.empty((M, H), dtype=torch.bfloat16, device="cuda")
            buf.combine(cuda(mine_out.view(np.int16)).view(torch.bfloat16), out)
            got_out = out[:n].view(torch.int16).cpu().numpy().view(np.uint16)
            assert (got_out == case.combine(r, inputs, all_outs)).all(), f"{payload} round {rnd}: combine"
        del got
        torch.cuda.synchronize()
        dist.barrier()
        buf.free()

    # One graph: dispatch, identity experts (a copy), combine; each token
    # comes back once from every rank owning one of its experts.
    case = EpCase(W, "bfloat16")
    M, H, K = case.max, case.hidden, case.topk
    buf = comm.ep_buffer(num_experts=case.num_experts, hidden=H, max_tokens_per_rank=M, topk=K)
    sx = torch.zeros((M, H), dtype=torch.bfloat16, device="cuda")
    sidx = torch.zeros((M, K), dtype=torch.int32, device="cuda")
    sw = torch.ones((M, K), dtype=torch.float32, device="cuda")
    sexp = torch.zeros((W * M, H), dtype=torch.bfloat16, device="cuda")
    sout = torch.zeros((M, H), dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = buf.dispatch(sx, sidx, sw)
        sexp.copy_(got.recv_x)
        buf.combine(sexp, sout)
    for it in range(5):
        rng = np.random.default_rng([it, r])
        xs = rng.integers(-8, 9, (M, H)).astype(np.float32)
        ids = rng.integers(-1, case.num_experts, (M, K)).astype(np.int32)
        sx.copy_(torch.from_numpy(xs).to(torch.bfloat16))
        sidx.copy_(torch.from_numpy(ids))
        g.replay()
        torch.cuda.synchronize()
        times = np.array([len(case.owners(row)) for row in ids], np.float32)[:, None]
        assert torch.equal(sout.float().cpu(), torch.from_numpy(xs * times)), f"replay {it}"
    del got, g
    torch.cuda.synchronize()
    dist.barrier()
    buf.free()
    comm.finalize()
    dist.destroy_process_group()
