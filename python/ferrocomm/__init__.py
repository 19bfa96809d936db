"""ferrocomm: fast GPU collectives (CUDA and ROCm, NCCL/RCCL underneath)
for PyTorch, vLLM and SGLang users, on tensors from any framework through
DLPack, with a CPU host backend that runs anywhere.

    import ferrocomm
    comm = ferrocomm.init()                 # under torchrun; or ferrocomm.from_torch()
    comm.all_reduce(tensor)                 # in place, on torch's current stream
    work = comm.all_gather_single(out, inp, async_op=True)
    work.wait()

Every error is a :class:`FerrocommError` (``InvalidArgument`` is also a
``ValueError``, ``CommTimeout`` a ``TimeoutError``); no call hangs past its
timeout, and Ctrl-C interrupts any wait.
"""

from __future__ import annotations

from ._ferrocomm import BACKENDS, LIBRARIES, __version__  # noqa: F401  (native module first)
from ._errors import (
    Aborted,
    BackendError,
    CommTimeout,
    CompileError,
    FerrocommError,
    FerrocommOSError,
    Finalized,
    InternalError,
    InvalidArgument,
    LibraryMissing,
    Mismatch,
    NoDevice,
    NotCompiled,
    StoreError,
    Unsupported,
)
from ._ops import ReduceOp
from ._broadcaster import Broadcaster
from ._comm import Communicator, HeapTensor, HeapTensorBits, P2POp, RemoteTensor, Window, Work
from ._ep import DispatchOut, EpBuffer, EpTensor
from ._bootstrap import from_store, from_torch, init
from . import ops  # noqa: E402  (the overlap operations; torch is imported only when they run)

__all__ = [
    "__version__",
    "BACKENDS",
    "LIBRARIES",
    "init",
    "from_torch",
    "from_store",
    "Communicator",
    "Work",
    "P2POp",
    "HeapTensor",
    "HeapTensorBits",
    "Window",
    "RemoteTensor",
    "EpBuffer",
    "DispatchOut",
    "EpTensor",
    "Broadcaster",
    "ReduceOp",
    "ops",
    "FerrocommError",
    "InvalidArgument",
    "NotCompiled",
    "LibraryMissing",
    "NoDevice",
    "BackendError",
    "CompileError",
    "CommTimeout",
    "Mismatch",
    "Aborted",
    "Finalized",
    "StoreError",
    "FerrocommOSError",
    "Unsupported",
    "InternalError",
]
