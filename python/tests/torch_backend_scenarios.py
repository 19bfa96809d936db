"""What each rank of a torch-backend test runs (see test_torch_backend.py):
``init_process_group("ferrocomm")`` and torch's own APIs on it, on CPU
tensors (ferrocomm's host backend) and CUDA tensors (its GPU backend; the
ranks may share one GPU: FERROCOMM_TEST_SHARE_GPU=1).

Each scenario takes the device type ("cpu" or "cuda") and raises on the
first wrong result."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ferrocomm
import ferrocomm.torch  # noqa: F401  (registers the backend)


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        # The first GPU when the ranks share it, else the rank's own.
        index = 0 if os.environ.get("FERROCOMM_TEST_SHARE_GPU") == "1" else int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        torch.zeros(1, device="cuda")  # initialise CUDA: the backend then takes torch's device
        return torch.device("cuda", index)
    return torch.device("cpu")


def init(kind: str, backend: str = "ferrocomm", timeout: float = 120) -> torch.device:
    dev = _device(kind)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, ferrocomm.torch.ProcessGroupFerrocomm), type(pg)
    assert dist.get_backend() == "ferrocomm", dist.get_backend()
    return dev


def _ints(rank: int, n: int, dev: torch.device, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(salt * 1_000_003 + rank * 7919 + n)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype).to(dev)


def _all_inputs(n: int, dev: torch.device, dtype=torch.float32, salt: int = 0) -> list:
    return [_ints(q, n, dev, dtype, salt) for q in range(dist.get_world_size())]


def _rooted(dev: torch.device, xs: list, n: int) -> None:
    """A send/recv pair (torch's batch_isend_irecv coalesces only for its
    own C++ groups, so on a Python group it sends and receives one by one:
    a ring of them is not run here), then gather and scatter."""
    W, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        dist.send(xs[0], dst=1)
    elif r == 1:
        got = torch.empty(n, device=dev)
        dist.recv(got, src=0)
        assert torch.equal(got, xs[0]), "send/recv"
    g_out = [torch.empty(n, device=dev) for _ in range(W)] if r == 0 else []
    dist.gather(xs[r], g_out, dst=0)
    if r == 0:
        assert all(torch.equal(o, x) for o, x in zip(g_out, xs)), "gather"
    sc = torch.empty(n, device=dev)
    dist.scatter(sc, list(xs) if r == 0 else None, src=0)
    assert torch.equal(sc, xs[r]), "scatter"


def collectives(kind: str) -> None:
    """Every collective torch names, against results computed locally from
    every rank's (reproducible) input."""
    dev = init(kind)
    W, r = dist.get_world_size(), dist.get_rank()
    n = 1000 * W
    xs = _all_inputs(n, dev)
    stacked = torch.stack(xs)
    expect = {
        dist.ReduceOp.SUM: stacked.sum(0),
        dist.ReduceOp.PRODUCT: stacked.prod(0),
        dist.ReduceOp.MIN: stacked.min(0).values,
        dist.ReduceOp.MAX: stacked.max(0).values,
        dist.ReduceOp.AVG: stacked.sum(0) / W,
    }
    for op, want in expect.items():
        t = xs[r].clone()
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, want, rtol=1e-6, atol=1e-6), f"all_reduce {op}: {t[:4]} vs {want[:4]}"
    bits = [_ints(q, n, dev, torch.int32, salt=1) for q in range(W)]
    for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                     (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        want = bits[0]
        for b in bits[1:]:
            want = fold(want, b)
        t = bits[r].clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t, want), f"all_reduce {op}"
    try:
        dist.all_reduce(xs[r].clone(), op=dist._make_nccl_premul_sum(0.5))
    except ferrocomm.Unsupported as e:
        assert "all_reduce" in str(e), e
    except RuntimeError as e:  # torch may refuse PREMUL_SUM for a non-NCCL group itself
        assert "PREMUL" in str(e).upper() or "all_reduce" in str(e), e
    else:
        raise AssertionError("PREMUL_SUM must be refused by name")

    # Async work, its future, and wait.
    t = xs[r].clone()
    work = dist.all_reduce(t, async_op=True)
    got = work.get_future().wait()
    work.wait()
    assert torch.equal(got[0], expect[dist.ReduceOp.SUM]) and torch.equal(t, expect[dist.ReduceOp.SUM])

    out = torch.empty(W * n, device=dev)
    dist.all_gather_into_tensor(out, xs[r])
    assert torch.equal(out, torch.cat(xs)), "all_gather_into_tensor"
    outs = [torch.empty(n, device=dev) for _ in range(W)]
    dist.all_gather(outs, xs[r])
    assert all(torch.equal(o, x) for o, x in zip(outs, xs)), "all_gather"

    shard = torch.empty(n // W, device=dev)
    dist.reduce_scatter_tensor(shard, xs[r])
    assert torch.equal(shard, expect[dist.ReduceOp.SUM].chunk(W)[r]), "reduce_scatter_tensor"
    shard = torch.empty(n // W, device=dev)
    dist.reduce_scatter(shard, list(xs[r].chunk(W)))
    assert torch.equal(shard, expect[dist.ReduceOp.SUM].chunk(W)[r]), "reduce_scatter"

    # all_to_all_single: equal blocks, then rank q sends q + p + 1 rows to p.
    a2a = torch.empty(n, device=dev)
    dist.all_to_all_single(a2a, xs[r])
    assert torch.equal(a2a, torch.cat([x.chunk(W)[r] for x in xs])), "all_to_all_single"
    rows = 3
    splits = lambda q: [q + p + 1 for p in range(W)]  # noqa: E731
    src = [_ints(q, sum(splits(q)) * rows, dev, salt=2).view(-1, rows) for q in range(W)]
    recv_splits = [splits(q)[r] for q in range(W)]
    got = torch.empty(sum(recv_splits), rows, device=dev)
    dist.all_to_all_single(got, src[r], output_split_sizes=recv_splits, input_split_sizes=splits(r))
    want = torch.cat([src[q].split(splits(q))[r] for q in range(W)])
    assert torch.equal(got, want), "all_to_all_single with splits"

    b = xs[r].clone()
    dist.broadcast(b, src=W - 1)
    assert torch.equal(b, xs[W - 1]), "broadcast"
    red = xs[r].clone()
    dist.reduce(red, dst=0)
    if r == 0:
        assert torch.equal(red, expect[dist.ReduceOp.SUM]), "reduce"

    # Sends and receives, gather and scatter. On GPUs ferrocomm runs these
    # on NCCL; without it (FERROCOMM_CCL=0, ranks sharing a GPU) they must
    # be refused by name, alike on every rank.
    pg = dist.distributed_c10d._get_default_group()
    vendor = dev.type == "cpu" or pg.comm(dev).has_vendor_library
    try:
        _rooted(dev, xs, n)
    except ferrocomm.Unsupported as e:
        assert not vendor, f"refused with NCCL underneath: {e}"
        print(f"rank {r}: send/recv, gather, scatter refused without NCCL: {e}", flush=True)
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {r}: every collective right on {dev}", flush=True)
    dist.destroy_process_group()


def reused_address(kind: str) -> None:
    """Eager all-reduces on tensors that are freed after each call, so
    torch's caching allocator hands their memory to the next tensor: values,
    dtypes and lengths change under the same address, and every call must
    read the tensor it was given (the eager path remembers nothing across
    calls). Directly on the group's communicator and through torch."""
    dev = init(kind)
    pg = dist.distributed_c10d._get_default_group()
    W = dist.get_world_size()
    cases = [
        (torch.float32, 4096), (torch.float32, 4096), (torch.bfloat16, 8192), (torch.int32, 4096),
        (torch.float16, 8192), (torch.float32, 2048), (torch.float32, 4096),
    ]
    reused = 0
    for via in ("ferrocomm", "torch"):
        last = None
        for salt, (dtype, n) in enumerate(cases):
            want = sum(_ints(q, n, torch.device("cpu"), dtype, salt) for q in range(W))
            x = _ints(dist.get_rank(), n, dev, dtype, salt)
            if via == "ferrocomm":
                pg.comm(dev).all_reduce(x)
            else:
                dist.all_reduce(x)
            assert torch.equal(x.cpu(), want), f"{via}: case {salt} ({dtype}, {n}) at {x.data_ptr():#x}"
            reused += x.data_ptr() == last
            last = x.data_ptr()
            del x
            # ferrocomm lets go of a finished call's tensors at its next
            # call; a barrier is one, after which the memory is torch's again.
            dist.barrier()
    print(f"rank {dist.get_rank()}: {2 * len(cases)} calls, {reused} on a reused address", flush=True)
    if kind == "cuda":
        assert reused >= 4, f"only {reused} calls landed on a reused address: the case proves little"
    dist.destroy_process_group()


def mixed(kind: str) -> None:
    """``cpu:gloo,cuda:ferrocomm``: the group takes both devices' tensors."""
    dev = _device("cuda")
    dist.init_process_group("cpu:gloo,cuda:ferrocomm")
    W, r = dist.get_world_size(), dist.get_rank()
    for d in (torch.device("cpu"), dev):
        t = torch.full((4096,), float(r + 1), device=d)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, W * (W + 1) / 2)), f"all_reduce on {d}"
    print(f"rank {r}: cpu:gloo,cuda:ferrocomm ok", flush=True)
    dist.destroy_process_group()


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch(rank: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _train(model: nn.Module, dev: torch.device, steps: int) -> None:
    """``steps`` SGD steps on this rank's batches, the gradients of the
    last one left in place (not applied)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        x, y = _batch(dist.get_rank(), s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        if s + 1 < steps:
            opt.step()


def _reference_grads(gloo: dist.ProcessGroup, steps: int) -> list:
    """The same training on CPU under DDP on gloo: the gradients of the last
    step, for every parameter."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_Mlp(), process_group=gloo)
    _train(model, torch.device("cpu"), steps)
    return [p.grad.detach().clone() for p in model.parameters()]


def _same_on_every_rank(t: torch.Tensor, what: str) -> None:
    bits = t.detach().contiguous().view(-1).view(torch.uint8)
    got = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(got, bits)
    for q, g in enumerate(got):
        assert torch.equal(g, got[0]), f"{what}: rank {q}'s bits differ from rank 0's"


def ddp(kind: str, steps: int = 3) -> None:
    """A few DDP steps on ferrocomm: gradients as on gloo (fp32 tolerance),
    bitwise the same on every rank."""
    dev = init(kind)
    gloo = dist.new_group(backend="gloo")
    want = _reference_grads(gloo, steps)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        _Mlp().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None
    )
    _train(model, dev, steps)
    for k, (p, w) in enumerate(zip(model.parameters(), want)):
        assert torch.allclose(p.grad.cpu(), w, rtol=1e-5, atol=1e-6), f"DDP grad {k}: {(p.grad.cpu() - w).abs().max()}"
        _same_on_every_rank(p.grad, f"DDP grad {k}")
    print(f"rank {dist.get_rank()}: DDP on ferrocomm ({dev}) matches gloo", flush=True)
    dist.destroy_process_group()


