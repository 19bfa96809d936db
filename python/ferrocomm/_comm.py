"""The communicator, with torchcomms' names and keyword arguments.

Every collective takes tensors through DLPack (torch, CuPy, JAX, NumPy)
and uses them in place. CPU arrays run on the host backend; CUDA and ROCm
tensors on the GPU backend, on the caller's current stream (``stream=``,
else torch's or CuPy's current stream). A communicator created for a GPU
creates its host twin the first time it is given CPU arrays; that creation
is collective like the call that triggers it.

``async_op=False`` (the default) queues the collective stream-ordered and
returns None: later work on the same stream sees its result. Where there
is no stream the caller orders work on (CPU arrays, a GPU tensor of a
framework whose stream ferrocomm does not know), the call returns once the
collective has completed. ``async_op=True`` returns a :class:`Work`.
"""

from __future__ import annotations

import operator
import threading
import weakref
from numbers import Integral
from typing import Any, Iterable, Optional, Sequence

from . import _ferrocomm as _native
from ._broadcaster import Broadcaster
from ._call import Hints, Stream, Timeout, call_opts, seconds
from ._ep import EpBuffer
from ._errors import InvalidArgument
from ._ops import ReduceOp, as_op
from ._tensors import (
    HOST_MEMORY,
    call_stream,
    current_stream,
    device_type,
    prepare,
    stream_handle,
    torch_current_stream,
    torch_gpu,
)

__all__ = [
    "Communicator", "Work", "P2POp", "HeapTensor", "HeapTensorBits", "Window", "RemoteTensor", "EpBuffer",
    "Broadcaster", "seconds",
]

Work = _native.Work
HeapTensor = _native.HeapTensor
HeapTensorBits = _native.HeapTensorBits
RemoteTensor = _native.RemoteTensor

