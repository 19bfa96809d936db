"""Communication overlapped with the GEMMs around it, on ferrocomm's
chunked all-gather and reduce-scatter (``docs/protocol.md``, "Overlap
operations").

- :func:`all_gather_matmul`: ``torch.distributed._symmetric_memory.
  _fused_all_gather_matmul``'s arguments and results, on a ferrocomm
  communicator: the shards of ``A`` land one by one in a buffer on
  ferrocomm's symmetric heap, and the matmul of each shard starts on torch's
  current stream as soon as that shard has landed (own shard first).
- :func:`matmul_reduce_scatter`: ``_fused_matmul_reduce_scatter``'s: the
  partial product for each rank's chunk is computed on torch's current
  stream and put into that rank's inbox while the next one is computed;
  the output is the rank-order reduction of the partials (f32 accumulation
  for f16/bf16, the bits of ferrocomm's plain ``reduce_scatter``).
- :class:`ChunkedAllGather`, :class:`ChunkedReduceScatter`: the chunked
  operations themselves, for any framework's tensors (NumPy on the host
  backend).

torch is imported only when the torch functions are called. Buffers are
cached per communicator, shape and dtype: the first (eager) call of a shape
allocates them on the symmetric heap (collective: every rank must make the
same calls), so later calls, CUDA graph captures included, allocate no heap
memory. A capture whose shape was never run eagerly is refused.
:func:`release` frees a communicator's cached buffers (collective);
``comm.finalize()`` calls it first.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _ferrocomm as _native
from ._call import Timeout, call_opts
from ._errors import InvalidArgument
from ._tensors import call_stream

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "release",
    "ChunkedAllGather",
    "ChunkedReduceScatter",
]


def _opts(comm: Any, stream: Any, timeout: Timeout) -> Any:
    return call_opts(False, None, timeout, call_stream(comm, stream, None, "overlap operations"))


class ChunkedAllGather:
    """A chunked all-gather into ``output`` (``world`` equal shards in rank
    order; a heap tensor, or GPU memory ferrocomm can register), made on
    every rank alike (collective).

    One call: :meth:`start` on a comm stream, then :meth:`wait_chunk` for
    every chunk, once each, on any stream (a consumer's). The caller
    orders the streams: ``start``'s stream after the work that wrote
    ``input`` and after every read of the previous call's output, and
    nothing overwrites ``input`` before ``start``'s stream has run.
    ``stream``: a raw handle or a stream object (GPUs; default torch's
    current stream); none on the host backend (the communicator's own).
    """

    __slots__ = ("_comm", "_native")

    def __init__(self, comm: Any, output: Any) -> None:
        self._comm = comm
        self._native = _native.ChunkedAllGather(comm._native, output)

    @property
    def shard_count(self) -> int:
        """Elements of one shard (the input of :meth:`start`)."""
        return self._native.shard_count

    def start(self, input: Any, stream: Any = None, timeout: Timeout = None) -> None:
        """Queue one all-gather of ``input`` (one shard): "ready" to every
        peer, the own shard copied, then per peer a put after its "ready"
        and a "landed" signal."""
        self._native.start(input, opts=_opts(self._comm, stream, timeout))

    def wait_chunk(self, chunk: int, stream: Any = None, timeout: Timeout = None) -> None:
        """Make ``stream`` wait until rank ``chunk``'s shard has landed."""
        self._native.wait_chunk(int(chunk), opts=_opts(self._comm, stream, timeout))

    def wait_all(self, stream: Any = None, timeout: Timeout = None) -> None:
        """:meth:`wait_chunk` for every chunk not waited for yet."""
        self._native.wait_all(opts=_opts(self._comm, stream, timeout))

    def free(self) -> None:
        """Release the signal windows (collective, in heap order). Work on
        other streams, and graphs that captured this object, must be done."""
        self._native.free()

    def __repr__(self) -> str:
        return repr(self._native)


class ChunkedReduceScatter:
    """A chunked reduce-scatter of chunks of ``chunk_count`` x ``dtype``
    through an inbox on the symmetric heap (collective to make and free).

    One call: :meth:`put_chunk` once for every rank (itself included; any
    order, any streams), then :meth:`finish` on the consumer's stream. A
    partial must not be overwritten before its ``put_chunk``'s stream has
    run. ``stream`` as for :class:`ChunkedAllGather`.
    """

    __slots__ = ("_comm", "_native")

    def __init__(self, comm: Any, chunk_count: int, dtype: Any) -> None:
        from ._comm import _dtype_name

        self._comm = comm
        self._native = _native.ChunkedReduceScatter(comm._native, int(chunk_count), _dtype_name(dtype))

    @property
    def chunk_count(self) -> int:
        """Elements of one chunk (one rank's output)."""
        return self._native.chunk_count

    def put_chunk(self, dst: int, partial: Any, stream: Any = None, timeout: Timeout = None) -> None:
        """Put ``partial`` (this rank's partial for rank ``dst``'s chunk)
        into ``dst``'s inbox, after ``dst``'s "ready", and signal it."""
        self._native.put_chunk(int(dst), partial, opts=_opts(self._comm, stream, timeout))

    def finish(self, output: Any, op: str = "sum", stream: Any = None, timeout: Timeout = None) -> None:
        """Wait for every rank's partial, reduce them in rank order (``op``:
        ``"sum"`` or ``"avg"``) into ``output``, and free the slots."""
        self._native.finish(output, str(op), opts=_opts(self._comm, stream, timeout))

    def free(self) -> None:
        """Release the inbox and the signal windows (collective, in heap
        order). Work on other streams, and captured graphs, must be done."""
        self._native.free()

    def __repr__(self) -> str:
        return repr(self._native)


# ---------------------------------------------------------------- torch ops


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise InvalidArgument("ferrocomm.ops' matmul operations need torch") from e
    return torch


class _AgState:
    """A cached all-gather: the heap buffer (and torch's view of it), the
    chunked operation over it, and the side stream its puts run on."""

    __slots__ = ("heap", "gathered", "op", "stream")


class _RsState:
    __slots__ = ("op", "stream")


# Per communicator: {key: state}. Weak, so a dropped communicator's entry goes.
_CACHE: "weakref.WeakKeyDictionary[Any, Dict[tuple, Any]]" = weakref.WeakKeyDictionary()


def _cache(comm: Any) -> Dict[tuple, Any]:
    entries = _CACHE.get(comm)
    if entries is None:
        entries = _CACHE[comm] = {}
    return entries


def _refuse_in_capture(torch: Any, what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise InvalidArgument(
            f"{what}: the first call of this shape and dtype allocates its buffers on the symmetric heap "
            "(collective), which a CUDA graph capture cannot do: run it once eagerly before capturing"
        )


def _ag_state(torch: Any, comm: Any, rows: int, k: int, dtype: Any, device: Any) -> _AgState:
    key = ("ag", rows, k, dtype)
    entries = _cache(comm)
    st = entries.get(key)
    if st is None:
        _refuse_in_capture(torch, "all_gather_matmul")
        st = _AgState()
        st.heap = comm.heap_tensor((comm.size * rows, k), dtype)
        st.gathered = torch.from_dlpack(st.heap)
        st.op = ChunkedAllGather(comm, st.heap)
        st.stream = torch.cuda.Stream(device=device)
        entries[key] = st
    return st


def _rs_state(torch: Any, comm: Any, rows: int, n: int, dtype: Any, device: Any) -> _RsState:
    key = ("rs", rows, n, dtype)
    entries = _cache(comm)
    st = entries.get(key)
    if st is None:
        _refuse_in_capture(torch, "matmul_reduce_scatter")
        st = _RsState()
        st.op = ChunkedReduceScatter(comm, rows * n, dtype)
        st.stream = torch.cuda.Stream(device=device)
        entries[key] = st
    return st


def release(comm: Any) -> None:
    """Free the buffers :func:`all_gather_matmul` and
    :func:`matmul_reduce_scatter` cached for ``comm`` (collective: every
    rank, after the same calls; queued work and captured graphs that use
    them must be finished). Later calls allocate again."""
    entries = _CACHE.pop(comm, None) or {}
    torch = _torch() if entries else None
    if torch is not None:
        torch.cuda.synchronize()
    # Heap order: the same on every rank, since every rank made the same calls.
    for _, st in sorted(entries.items(), key=lambda kv: repr(kv[0])):
        st.op.free()
        if isinstance(st, _AgState):
            st.gathered = None
            st.heap.free()


def _check_matmul(torch: Any, a: Any, bs: Sequence[Any], dim: int, what: str, dim_name: str) -> None:
    if not isinstance(a, torch.Tensor) or a.device.type != "cuda":
        raise InvalidArgument(f"{what}: A must be a torch CUDA tensor")
    if a.dim() < 2:
        raise InvalidArgument(f"{what}: A must have at least 2 dims, it has {a.dim()}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0 or dim >= a.dim() - 1:
        raise InvalidArgument(
            f"{what}: {dim_name} {dim!r} must be a dim of A other than the last (0..{a.dim() - 2}); "
            "the last is the contraction dim"
        )
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidArgument(f"{what}: dtype {a.dtype} (float32, float16 or bfloat16)")
    for b in bs:
        if not isinstance(b, torch.Tensor) or b.dim() != 2:
            raise InvalidArgument(f"{what}: every B must be a 2-D torch tensor")
        if b.shape[0] != a.shape[-1] or b.dtype != a.dtype or b.device != a.device:
            raise InvalidArgument(
                f"{what}: B of shape {tuple(b.shape)} {b.dtype} on {b.device} does not take A's last dim "
                f"{a.shape[-1]} ({a.dtype} on {a.device})"
            )


def _raw(stream: Any) -> int:
    return int(stream.cuda_stream)


def all_gather_matmul(
    a_shard: Any,
    bs: Sequence[Any],
    gather_dim: int,
    comm: Any,
    *,
    return_a: bool = True,
) -> Tuple[Optional[Any], List[Any]]:
    """``(A, [A @ B for B in bs])`` where ``A`` is the all-gather of every
    rank's ``a_shard`` along ``gather_dim`` (any dim but the last): torch's
    ``_fused_all_gather_matmul`` on a ferrocomm communicator, on torch's
    current stream.

    The shard moves to its peers on a side stream (one copy-engine put per
    peer into its heap buffer, after the peer said its buffer is free),
    and each shard's matmul starts as soon as that shard has landed: own
    shard first, then the ranks below in turn (the order they arrive in).
    ``A`` is a new tensor (``return_a=False``: ``None``, saving its copy
    out of the heap buffer); the products are new tensors.

    The first call of a shape and dtype allocates the buffer on
    ferrocomm's heap (collective: every rank makes the same calls); later
    calls allocate none and may be captured into a CUDA graph (a capture
    of a shape never run eagerly is refused). :func:`release` frees them.
    """
    torch = _torch()
    what = "all_gather_matmul"
    _check_matmul(torch, a_shard, bs, gather_dim, what, "gather_dim")
    world, rank = comm.size, comm.rank
    moved = a_shard.movedim(gather_dim, 0)
    lead, k = list(moved.shape[:-1]), moved.shape[-1]
    flat = moved.reshape(-1, k)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.shape[0]
    st = _ag_state(torch, comm, rows, k, a_shard.dtype, a_shard.device)
    cur = torch.cuda.current_stream(a_shard.device)
    # The puts (and the "ready" this rank gives) come after the shard was
    # written and after the previous call's reads, both on `cur`.
    st.stream.wait_stream(cur)
    with torch.cuda.stream(st.stream):
        # Current while the shard is handed over, so ferrocomm takes it
        # straight from torch (the order is the wait above).
        st.op.start(flat, stream=_raw(st.stream))
    outs = [torch.empty((world * rows, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device) for b in bs]
    for i in range(world):
        src = (rank - i) % world
        st.op.wait_chunk(src, stream=_raw(cur))
        shard = st.gathered[src * rows : (src + 1) * rows]
        for b, out in zip(bs, outs):
            torch.mm(shard, b, out=out[src * rows : (src + 1) * rows])
    # The shard may be freed once the puts have read it; a capture joins here.
    cur.wait_stream(st.stream)

    def unflatten(t: Any) -> Any:
        return t.view(world, *lead, -1).flatten(0, 1).movedim(0, gather_dim)

    a = unflatten(st.gathered.clone()) if return_a else None
    if not torch.cuda.is_current_stream_capturing():
        # The next call's "ready" comes after this call's reads even when
        # it runs on another stream. (In a capture the side stream must end
        # joined; there the next call's stream is the capture's.)
        st.stream.wait_stream(cur)
    return a, [unflatten(o) for o in outs]


def matmul_reduce_scatter(
    a: Any,
    b: Any,
    scatter_dim: int,
    comm: Any,
    reduce_op: str = "sum",
) -> Any:
    """The reduce-scatter of ``a @ b`` along ``scatter_dim`` (any dim of
    ``a`` but the last, divisible by the world): torch's
    ``_fused_matmul_reduce_scatter`` on a ferrocomm communicator, on
    torch's current stream. ``reduce_op``: ``"sum"`` or ``"avg"``.

    The partial product for each rank's chunk is computed on torch's
    current stream (peers' chunks first, own last) and put into that
    rank's inbox on a side stream while the next is computed; the result is
    the rank-order reduction of the partials (f32 accumulation for
    bf16/f16), written on torch's current stream. Buffers as for
    :func:`all_gather_matmul`: allocated on the first eager call of a
    shape, none during a CUDA graph capture.
    """
    torch = _torch()
    what = "matmul_reduce_scatter"
    _check_matmul(torch, a, [b], scatter_dim, what, "scatter_dim")
    if reduce_op not in ("sum", "avg"):
        raise InvalidArgument(f"{what}: reduce_op {reduce_op!r} (sum or avg)")
    world, rank = comm.size, comm.rank
    moved = a.movedim(scatter_dim, 0)
    if moved.shape[0] % world != 0:
        raise InvalidArgument(
            f"{what}: dim {scatter_dim} of A has {moved.shape[0]} entries, not a multiple of the world ({world})"
        )
    per = moved.shape[0] // world
    rest, k, n = list(moved.shape[1:-1]), moved.shape[-1], b.shape[1]
    rows = per
    for d in rest:
        rows *= d
    st = _rs_state(torch, comm, rows, n, a.dtype, a.device)
    cur = torch.cuda.current_stream(a.device)
    partials = []
    for i in range(1, world + 1):
        dst = (rank + i) % world
        chunk = moved[dst * per : (dst + 1) * per].reshape(rows, k)
        partial = torch.mm(chunk, b)
        partials.append(partial)
        st.stream.wait_stream(cur)
        with torch.cuda.stream(st.stream):
            st.op.put_chunk(dst, partial, stream=_raw(st.stream))
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    # The partials may be freed once the puts have read them; a capture joins here.
    cur.wait_stream(st.stream)
    st.op.finish(out, reduce_op, stream=_raw(cur))
    del partials
    return out.view(per, *rest, n).movedim(0, scatter_dim)
