"""vLLM-style drop-ins on ferrocomm.

:class:`CustomAllreduce` has the method names and semantics of vLLM's
``vllm.distributed.device_communicators.custom_all_reduce.CustomAllreduce``
(SGLang's has the same): ``should_custom_ar(inp)``, ``custom_all_reduce(inp)``
returning the reduced tensor out of place (None when the input is not one
it takes), ``all_reduce(inp, out=None)``, a ``capture()`` context for CUDA
graph capture, and ``close()``.

What differs underneath: there is no IPC buffer to register after a graph
capture (ferrocomm's protocols keep their state in a workspace every rank
mapped at creation, so captured calls stay valid across replays), any world
of 2 to 8 GPUs works, and the results are bitwise identical on every rank.

    from ferrocomm.vllm import CustomAllreduce
    ca = CustomAllreduce(group=cpu_group, device=torch.cuda.current_device())
    out = ca.custom_all_reduce(x)            # None: fall back to NCCL
    with ca.capture(), torch.cuda.graph(g):
        y = ca.custom_all_reduce(x)
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Tuple

from ._comm import Communicator
from ._errors import FerrocommError, Unsupported

__all__ = ["CustomAllreduce"]

logger = logging.getLogger(__name__)

class CustomAllreduce:
    """vLLM's custom all-reduce, served by ferrocomm.

    ``group``: the torch.distributed group to reduce over (vLLM passes its
    CPU/Gloo group; any group works: only its store and ranks are used).
    ``device``: the GPU (index, ``"cuda:N"`` or ``torch.device``; default
    torch's current device). ``max_size``: the largest input in bytes that
    :meth:`should_custom_ar` accepts (vLLM's 8 MiB by default; ferrocomm has
    no such limit, so larger values are fine). ``comm``: an existing
    ferrocomm communicator to use instead of creating one from ``group``.

    When ferrocomm cannot serve (no GPU backend, a world of one), the object
    is ``disabled`` and :meth:`custom_all_reduce` returns None, as vLLM's does.
    """

    _SUPPORTED_WORLD_SIZES = list(range(2, 9))

    def __init__(
        self,
        group: Any = None,
        device: Any = None,
        max_size: int = 8192 * 1024,
        comm: Optional[Communicator] = None,
        **_ignored: Any,
    ) -> None:
        import torch

        self._IS_CAPTURING = False
        self.disabled = True
        self._owns_comm = comm is None
        self.max_size = int(max_size)
        self.comm: Optional[Communicator] = None
        try:
            if comm is None:
                from ._bootstrap import from_torch

                comm = from_torch(group, backend="auto", device=device)
        except FerrocommError as e:
            logger.warning("ferrocomm custom all-reduce is disabled: %s", e)
            return
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.size
        self.fully_connected = True
        self.device = torch.device("cuda", comm.device)
        if comm.backend == "host":
            logger.warning("ferrocomm custom all-reduce is disabled: no GPU backend (host only)")
            return
        if self.world_size not in self._SUPPORTED_WORLD_SIZES:
            logger.info("ferrocomm custom all-reduce is disabled for a world of %d", self.world_size)
            return
        # Compile every kernel now: a graph capture must never wait for NVRTC.
        comm.prepare()
        self.disabled = False

    # vLLM calls this collectively before the first all-reduce; nothing is
    # pending here (the peers were mapped when the communicator was made).
    def finalize_p2p(self) -> None:
        return None

    def should_custom_ar(self, inp: Any) -> bool:
        """Whether :meth:`custom_all_reduce` takes ``inp``: a contiguous
        f32/f16/bf16 tensor on this device under ``max_size`` bytes."""
        if self.disabled:
            return False
        import torch

        if not isinstance(inp, torch.Tensor) or inp.device != self.device:
            return False
        if inp.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        if not inp.is_contiguous():
            return False
        return inp.numel() * inp.element_size() < self.max_size

    def all_reduce(self, inp: Any, *, out: Any = None, registered: bool = False) -> Any:
        """Out-of-place sum of ``inp`` over the group into ``out`` (a new
        tensor when None), queued on torch's current stream. ``registered``
        is accepted for vLLM's signature and changes nothing."""
        import torch

        if out is None:
            out = torch.empty_like(inp)
        self.comm.all_reduce_into(out, inp)
        return out

    def custom_all_reduce(self, input: Any) -> Optional[Any]:
        """The reduced tensor (out of place), or None when this input is not
        one to take (vLLM then falls back to NCCL). Works eagerly and inside
        :meth:`capture` under ``torch.cuda.graph``."""
        if self.disabled or not self.should_custom_ar(input):
            return None
        return self.all_reduce(input)

    @contextmanager
    def capture(self) -> Iterator[None]:
        """The context vLLM captures its CUDA graphs in. Captured calls need
        no registration afterwards: replays reuse the communicator's
        workspace, which every rank mapped at creation."""
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False

    def fused_all_reduce_rms_norm(
        self, input: Any, residual: Any, weight: Any, eps: float, *, norm_out: Any = None
    ) -> Tuple[Any, Any]:
        """All-reduce + residual add + RMSNorm in one kernel, as vLLM's
        ``tensor_model_parallel_all_reduce`` followed by
        ``fused_add_rms_norm`` computes them: ``residual`` becomes
        ``allreduce(input) + residual`` (in place), and the normed rows
        ``rms_norm(residual) * weight`` come back (in ``norm_out``, a new
        tensor when None). ``input``: tokens x hidden, float16/bfloat16 on
        this device. Works eagerly and inside :meth:`capture`."""
        import torch

        if self.disabled or self.comm is None:
            raise Unsupported("ferrocomm custom all-reduce is disabled on this group")
        if norm_out is None:
            norm_out = torch.empty_like(input)
        self.comm.all_reduce_fused(input, residual, weight, eps, norm_out=norm_out)
        return norm_out, residual

    def close(self) -> None:
        """Release the communicator (when this object created it)."""
        comm, self.comm = self.comm, None
        self.disabled = True
        if comm is not None and self._owns_comm:
            try:
                comm.finalize()
            except FerrocommError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