def _dtype_name(dtype: Any) -> str:
    """A dtype's name from a string, a NumPy dtype or type, or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, type):
        name = dtype.__name__  # np.float32
    elif isinstance(getattr(dtype, "name", None), str):
        name = dtype.name  # np.dtype("float32")
    else:
        name = str(dtype)  # torch.float32
    return name[len("torch."):] if name.startswith("torch.") else name


def _factor(op: ReduceOp) -> Any:
    f = op.factor
    return prepare(f) if f is not None and not isinstance(f, float) else f


def _moe_topk(idx: Any, scales: Any, topk: Any, shared: Any) -> int:
    """The MoE-finalize arguments of ``all_reduce_fused`` checked, as far
    as the host can before the native call checks dtypes and sizes: both
    the index and the scales given, ``topk`` an int in range (by default
    the index's second dimension), the 2-D ones ``tokens x topk``."""
    routing = (("expanded_idx_to_permuted_idx", idx), ("expert_scales", scales))
    missing = [n for n, v in routing if v is None]
    if missing:
        given = [n for n, v in routing + (("topk", topk), ("shared_expert_output", shared)) if v is not None]
        raise InvalidArgument(
            f"all_reduce_fused: the MoE-finalize prologue needs expanded_idx_to_permuted_idx and expert_scales "
            f"together; {' and '.join(missing)} missing (given: {', '.join(given)})"
        )
    shapes = [(n, getattr(t, "shape", None)) for n, t in routing]
    if topk is None:
        dims = [tuple(sh) for _, sh in shapes if sh is not None and len(sh) == 2]
        if not dims:
            raise InvalidArgument(
                "all_reduce_fused: give topk, or expanded_idx_to_permuted_idx as a tokens x topk array"
            )
        topk = int(dims[0][1])
    elif isinstance(topk, bool) or not isinstance(topk, Integral):
        raise InvalidArgument(f"all_reduce_fused: topk = {topk!r} must be an int")
    topk = int(topk)
    if not 1 <= topk <= _native.MOE_MAX_TOPK:
        raise InvalidArgument(f"all_reduce_fused: topk = {topk} must be 1 to {_native.MOE_MAX_TOPK}")
    for n, sh in shapes:
        if sh is not None and len(sh) == 2 and int(sh[1]) != topk:
            raise InvalidArgument(
                f"all_reduce_fused: {n} is {int(sh[0])} x {int(sh[1])}, not tokens x topk (topk = {topk})"
            )
    return topk


class P2POp:
    """One send or receive of :meth:`Communicator.batch_isend_irecv`.

    ``op`` is ``"send"``/``"isend"``, ``"recv"``/``"irecv"``, or a function
    with one of those names (``torch.distributed.isend``, ``comm.send``).
    ``peer`` is a rank of the communicator the batch runs on.
    """

    __slots__ = ("op", "tensor", "peer")

    def __init__(self, op: Any, tensor: Any, peer: int) -> None:
        name = op if isinstance(op, str) else getattr(op, "__name__", "")
        if name in ("send", "isend"):
            self.op = "send"
        elif name in ("recv", "irecv"):
            self.op = "recv"
        else:
            raise InvalidArgument(f"P2POp op {op!r}: expected send/isend or recv/irecv")
        self.tensor = tensor
        self.peer = int(peer)

    def __repr__(self) -> str:
        return f"P2POp({self.op!r}, peer={self.peer})"


class Window:
    """A one-sided window (:meth:`Communicator.new_window`), torchcomms' names.

    Offsets count elements of the buffer's dtype. ``put``, ``signal`` and
    ``wait_signal`` run stream-ordered on GPUs (``stream=``, else torch's
    current stream on the communicator's device; the three must share a
    stream to be ordered) and return None, or a :class:`Work` with
    ``async_op=True``; on the host backend they return once done. A
    ``wait_signal`` whose peer never signals raises :class:`CommTimeout`
    naming it (``missing``) after ``timeout`` (default: the communicator's),
    and the communicator is aborted.
    """

    __slots__ = ("_native", "_comm")

    def __init__(self, native: Any, comm: "Communicator") -> None:
        self._native = native
        self._comm = comm

    def _opts(self, async_op: bool, timeout: Timeout, stream: Stream, tensor: Any = None) -> Any:
        """A window call's options: no hints, the stream as :func:`call_stream` resolves it."""
        return call_opts(async_op, None, timeout, call_stream(self._comm, stream, tensor, "windows"))

    def tensor_register(self, tensor: Any) -> None:
        """Make ``tensor`` the window's buffer (collective; sizes may differ
        between ranks, dtypes may not)."""
        self._native.tensor_register(prepare(tensor))

    def put(
        self,
        tensor: Any,
        dst_rank: int,
        target_offset: int = 0,
        async_op: bool = False,
        timeout: Timeout = None,
        stream: Stream = None,
    ) -> Optional[Work]:
        """Copy ``tensor`` into ``dst_rank``'s buffer at element
        ``target_offset``; follow it with ``signal(dst_rank)``."""
        tensor = prepare(tensor)
        opts = self._opts(async_op, timeout, stream, tensor)
        return self._native.put(tensor, int(dst_rank), int(target_offset), opts=opts)

    def signal(
        self, dst_rank: int, async_op: bool = False, timeout: Timeout = None, stream: Stream = None
    ) -> Optional[Work]:
        """Tell ``dst_rank`` that this rank's earlier puts on the stream landed."""
        return self._native.signal(int(dst_rank), opts=self._opts(async_op, timeout, stream))

    def wait_signal(
        self, peer_rank: int, async_op: bool = False, timeout: Timeout = None, stream: Stream = None
    ) -> Optional[Work]:
        """Wait until ``peer_rank`` has signalled once more than the waits
        before (signals are counted, so each wait matches one signal)."""
        return self._native.wait_signal(int(peer_rank), opts=self._opts(async_op, timeout, stream))

    def map_remote_tensor(self, rank: int) -> RemoteTensor:
        """``rank``'s buffer as mapped in this process, exporting DLPack
        (``numpy.from_dlpack`` on the host backend, ``torch.from_dlpack`` on
        GPUs). Views of it keep ``tensor_deregister`` and ``free`` from
        running until they are let go."""
        return self._native.map_remote_tensor(int(rank))

    def tensor_deregister(self) -> None:
        """Let the buffer go (local); puts queued into it must have completed."""
        self._native.tensor_deregister()

    def free(self) -> None:
        """Release the window (its signal words are heap memory: every rank
        frees windows and heap tensors in the same order)."""
        self._native.free()

    def __repr__(self) -> str:
        return repr(self._native)


class Communicator:
    """A group of ranks running collectives together.

    Create one with :func:`ferrocomm.init`, :func:`ferrocomm.from_torch` or
    :func:`ferrocomm.from_store`. Every rank must call the same collectives
    in the same order; ranks that disagree get :class:`Mismatch` or
    :class:`CommTimeout`, never wrong data or a hang.
    """

    def __init__(self, native: Any, host: Any = None) -> None:
        self._native = native
        self._host = native if native.backend == "host" else host
        self._host_lock = threading.Lock()
        # Their cached result tensors hold heap memory, which finalize
        # would otherwise refuse to release.
        self._ep_buffers: "weakref.WeakSet[EpBuffer]" = weakref.WeakSet()

    # ------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def size(self) -> int:
        return self._native.size

    def get_rank(self) -> int:
        return self._native.rank

    def get_size(self) -> int:
        return self._native.size

    @property
    def name(self) -> str:
        return self._native.name

    def get_name(self) -> str:
        return self._native.name

    @property
    def backend(self) -> str:
        """``host``, ``cuda`` or ``rocm``."""
        return self._native.backend

    @property
    def device(self) -> int:
        """The GPU index (a label on the host backend)."""
        return self._native.device

    @property
    def has_vendor_library(self) -> bool:
        """Whether NCCL/RCCL runs underneath (GPU backends)."""
        return self._native.has_vendor_library

    def __repr__(self) -> str:
        return f"<ferrocomm.Communicator {self.name!r} rank {self.rank} of {self.size} on {self.backend}:{self.device}>"

    # ------------------------------------------------------------ routing

    def _host_comm(self) -> Any:
        with self._host_lock:
            if self._host is None:
                self._host = self._native.sibling("host", f"{self.name}.host")
            return self._host

    def _route(self, key: Any, stream: Any) -> tuple:
        """The native communicator for a call whose tensors live where
        ``key`` does, and the stream to run on."""
        if key is None:
            return self._native, stream_handle(stream)
        gpu = torch_gpu(key)
        if gpu is None and device_type(key) in HOST_MEMORY:
            if stream is not None:
                raise InvalidArgument("stream= is for GPU tensors; CPU arrays run on the host backend, which has none")
            return self._host_comm(), None
        if self._native.backend == "host":
            raise InvalidArgument(
                "a GPU tensor was given to a communicator on the host backend: create it with backend='cuda', "
                "'rocm' or 'auto'"
            )
        if stream is not None:
            return self._native, stream_handle(stream)
        return self._native, torch_current_stream(gpu) if gpu is not None else current_stream(key)

    def _per_call(self, key: Any, async_op: bool, hints: Hints, timeout: Timeout, stream: Stream) -> tuple:
        """The path every collective shares once it has checked its own
        arguments: the native communicator for tensors where ``key`` lives,
        and the native ``CallOpts`` of the call's per-call arguments (the
        stream resolved by :meth:`_route`), to pass as ``opts=``."""
        c, s = self._route(key, stream)
        return c, call_opts(async_op, hints, timeout, s)

    @staticmethod
    def _first(*candidates: Any) -> Any:
        for c in candidates:
            if isinstance(c, (list, tuple)):
                if c:
                    return c[0]
            elif c is not None:
                return c
        return None

    @staticmethod
    def _list(ts: Optional[Iterable[Any]]) -> list:
        return [prepare(t) for t in ts] if ts is not None else []

    # ------------------------------------------------------------ collectives

    def all_reduce(
        self,
        tensor: Any,
        op: Any = ReduceOp.SUM,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Reduce ``tensor`` across ranks, in place."""
        tensor, op = prepare(tensor), as_op(op)
        c, opts = self._per_call(tensor, async_op, hints, timeout, stream)
        return c.all_reduce(tensor, op.name, _factor(op), opts=opts)

    def all_reduce_into(
        self,
        output: Any,
        input: Any,
        op: Any = ReduceOp.SUM,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Out of place: ``output`` (as long as ``input``) receives the
        reduction of every rank's ``input``; ``input`` is only read."""
        output, input, op = prepare(output), prepare(input), as_op(op)
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        return c.all_reduce_into(output, input, op.name, _factor(op), opts=opts)

    def all_reduce_fused(
        self,
        input: Any,
        residual: Any,
        weight: Any = None,
        eps: float = 1e-6,
        *,
        pattern: Optional[str] = None,
        residual_out: Any = None,
        norm_out: Any = None,
        quant_out: Any = None,
        scale: Any = None,
        allreduce_out: Any = None,
        expanded_idx_to_permuted_idx: Any = None,
        expert_scales: Any = None,
        topk: Optional[int] = None,
        shared_expert_output: Any = None,
        sf_out: Any = None,
        sf_layout: str = "swizzled",
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """All-reduce (sum) of ``input`` (tokens x hidden, float16 or
        bfloat16) fused with its epilogue, in one kernel (FlashInfer's
        ``allreduce_fusion`` patterns):

        - ``residual_out = allreduce(input) + residual`` (``residual_out``
          defaults to ``residual``: updated in place);
        - with ``weight``: ``norm_out = rms_norm(residual_out) * weight``
          (``norm_out`` may not be ``input``, which the kernel still reads);
        - with ``quant_out`` and ``scale``: the normed rows quantized, FP8
          e4m3 (``scale`` one float32 given, or one per token written) or
          INT8 per token;
        - NVFP4 (``pattern="residual_rms_norm_nvfp4"``, FlashInfer's
          ``kARResidualRMSNormFP4Quant``; with ``norm_out`` its ``...Out...``
          twin): ``quant_out`` uint8 ``tokens x hidden/2`` (two e2m1 values
          a byte, the even element in the low nibble), ``scale`` one float32
          global scale (read on the device), ``sf_out`` uint8 or
          float8_e4m3fn scale factors, one per 16 elements of a row, in
          ``sf_layout`` ``"swizzled"`` (FlashInfer's ``SWIZZLED_128x4``:
          ``ceil(tokens/128)*128 * ceil(hidden/64)*4`` bytes, padding left
          untouched) or ``"linear"`` (``tokens x hidden/16``). ``hidden``
          must be a multiple of 16 (docs/protocol.md, "NVFP4 outputs").

        ``pattern`` (default from what is given): ``residual_add``,
        ``residual_rms_norm``, ``residual_rms_norm_fp8``,
        ``residual_rms_norm_fp8_per_token``,
        ``residual_rms_norm_int8_per_token``, ``residual_rms_norm_nvfp4``.
        ``allreduce_out`` also keeps
        the all-reduced, un-normed rows. Bitwise the same on every rank
        (docs/protocol.md, "Fused epilogues").

        **MoE finalize** (TensorRT-LLM's / FlashInfer's
        ``moe_finalize_allreduce_fusion``): given
        ``expanded_idx_to_permuted_idx`` and ``expert_scales``, ``input``
        is this rank's experts' output instead, ``permuted_rows x hidden``
        (the FC2 rows in expert order), and the number of tokens is
        ``residual``'s rows. What the rank contributes to the all-reduce is,
        per token ``t`` and element ``j``, in float32 and rounded to the
        dtype once::

            acc = shared_expert_output[t][j]          (or 0 without it)
            for k in range(topk):                     (in k order)
                p = expanded_idx_to_permuted_idx[t][k]
                if 0 <= p < permuted_rows:            (else the term is skipped)
                    acc = acc + expert_scales[t][k] * input[p][j]   (product rounded, no FMA)

        then the all-reduce and the epilogue above, every pattern and
        ``allreduce_out`` included (docs/protocol.md, "MoE finalize").

        - ``expanded_idx_to_permuted_idx``: int32, ``tokens x topk``
          (expanded index ``t * topk + k`` to a row of ``input``). The
          indices are read by the kernel, so they are not checked: one
          outside ``[0, permuted_rows)`` skips its term, and nothing out of
          range is read.
        - ``expert_scales``: the router's weights, ``tokens x topk``,
          float32 or ``input``'s dtype (TensorRT-LLM's
          ``expert_scale_factor``).
        - ``topk``: experts per token, 1 to 32; defaults to the index's
          second dimension (give it when the index is flat).
        - ``shared_expert_output``: optional, ``tokens x hidden`` of the
          input's dtype, added first.

        Both the index and the scales, or neither; ``topk`` and
        ``shared_expert_output`` only with them. No output may overlap any
        of the prologue's tensors (the kernel gathers expert rows while it
        writes), and ``allreduce_out`` may not be ``input``.

        The prologue is keywords of this method rather than a method of its
        own because it composes with every epilogue: a MoE layer's end is
        the same all-reduce + residual + RMSNorm (+ quantization) as a dense
        layer's, only its input is finalized first, as the Rust API has it
        (``Fusion::with_moe_finalize``). One method keeps one set of
        epilogue arguments and one place where a layer's fusion is chosen::

            # dense layer
            comm.all_reduce_fused(x, residual, w, eps, norm_out=normed)
            # MoE layer: x = the experts' FC2 rows, permuted_rows x hidden
            comm.all_reduce_fused(x, residual, w, eps, norm_out=normed,
                                  expanded_idx_to_permuted_idx=perm,
                                  expert_scales=router_weights,
                                  shared_expert_output=shared)
        """
        input, residual = prepare(input), prepare(residual)
        residual_out = residual if residual_out is None else prepare(residual_out)
        if pattern is None:
            pattern = "residual_add" if weight is None else "residual_rms_norm"
            if quant_out is not None:
                raise InvalidArgument("quant_out needs an explicit pattern (which quantization and which scale)")
        if weight is not None and norm_out is None and quant_out is None:
            raise InvalidArgument("all_reduce_fused: with weight, give norm_out (or quant_out) for the normed rows")
        shape = getattr(input, "shape", None)
        if not shape:
            raise InvalidArgument("all_reduce_fused: input must have a shape (tokens x hidden)")
        hidden = int(shape[-1])
        moe = (expanded_idx_to_permuted_idx, expert_scales, topk, shared_expert_output)
        if any(a is not None for a in moe):
            topk = _moe_topk(expanded_idx_to_permuted_idx, expert_scales, topk, shared_expert_output)
            # hidden comes from the experts' rows, the tokens from the
            # residual's: rows of another width would only miscount them.
            rshape = getattr(residual, "shape", None)
            if rshape is not None and len(rshape) >= 2 and int(rshape[-1]) != hidden:
                raise InvalidArgument(
                    f"all_reduce_fused: input (the experts' output) has rows of {hidden} but residual rows of "
                    f"{int(rshape[-1])}: both are rows of the model's hidden size"
                )
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        opt = lambda t: None if t is None else prepare(t)  # noqa: E731
        return c.all_reduce_fused(
            input, residual, residual_out, pattern, hidden, opt(weight), float(eps), opt(norm_out), opt(quant_out),
            opt(scale), opt(allreduce_out), opt(expanded_idx_to_permuted_idx), opt(expert_scales), topk,
            opt(shared_expert_output), opt(sf_out), sf_layout, opts=opts,
        )

    def reduce_scatter_fused(
        self,
        input: Any,
        residual: Any,
        weight: Any = None,
        eps: float = 1e-6,
        *,
        output: str = "gathered",
        pattern: Optional[str] = None,
        residual_out: Any = None,
        norm_out: Any = None,
        quant_out: Any = None,
        scale: Any = None,
        allreduce_out: Any = None,
        sf_out: Any = None,
        sf_layout: str = "swizzled",
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """The sequence-parallel form of :meth:`all_reduce_fused`, in one
        kernel: reduce-scatter (sum) of ``input`` (``tokens x hidden``
        partial sums on every rank, float16 or bfloat16, ``tokens`` a
        multiple of the world size; rank ``r`` owns rows ``[r*S, (r+1)*S)``,
        ``S = tokens / world``), then on each owned row the residual add
        with this rank's shard of the residual stream, RMSNorm and the
        quantization, exactly as ``all_reduce_fused`` computes them on the
        same rows (bitwise; docs/protocol.md, "Sequence-parallel form").

        - ``residual`` (``residual_out``, defaulting to ``residual``: in
          place) and ``allreduce_out``: this rank's shard, ``S x hidden``
          (the SP residual stream stays sharded).
        - ``output="gathered"``: ``norm_out``, ``quant_out``, the per-token
          ``scale`` and NVFP4's ``sf_out`` hold all ``tokens`` rows, the
          same on every rank (reduce-scatter + norm + all-gather);
          ``output="shard"``: they hold this rank's ``S`` rows and nothing
          is all-gathered.

        ``pattern``, ``weight``, ``eps``, ``quant_out``, ``scale``,
        ``sf_out`` and ``sf_layout`` are ``all_reduce_fused``'s. Residual
        add alone (no ``weight``) has nothing to gather: give
        ``output="shard"``. No MoE prologue; no output may overlap
        ``input``::

            # SP layer end: x partial sums (tokens x hidden), res this rank's rows
            comm.reduce_scatter_fused(x, res, w, eps, norm_out=normed)          # normed: tokens x hidden
            comm.reduce_scatter_fused(x, res, w, eps, output="shard", norm_out=mine)  # mine: S x hidden
        """
        input, residual = prepare(input), prepare(residual)
        residual_out = residual if residual_out is None else prepare(residual_out)
        if pattern is None:
            pattern = "residual_add" if weight is None else "residual_rms_norm"
            if quant_out is not None:
                raise InvalidArgument("quant_out needs an explicit pattern (which quantization and which scale)")
        if weight is not None and norm_out is None and quant_out is None:
            raise InvalidArgument(
                "reduce_scatter_fused: with weight, give norm_out (or quant_out) for the normed rows"
            )
        shape = getattr(input, "shape", None)
        if not shape:
            raise InvalidArgument("reduce_scatter_fused: input must have a shape (tokens x hidden)")
        hidden = int(shape[-1])
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        opt = lambda t: None if t is None else prepare(t)  # noqa: E731
        return c.reduce_scatter_fused(
            input, residual, residual_out, pattern, hidden, output, opt(weight), float(eps), opt(norm_out),
            opt(quant_out), opt(scale), opt(allreduce_out), opt(sf_out), sf_layout, opts=opts,
        )

    def broadcast(
        self,
        tensor: Any,
        root: int,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """``root``'s ``tensor`` into ``tensor`` on every rank."""
        tensor = prepare(tensor)
        c, opts = self._per_call(tensor, async_op, hints, timeout, stream)
        return c.broadcast(tensor, root, opts=opts)

    def reduce(
        self,
        tensor: Any,
        root: int,
        op: Any = ReduceOp.SUM,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Reduce every rank's ``tensor`` into ``tensor`` on ``root``."""
        tensor, op = prepare(tensor), as_op(op)
        c, opts = self._per_call(tensor, async_op, hints, timeout, stream)
        return c.reduce(tensor, root, op.name, _factor(op), opts=opts)

    def all_gather(
        self,
        tensor_list: Sequence[Any],
        tensor: Any,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Every rank's ``tensor`` into ``tensor_list[rank]``."""
        tensor, tensor_list = prepare(tensor), self._list(tensor_list)
        c, opts = self._per_call(tensor, async_op, hints, timeout, stream)
        return c.all_gather(tensor_list, tensor, opts=opts)

    def all_gather_single(
        self,
        output: Any,
        input: Any,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Every rank's ``input`` into ``output`` (``world`` times as long), in rank order."""
        output, input = prepare(output), prepare(input)
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        return c.all_gather_single(output, input, opts=opts)

    def reduce_scatter(
        self,
        output: Any,
        input_list: Sequence[Any],
        op: Any = ReduceOp.SUM,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Reduce ``input_list[r]`` of every rank into ``output`` on rank ``r``."""
        output, input_list, op = prepare(output), self._list(input_list), as_op(op)
        c, opts = self._per_call(output, async_op, hints, timeout, stream)
        return c.reduce_scatter(output, input_list, op.name, _factor(op), opts=opts)

    def reduce_scatter_single(
        self,
        output: Any,
        input: Any,
        op: Any = ReduceOp.SUM,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Reduce every rank's ``input`` (``world`` blocks) and leave block ``rank`` in ``output``."""
        output, input, op = prepare(output), prepare(input), as_op(op)
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        return c.reduce_scatter_single(output, input, op.name, _factor(op), opts=opts)

    def all_to_all(
        self,
        output_tensor_list: Sequence[Any],
        input_tensor_list: Sequence[Any],
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """``input_tensor_list[q]`` to rank ``q``; ``output_tensor_list[s]`` from rank ``s``."""
        outs, ins = self._list(output_tensor_list), self._list(input_tensor_list)
        c, opts = self._per_call(self._first(ins, outs), async_op, hints, timeout, stream)
        return c.all_to_all(outs, ins, opts=opts)

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Equal blocks: block ``q`` of ``input`` to rank ``q``, block ``s`` of ``output`` from rank ``s``."""
        output, input = prepare(output), prepare(input)
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        return c.all_to_all_single(output, input, opts=opts)

    def all_to_all_v_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Optional[Sequence[int]],
        input_split_sizes: Optional[Sequence[int]],
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """All-to-all with per-peer split sizes, counted in rows (slices
        along the first dimension) as torch counts them; None: equal splits."""
        output, input = prepare(output), prepare(input)
        outs = [int(x) for x in output_split_sizes] if output_split_sizes is not None else None
        ins = [int(x) for x in input_split_sizes] if input_split_sizes is not None else None
        c, opts = self._per_call(input, async_op, hints, timeout, stream)
        return c.all_to_all_v_single(output, input, outs, ins, opts=opts)

    def gather(
        self,
        output_tensor_list: Sequence[Any],
        input_tensor: Any,
        root: int,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Every rank's ``input_tensor`` into ``output_tensor_list[rank]`` on
        ``root`` (the list may be empty elsewhere)."""
        outs, inp = self._list(output_tensor_list), prepare(input_tensor)
        c, opts = self._per_call(inp, async_op, hints, timeout, stream)
        return c.gather(outs, inp, root, opts=opts)

    def scatter(
        self,
        output_tensor: Any,
        input_tensor_list: Sequence[Any],
        root: int,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """``input_tensor_list[rank]`` of ``root`` into ``output_tensor``
        (the list may be empty elsewhere)."""
        out, ins = prepare(output_tensor), self._list(input_tensor_list)
        c, opts = self._per_call(out, async_op, hints, timeout, stream)
        return c.scatter(out, ins, root, opts=opts)

    def send(
        self,
        tensor: Any,
        dst: int,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Send ``tensor`` to ``dst`` (matched, in order, by its :meth:`recv`)."""
        tensor = prepare(tensor)
        c, opts = self._per_call(tensor, async_op, hints, timeout, stream)
        return c.send(tensor, dst, opts=opts)

    def recv(
        self,
        tensor: Any,
        src: int,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Receive into ``tensor`` from ``src``."""
        tensor = prepare(tensor)
        c, opts = self._per_call(tensor, async_op, hints, timeout, stream)
        return c.recv(tensor, src, opts=opts)

    def batch_p2p(
        self,
        ops: Sequence[Any],
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Sends and receives as one group, which cannot deadlock on its
        own order (a ring, a pairwise swap). ``ops``: :class:`P2POp`s,
        ``torch.distributed.P2POp``s, or ``(op, tensor, peer)`` tuples."""
        norm = []
        for o in ops:
            if isinstance(o, (tuple, list)):
                o = P2POp(*o)
            elif not isinstance(o, P2POp):
                o = P2POp(o.op, o.tensor, o.peer)
            norm.append((o.op == "send", prepare(o.tensor), o.peer))
        c, opts = self._per_call(norm[0][1] if norm else None, async_op, hints, timeout, stream)
        return c.batch_p2p(norm, opts=opts)

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any], **kwargs: Any) -> list:
        """torch.distributed's spelling: a list with one :class:`Work` (empty
        when nothing was sent), to wait on like torch's."""
        work = self.batch_p2p(p2p_op_list, async_op=True, **kwargs)
        return [work] if work is not None else []

    def barrier(
        self,
        async_op: bool = False, hints: Hints = None, timeout: Timeout = None, stream: Stream = None,
    ) -> Optional[Work]:
        """Every rank waits for every other. Without ``async_op`` it blocks
        the calling thread (on GPUs too), as a barrier is expected to."""
        c, opts = self._per_call(None, async_op, hints, timeout, stream)
        return c.barrier(opts=opts)

    # ------------------------------------------------------------ life cycle

    def split(self, ranks: Sequence[int], name: Optional[str] = None) -> Optional["Communicator"]:
        """A communicator of ``ranks`` (ranks of this one, in the new
        order); None on a rank not in the list. Collective: every rank
        calls it, each with the list of the group it joins."""
        ranks = [int(r) for r in ranks]
        sub = self._native.split(ranks, name)
        host = None
        if self._host is not None and self._host is not self._native:
            host = self._host.split(ranks, None if name is None else f"{name}.host")
        return Communicator(sub, host) if sub is not None else None

    def abort(self) -> None:
        """Make the communicator unusable now: queued work exits without
        waiting for peers; later calls raise :class:`Aborted`."""
        self._native.abort()
        if self._host is not None and self._host is not self._native:
            self._host.abort()

    def finalize(self) -> None:
        """Drain queued work and release the workspace; later calls raise
        :class:`Finalized`. Buffers that :mod:`ferrocomm.ops` cached for
        this communicator are freed first (collective, as finalize is)."""
        from . import ops  # here: ops imports this module

        ops.release(self)
        for b in list(self._ep_buffers):
            b._let_go()
        if self._host is not None and self._host is not self._native:
            self._host.finalize()
        self._native.finalize()

    def register(self, tensor: Any) -> Any:
        """Register ``tensor`` with every peer (collective); returns a
        registration with ``peer_tensor(rank)`` and ``deregister()``."""
        tensor = prepare(tensor)
        c, _ = self._route(tensor, None)
        return c.register(tensor)

    # ------------------------------------------------------------ symmetric heap, windows

    def heap_tensor(self, shape: Any, dtype: Any) -> HeapTensor:
        """A zeroed tensor in the symmetric heap, at the same offset on every
        rank (``.offset``), exporting DLPack: ``numpy.from_dlpack(t)`` on the
        host backend, ``torch.from_dlpack(t)`` on GPUs, both in place.
        ``dtype``: a name (``"float32"``, ``"bfloat16"``), a NumPy dtype or a
        torch dtype. NumPy has no bfloat16 or float8: ``t.bits()`` exports
        the same memory as unsigned integers of the element's width
        (``numpy.from_dlpack(t.bits())`` is uint16 or uint8).

        Collective: every rank allocates the same shapes and dtypes in the
        same order. ``t.free()`` gives the memory back; every rank frees its
        heap tensors and windows in the same order too (later offsets depend
        on it; a rank out of order gets :class:`Mismatch` at its next
        allocation). ``free`` is refused while NumPy arrays or torch tensors
        made from it, a window it is registered in, or queued work hold it.
        A heap tensor never freed stays allocated until :meth:`finalize`,
        which releases the whole heap (and is refused while DLPack views of
        it are held: they would outlive it). The heap's size per rank is
        ``FERROCOMM_HEAP_BYTES`` (host default 64 MiB, GPUs 1 GiB)."""
        if isinstance(shape, int):
            shape = (shape,)
        return self._native.heap_tensor([int(d) for d in shape], _dtype_name(dtype))

    def new_window(self) -> Window:
        """A one-sided window (torchcomms' ``new_window``; collective, its
        signal words come from the heap). ``win.tensor_register(t)``
        (collective) makes ``t`` its buffer: a :meth:`heap_tensor` on every
        rank costs nothing; other GPU tensors are registered with every peer.
        Then ``win.put(src, dst_rank, target_offset)`` (elements),
        ``win.signal(dst_rank)``, ``win.wait_signal(peer_rank)`` (each with
        ``async_op``, ``timeout``, ``stream``), ``win.map_remote_tensor(rank)``
        (a peer's buffer as mapped here, exporting DLPack),
        ``win.tensor_deregister()`` and ``win.free()`` (in the same order as
        heap tensors' frees on every rank)."""
        return Window(self._native.new_window(), self)

    def ep_buffer(
        self,
        *,
        num_experts: int,
        hidden: int,
        max_tokens_per_rank: int,
        topk: int,
        dtype: Any = "bfloat16",
    ) -> EpBuffer:
        """Expert-parallel dispatch and combine (MoE, inside one node;
        ``ferrocomm::ep``): an :class:`EpBuffer` on the symmetric heap.

        ``num_experts`` over all ranks (a multiple of the world size: expert
        ``e`` lives on rank ``e // (num_experts // size)``), ``hidden``
        channels per token, at most ``max_tokens_per_rank`` tokens per
        dispatch (below ``2**20``), ``topk`` experts per token; ``dtype`` of the dispatched
        rows: bfloat16 or float8_e4m3fn (hidden a multiple of 128, one
        float32 scale per 128 channels), as a name, a torch dtype or
        ``"fp8"``. Combine is bfloat16 either way.

        Collective, as a :meth:`heap_tensor` (every rank the same arguments
        and the same order of heap allocations and frees). It takes
        ``buf.layout["total"]`` bytes of the heap (``FERROCOMM_HEAP_BYTES``):
        about ``size * max_tokens_per_rank * (4 * hidden + 8 * topk)``, or
        ``3 * hidden`` per row with float8 rows. Bad arguments raise
        :class:`InvalidArgument` on every rank."""
        native = self._native.ep_buffer(
            operator.index(num_experts),
            operator.index(hidden),
            operator.index(max_tokens_per_rank),
            operator.index(topk),
            _dtype_name(dtype),
        )
        buf = EpBuffer(native, self)
        self._ep_buffers.add(buf)
        return buf

    def broadcaster(self, max_bytes: int, *, writer: int = 0, slots: Optional[int] = None) -> Broadcaster:
        """A metadata broadcaster (:class:`Broadcaster`): ``writer`` sends
        bytes with ``.send(data)``, every other rank gets them in order with
        ``.recv()``. Readers on the writer's node read a lock-free ring in
        shared memory of ``slots`` slots (default 8) of ``max_bytes``;
        larger messages, and readers on other nodes, take a socket.

        Collective: every rank the same arguments, in the same order
        relative to the communicator's other setup calls. Host memory only,
        whatever the backend; it outlives :meth:`finalize`."""
        return Broadcaster(
            self._native.broadcaster(
                operator.index(max_bytes),
                operator.index(writer),
                None if slots is None else operator.index(slots),
            )
        )

    def device_ctx_bytes(self) -> bytes:
        """The device API's context (``FcDevCtx``, 104 bytes, docs/device-api.md)
        to pass by value to kernels of your own; after the first heap_tensor
        or new_window."""
        return self._native.device_ctx_bytes()

    def prepare(self) -> None:
        """Compile and load every kernel later calls may need: call it before
        capturing a CUDA graph, so the capture never waits for a compiler."""
        self._native.prepare()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.finalize()
        except Exception:
            if exc[0] is None:
                raise
