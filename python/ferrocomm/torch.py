"""ferrocomm as a ``torch.distributed`` backend.

    import torch.distributed as dist
    import ferrocomm.torch  # registers the backend "ferrocomm" for cpu and cuda

    dist.init_process_group("ferrocomm")          # under torchrun
    dist.all_reduce(tensor)                       # DDP, FSDP2, DTensor unchanged

The group is a Python :class:`torch.distributed.ProcessGroup` over
ferrocomm communicators, one per device its tensors live on, opened at
that device's first call: CUDA tensors run on ferrocomm's GPU backend, on
torch's current stream; CPU tensors on its host backend. torch lets a
Python backend own the whole group, so with ``"cpu:gloo,cuda:ferrocomm"``
CPU tensors also run on ferrocomm (its host backend), not on gloo.

Every call returns a work object. Calls are stream-ordered like NCCL's:
``wait()`` makes the caller's current stream wait for the collective and
returns at once; with ``FERROCOMM_TORCH_BLOCKING_WAIT=1`` it also blocks
until the collective has finished and raises the error of one that failed
(a dead peer: :class:`ferrocomm.CommTimeout` within the group's timeout).
Without it, a failed stream-ordered call raises at the group's next call.

What the backend does not carry (``recv`` from any source, a
``PREMUL_SUM`` whose factor torch keeps in C++) raises
:class:`ferrocomm.Unsupported` naming the operation.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ._bootstrap import from_store
from ._comm import Communicator
from ._errors import InvalidArgument, Unsupported
from ._ops import ReduceOp
from ._tensors import torch_current_stream

__all__ = ["BACKEND", "ProcessGroupFerrocomm", "register"]

BACKEND = "ferrocomm"

# torch's reduction enum (``opts.reduceOp.op``) to ferrocomm's names.
_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


def _op(opts: Any, what: str) -> ReduceOp:
    """ferrocomm's reduction for a torch options object's ``reduceOp``."""
    red = getattr(opts.reduceOp, "op", opts.reduceOp)
    op = _OPS.get(red)
    if op is None:
        raise Unsupported(
            f"{what}: reduction {red} is not carried by the ferrocomm backend (PREMUL_SUM keeps its factor in "
            "C++, out of a Python backend's reach): use SUM or AVG, or ferrocomm.ReduceOp.premul_sum on a "
            "ferrocomm.Communicator"
        )
    return op


def _blocking_wait() -> bool:
    return os.environ.get("FERROCOMM_TORCH_BLOCKING_WAIT", "0") not in ("", "0")


class _Work(dist._Work):
    """A collective queued on the raw stream ``stream`` of GPU ``device``
    (``device`` None: it ran on the CPU and is done). ``native`` is
    ferrocomm's :class:`~ferrocomm.Work` when the call was made with
    ``async_op=True`` (blocking waits), else None.

    torch's synchronous collectives call :meth:`wait` on every call: on the
    stream the call ran on (the common case) it compares two handles and
    builds no stream object."""

    def __init__(self, result: Any, device: Optional[int] = None, stream: int = 0, native: Any = None) -> None:
        super().__init__()
        self._result = result
        self._device = device
        self._raw = stream
        self._native = native
        self._future: Optional[torch.futures.Future] = None

    @property
    def _stream(self) -> Optional[torch.cuda.Stream]:
        """The stream the call ran on, as torch's object (None on the CPU)."""
        if self._device is None:
            return None
        if self._raw == 0:
            return torch.cuda.default_stream(self._device)
        return torch.cuda.ExternalStream(self._raw, device=torch.device("cuda", self._device))

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._native is not None:
            limit = timeout.total_seconds() if timeout and timeout.total_seconds() > 0 else None
            self._native.wait(limit)
        if self._device is not None and torch_current_stream(self._device) != self._raw:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            if self._device is None:
                fut = torch.futures.Future()
                fut.set_result(self._result)
            else:
                # A CUDA-aware future: set_result records an event on the
                # collective's stream, and whoever reads the value (DDP's
                # reducer, a callback) waits for it on their own stream.
                fut = torch.futures.Future(devices=[torch.device("cuda", self._device)])
                with torch.cuda.stream(self._stream):
                    fut.set_result(self._result)
            self._future = fut
        return self._future

    def is_completed(self) -> bool:
        if self._native is not None:
            return bool(self._native.is_completed())
        return self._device is None or self._stream.query()

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def synchronize(self) -> None:
        self.wait()


