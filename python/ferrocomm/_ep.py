"""Expert-parallel (MoE) dispatch and combine inside one node, on the
symmetric heap: DeepEP's intranode shape, with a fixed maximum of tokens
per rank so the calls can be captured into CUDA graphs
(``ferrocomm::ep`` in Rust; docs/protocol.md, "Expert-parallel dispatch
and combine").

Experts are split evenly over ranks: expert ``e`` lives on rank
``e // experts_per_rank``. :meth:`EpBuffer.dispatch` sends each token once
to every rank that owns at least one of its top-k experts; rank ``r``
receives source ``s``'s tokens in ``s``'s order at rows
``s * max_tokens_per_rank + i`` for ``i < recv_counts[s]``, with the top-k
ids rewritten to ``r``'s local expert ids (-1 for other ranks' experts,
whose weights read 0). The experts apply the router weights and write
their outputs in the same padded layout; :meth:`EpBuffer.combine` sends
each row back to its source and sums a token's rows over the ranks it went
to, in rank order, in float32, rounded to bfloat16 once: bitwise the same on
every backend. Ids below 0 mean "no expert"; ids at or past ``num_experts``
are ignored (a token whose ids are all such goes nowhere and combines to 0).

What a dispatch received lives in the buffer's own memory, at addresses
fixed for the buffer's life: every dispatch returns the same tensors, and
their contents are valid until the next dispatch.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Dict, Optional

from . import _ferrocomm as _native
from ._call import Stream, Timeout, call_opts
from ._errors import InvalidArgument
from ._tensors import call_stream, is_torch, prepare

__all__ = ["EpBuffer", "DispatchOut", "EpTensor"]

EpTensor = _native.EpTensor
Work = _native.Work

_FIELDS = (
    "recv_x",
    "recv_scales",
    "recv_topk_idx",
    "recv_topk_weights",
    "recv_src_index",
    "recv_counts",
    "send_counts",
)


class DispatchOut:
    """What :meth:`EpBuffer.dispatch` left on this rank, as tensors of the
    framework ``x`` came in (torch tensors for torch, NumPy arrays for NumPy,
    else :class:`EpTensor` views exporting DLPack). All of them are views of
    the buffer's memory, the same objects after every dispatch, holding what
    the last one received.

    - ``recv_x``: ``[world * max_tokens_per_rank, hidden]`` rows, source
      ``s``'s tokens at rows ``s * max_tokens_per_rank + i`` for
      ``i < recv_counts[s]`` (the other rows are stale). bfloat16 or
      float8_e4m3fn as the buffer; NumPy sees their bits (uint16, uint8).
    - ``recv_scales``: float32 ``[rows, hidden // 128]`` (float8 buffers; else None).
    - ``recv_topk_idx``: int32 ``[rows, topk]``: this rank's local expert
      ids, -1 for other ranks' experts.
    - ``recv_topk_weights``: float32 ``[rows, topk]``, 0 where the id is -1.
    - ``recv_src_index``: int32 ``[rows]``: each row's token index at its source.
    - ``recv_counts``: int32 ``[world]``: rows received from each source.
    - ``send_counts``: int32 ``[world]``: tokens this rank sent to each rank
      (the layout step's count; DeepEP's ``num_tokens_per_rank``).
    - ``num_tokens``: tokens this rank dispatched (the rows ``combine``'s
      ``out`` needs).
    - ``work``: the :class:`Work` with ``async_op=True``, else None.

    On GPUs the tensors are filled once the dispatch has run on its stream
    (later work on that stream sees them; ``recv_counts.tolist()`` syncs).
    """

    __slots__ = _FIELDS + ("num_tokens", "work")

    def __init__(self, views: Dict[str, Any], num_tokens: int, work: Optional[Work]) -> None:
        for name in _FIELDS:
            setattr(self, name, views[name])
        self.num_tokens = num_tokens
        self.work = work

    def __repr__(self) -> str:
        shape = getattr(self.recv_x, "shape", None)
        return f"<ferrocomm.DispatchOut num_tokens={self.num_tokens} recv_x={tuple(shape) if shape else '?'}>"


def _framework(t: Any) -> Optional[str]:
    """Which framework's tensors the results are given as."""
    if is_torch(t):
        return "torch"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(t, np.ndarray):
        return "numpy"
    return None


def _convert(view: Any, framework: Optional[str]) -> Any:
    if view is None or framework is None:
        return view
    if framework == "torch":
        torch = sys.modules["torch"]
        if view.dtype == "float8_e4m3fn":
            # torch versions differ in taking float8 through DLPack; bytes go everywhere.
            return torch.from_dlpack(view.bits()).view(torch.float8_e4m3fn)
        return torch.from_dlpack(view)
    np = sys.modules["numpy"]
    if view.dtype in ("bfloat16", "float8_e4m3fn"):
        return np.from_dlpack(view.bits())
    return np.from_dlpack(view)


def _bits16(t: Any) -> tuple:
    """``t`` and whether it held bfloat16 bits in 16-bit integers (NumPy's
    way, having no bfloat16), viewed then as float16: the only 2-byte dtype
    DLPack carries into ferrocomm with the same bits."""
    if is_torch(t):
        torch = sys.modules["torch"]
        if t.dtype in (torch.int16, getattr(torch, "uint16", None)):  # torch.uint16: from 2.3
            return t.view(torch.float16), True
        return t, False
    np = sys.modules.get("numpy")
    if np is not None and isinstance(t, np.ndarray) and t.dtype in (np.uint16, np.int16):
        return t.view(np.float16), True
    return t, False


class EpBuffer:
    """Expert-parallel dispatch and combine buffers
    (:meth:`Communicator.ep_buffer`); see the module's docs for the layout.

    ``dispatch`` and ``combine`` are collective, must alternate (a second
    dispatch before the combine is refused: it would overwrite rows a peer
    still reads), and take ``async_op``, ``timeout`` and ``stream`` like
    collectives: on GPUs they run on ``stream=``, else on torch's current
    stream; on the host backend they return once done unless ``async_op``.
    A peer that never calls raises :class:`CommTimeout` naming it.

    bfloat16 rows from NumPy (which has no bfloat16) are their bits in
    uint16 (or int16) arrays; float8 rows are float8_e4m3fn tensors or their
    bytes as uint8.
    """

    __slots__ = ("_native", "_comm", "_views", "__weakref__")

    def __init__(self, native: Any, comm: Any) -> None:
        self._native = native
        self._comm = comm
        self._views: Dict[Optional[str], Dict[str, Any]] = {}

    # ------------------------------------------------------------ config

    @property
    def num_experts(self) -> int:
        return self._native.num_experts

    @property
    def hidden(self) -> int:
        return self._native.hidden

    @property
    def max_tokens_per_rank(self) -> int:
        return self._native.max_tokens_per_rank

    @property
    def topk(self) -> int:
        return self._native.topk

    @property
    def dtype(self) -> str:
        """The dispatched rows' dtype: ``bfloat16`` or ``float8_e4m3fn``."""
        return self._native.dtype

    @property
    def experts_per_rank(self) -> int:
        """Expert ``e`` lives on rank ``e // experts_per_rank``."""
        return self._native.experts_per_rank

    @property
    def layout(self) -> Dict[str, int]:
        """Byte offsets of the buffer's regions in its heap allocation, and
        ``total``, its size (the same on every rank)."""
        return dict(self._native.layout)

    @property
    def freed(self) -> bool:
        return self._native.freed

    # ------------------------------------------------------------ calls

    def _opts(self, async_op: bool, timeout: Timeout, stream: Stream, tensor: Any) -> Any:
        """A dispatch's or combine's options: no hints, the stream as :func:`call_stream` resolves it."""
        return call_opts(async_op, None, timeout, call_stream(self._comm, stream, tensor, "EP buffers"))

    def _received(self, framework: Optional[str]) -> Dict[str, Any]:
        views = self._views.get(framework)
        if views is None:
            views = {k: _convert(v, framework) for k, v in self._native.received().items()}
            self._views[framework] = views
        return views

    def dispatch(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        *,
        scales: Any = None,
        num_tokens: Optional[int] = None,
        async_op: bool = False,
        timeout: Timeout = None,
        stream: Stream = None,
    ) -> DispatchOut:
        """Send this rank's tokens to the ranks owning their experts.

        ``x``: ``[num_tokens, hidden]`` rows (bfloat16, or float8_e4m3fn
        with ``scales``, float32 ``[num_tokens, hidden // 128]``; DeepEP's
        ``(x, scales)`` pair works too). ``topk_idx``: int32
        ``[num_tokens, topk]`` expert ids; ``topk_weights``: float32, the
        same shape. ``num_tokens`` (at most ``max_tokens_per_rank``;
        default: the rows of ``x``) may differ between ranks, and be 0.
        Returns a :class:`DispatchOut`; with ``async_op=True`` its ``work``
        says when it is filled."""
        if isinstance(x, tuple):
            if scales is not None:
                raise InvalidArgument("EP dispatch: scales given twice (an (x, scales) pair and scales=)")
            if len(x) != 2:
                raise InvalidArgument(f"EP dispatch: x as a tuple is (rows, scales), got {len(x)} items")
            x, scales = x
        framework = _framework(x)
        x, x_bits = _bits16(prepare(x))
        n = None if num_tokens is None else operator.index(num_tokens)
        work, n = self._native.dispatch(
            x,
            prepare(topk_idx),
            prepare(topk_weights),
            None if scales is None else prepare(scales),
            n,
            x_bits,
            opts=self._opts(async_op, timeout, stream, x),
        )
        return DispatchOut(self._received(framework), n, work)

    def combine(
        self,
        expert_out: Any,
        out: Any,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
        stream: Stream = None,
    ) -> Optional[Work]:
        """Send the experts' rows back and sum each token's rows.

        ``expert_out``: bfloat16 ``[world * max_tokens_per_rank, hidden]``,
        the layout of ``recv_x`` (rows past ``recv_counts`` are not read),
        router weights already applied. ``out``: bfloat16
        ``[num_tokens, hidden]`` (the last dispatch's ``num_tokens``): token
        ``t``'s rows from the ranks it went to, summed in rank order in
        float32 and rounded once; 0 for a token that went nowhere. ``out``
        may not lie in the buffer's own memory (``recv_x``). Returns None,
        or a :class:`Work` with ``async_op=True``."""
        expert_out, expert_bits = _bits16(prepare(expert_out))
        out, out_bits = _bits16(prepare(out))
        return self._native.combine(
            expert_out,
            out,
            expert_bits,
            out_bits,
            opts=self._opts(async_op, timeout, stream, expert_out),
        )

    def received(self) -> Dict[str, EpTensor]:
        """The regions a dispatch fills, by :class:`DispatchOut`'s names, as
        :class:`EpTensor` views exporting DLPack (``.bits()`` gives
        bfloat16 and float8 as unsigned integers, for NumPy)."""
        return dict(self._native.received())

    def _let_go(self) -> None:
        """Drop the cached result tensors (they hold the buffer's memory)."""
        self._views.clear()

    def free(self) -> None:
        """Give the buffer's memory back to the heap. Every rank frees its
        EP buffers, heap tensors and windows in the same order. Refused while
        tensors of what a dispatch received, a Work of a dispatch or combine,
        or queued work still hold it: let them go (``del``) first."""
        self._let_go()
        self._native.free()

    def __repr__(self) -> str:
        return repr(self._native)