def fsdp(kind: str, steps: int = 3) -> None:
    """A few FSDP2 (``fully_shard``) steps on ferrocomm: the full gradients
    as DDP on gloo computes them (fp32 tolerance), the same on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch before 2.6
        from torch.distributed._composable.fsdp import fully_shard

    dev = init(kind)
    gloo = dist.new_group(backend="gloo")
    want = _reference_grads(gloo, steps)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Mlp().to(dev)
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, dev, steps)
    for k, (p, w) in enumerate(zip(model.parameters(), want)):
        full = p.grad.full_tensor()
        assert torch.allclose(full.cpu(), w, rtol=1e-5, atol=1e-6), f"FSDP2 grad {k}: {(full.cpu() - w).abs().max()}"
        _same_on_every_rank(full, f"FSDP2 grad {k}")
    print(f"rank {dist.get_rank()}: FSDP2 on ferrocomm ({dev}) matches gloo", flush=True)
    dist.destroy_process_group()


def dtensor(kind: str) -> None:
    """DTensor redistribution between Shard, Replicate and Partial: the
    functional collectives on a ferrocomm group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    dev = init(kind)
    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(dev.type, (W,))
    torch.manual_seed(0)
    full = torch.randn(8 * W, 16).to(dev)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(sharded.to_local(), full.chunk(W)[r]), "Shard(0) local"
    assert torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local(), full), "Shard -> Replicate"
    assert torch.equal(sharded.redistribute(mesh, [Shard(1)]).to_local(), full.chunk(W, 1)[r]), "Shard(0) -> Shard(1)"
    part = DTensor.from_local(torch.full((8 * W, 16), float(r + 1), device=dev), mesh, [Partial()])
    total = float(W * (W + 1) // 2)
    assert torch.equal(part.redistribute(mesh, [Replicate()]).to_local(),
                       torch.full((8 * W, 16), total, device=dev)), "Partial -> Replicate"
    assert torch.equal(part.redistribute(mesh, [Shard(0)]).to_local(),
                       torch.full((8, 16), total, device=dev)), "Partial -> Shard(0)"
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {r}: DTensor redistribution on ferrocomm ({dev}) ok", flush=True)
    dist.destroy_process_group()


def killed_rank(kind: str) -> None:
    """Not under torchrun (whose agent stops every rank when one dies): the
    test sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. The last rank dies;
    the others' next all_reduce raises within the group's timeout."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["FERROCOMM_TORCH_BLOCKING_WAIT"] = "1"
    dev = init(kind, timeout=5)
    W, r = dist.get_world_size(), dist.get_rank()
    x = torch.ones(1 << 16, device=dev)
    dist.all_reduce(x)
    assert x[0].item() == W
    dist.barrier()
    if r == W - 1:
        os._exit(17)
    time.sleep(1)
    start = time.monotonic()
    try:
        dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001 (torch may wrap ferrocomm's error)
        took = time.monotonic() - start
        print(f"raised {type(e).__name__} after {took:.1f} s: {e}", flush=True)
        assert "CommTimeout" in type(e).__name__ or "timed out" in str(e).lower() or "timeout" in str(e).lower(), e
        assert took < 2 * 5 + 5, took
    else:
        raise AssertionError("all_reduce with a dead peer did not raise")
    os._exit(0)  # skip the store's teardown: its host may be gone