class _Capabilities:
    """What torch's Python code asks of a group's backend: no feature it
    checks for (``supports_*``) but coalescing, and for anything else the
    RuntimeError a group without that device's backend raises, which
    torch's callers already expect."""

    supports_coalescing = True

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("supports_"):
            return False
        raise RuntimeError(f"the ferrocomm backend is a Python group without a C++ backend: it has no {name}")


class ProcessGroupFerrocomm(dist.ProcessGroup):
    """A torch process group whose collectives run on ferrocomm.

    Created by ``init_process_group("ferrocomm")`` or ``new_group(...,
    backend="ferrocomm")``. It opens one ferrocomm communicator per device
    its tensors live on, at the first call there (a collective step, like
    every call: all ranks make the same calls): the host backend for CPU
    tensors, the GPU backend for CUDA tensors on their device.
    :meth:`comm` gives that communicator, for ferrocomm's own calls (fused
    epilogues, windows, EP) on the same ranks.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout.total_seconds()
        self._comms: dict = {}
        # The GPU communicators again, by device index: the per-call lookup.
        self._gpu_comms: dict = {}
        self._blocking = _blocking_wait()
        self._last: Optional[Communicator] = None
        self._coalescing: Optional[List[tuple]] = None
        self._group_name = ""
        self._group_desc = ""

    def comm(self, device: Any = "cpu") -> Communicator:
        """The ferrocomm communicator for tensors on ``device`` (``"cpu"``,
        ``"cuda:N"``, a ``torch.device``), opened on first use. Collective
        the first time."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        c = self._comms.get(key)
        if c is None:
            if dev.type not in ("cpu", "cuda"):
                raise Unsupported(f"the ferrocomm backend runs CPU and CUDA tensors, not {dev.type}")
            backend, index = ("host", None) if dev.type == "cpu" else ("cuda", dev.index)
            # Each device's communicator rendezvouses under its own prefix
            # of the group's store.
            store = dist.PrefixStore(f"ferrocomm/{key}/", self._store)
            c = from_store(store, self.rank(), self.size(), backend=backend, device=index, timeout=self._timeout)
            self._comms[key] = c
        return c

    # ------------------------------------------------------------ identity

    def getBackendName(self) -> str:  # noqa: N802 (torch's names)
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"<ProcessGroupFerrocomm rank {self.rank()} of {self.size()} on {sorted(self._comms) or 'no device yet'}>"

    def _get_backend(self, device: Any) -> "_Capabilities":
        """What torch's Python code asks a group's backend for a device
        (``new_group`` under a bound device asks ``supports_splitting``):
        this group is its own backend, with no C++ one behind it."""
        return _Capabilities()

    # ------------------------------------------------------------ running a call

    def _run(self, key: Any, result: Any, call: Any) -> _Work:
        """Run ``call(comm, async_op)`` on the communicator for the device
        of tensor ``key`` and wrap it in a work object. CUDA calls run on
        torch's current stream there."""
        if key is not None and getattr(key, "is_cuda", False):
            index = key.get_device()
            c = self._gpu_comms.get(index)
            if c is None:
                c = self._gpu_comms[index] = self.comm(torch.device("cuda", index))
            self._last = c
            native = call(c, self._blocking)
            return _Work(result, index, torch_current_stream(index), native if self._blocking else None)
        c = self._last = self.comm("cpu")
        call(c, False)
        return _Work(result)

    @staticmethod
    def _one(tensors: Sequence[Any], what: str) -> Any:
        if len(tensors) != 1:
            raise InvalidArgument(f"{what}: one tensor per rank, got {len(tensors)} (torch's multi-device form)")
        return tensors[0]

    # ------------------------------------------------------------ reductions

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        t, op = self._one(tensors, "all_reduce"), _op(opts, "all_reduce")
        return self._run(t, tensors, lambda c, a: c.all_reduce(t, op, async_op=a))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op = _op(opts, "all_reduce_coalesced")
        works = [self._run(t, [t], lambda c, a, t=t: c.all_reduce(t, op, async_op=a)) for t in tensors]
        return works[-1] if works else _Work(tensors, None)

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        t, op = self._one(tensors, "reduce"), _op(opts, "reduce")
        root = int(opts.rootRank)
        return self._run(t, tensors, lambda c, a: c.reduce(t, root, op, async_op=a))

    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        out, ins = self._one(outputs, "reduce_scatter"), self._one(inputs, "reduce_scatter")
        op = _op(opts, "reduce_scatter")
        return self._run(out, outputs, lambda c, a: c.reduce_scatter(out, ins, op, async_op=a))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = _op(opts, "reduce_scatter_tensor")
        flat_out, flat_in = output.view(-1), input.view(-1)
        return self._run(input, [output], lambda c, a: c.reduce_scatter_single(flat_out, flat_in, op, async_op=a))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> _Work:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else _Work(outputs, None)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ------------------------------------------------------------ data movement

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = self._one(tensors, "broadcast")
        root = int(opts.rootRank)
        return self._run(t, tensors, lambda c, a: c.broadcast(t, root, async_op=a))

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> _Work:
        outs, inp = self._one(outputs, "all_gather"), self._one(inputs, "all_gather")
        return self._run(inp, outputs, lambda c, a: c.all_gather(outs, inp, async_op=a))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        flat_out, flat_in = output.view(-1), input.view(-1)
        return self._run(input, [output], lambda c, a: c.all_gather_single(flat_out, flat_in, async_op=a))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> _Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else _Work(outputs, None)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int],
        opts: Any = None,
    ) -> _Work:
        if not output_split_sizes and not input_split_sizes:
            call = lambda c, a: c.all_to_all_single(output, input, async_op=a)  # noqa: E731
        else:
            outs = list(output_split_sizes) or None
            ins = list(input_split_sizes) or None
            call = lambda c, a: c.all_to_all_v_single(output, input, outs, ins, async_op=a)  # noqa: E731
        return self._run(input, [output], call)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> _Work:
        key = inputs[0] if inputs else None
        return self._run(key, outputs, lambda c, a: c.all_to_all(outputs, inputs, async_op=a))

    def gather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.GatherOptions()
        inp = self._one(inputs, "gather")
        outs = outputs[0] if outputs else []
        root = int(opts.rootRank)
        return self._run(inp, outputs, lambda c, a: c.gather(outs, inp, root, async_op=a))

    def scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]], opts: Any = None) -> _Work:
        opts = opts if opts is not None else dist.ScatterOptions()
        out = self._one(outputs, "scatter")
        ins = inputs[0] if inputs else []
        root = int(opts.rootRank)
        return self._run(out, outputs, lambda c, a: c.scatter(out, ins, root, async_op=a))

    def barrier(self, opts: Any = None) -> _Work:
        # Blocks until every rank arrives, on the communicator of the last
        # call (the same on every rank: they make the same calls), as
        # torch's NCCL barrier does on its last device.
        (self._last or self.comm("cpu")).barrier()
        return _Work(None, None)

    # ------------------------------------------------------------ point to point

    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int = 0) -> _Work:  # noqa: N803
        t = self._one(tensors, "send")
        if self._coalescing is not None:
            self._coalescing.append(("send", t, int(dstRank)))
            return _Work(tensors, None)
        return self._run(t, tensors, lambda c, a: c.send(t, int(dstRank), async_op=a))

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int = 0) -> _Work:  # noqa: N803
        t = self._one(tensors, "recv")
        if self._coalescing is not None:
            self._coalescing.append(("recv", t, int(srcRank)))
            return _Work(tensors, None)
        return self._run(t, tensors, lambda c, a: c.recv(t, int(srcRank), async_op=a))

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> _Work:
        raise Unsupported("recv from any source: the ferrocomm backend receives from a named rank only")

    # Sends and receives between start and end run as one group
    # (batch_isend_irecv), which cannot deadlock on its own order.
    @property
    def supports_coalescing(self) -> bool:
        return True

    def start_coalescing(self, device: Any = None) -> None:
        if self._coalescing is not None:
            raise InvalidArgument("start_coalescing: already coalescing")
        self._coalescing = []

    def end_coalescing(self, device: Any = None) -> _Work:
        ops, self._coalescing = self._coalescing or [], None
        if not ops:
            return _Work(None, None)
        key = ops[0][1]
        return self._run(key, None, lambda c, a: c.batch_p2p(ops, async_op=a))

    # ------------------------------------------------------------ life cycle

    def abort(self) -> None:
        for c in self._comms.values():
            c.abort()

    def shutdown(self) -> None:
        for c in self._comms.values():
            c.finalize()


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupFerrocomm:
    """torch's backend constructor: the group over its (prefixed) store,
    with its timeout; communicators open at their device's first call."""
    return ProcessGroupFerrocomm(store, rank, size, timeout)


def register() -> None:
    """Register the backend ``"ferrocomm"`` for cpu and cuda (done on
    ``import ferrocomm.torch``; calling it again does nothing)."""
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


register()
