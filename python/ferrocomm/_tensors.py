"""What ferrocomm needs to know about a framework's tensor before the native
module takes it through DLPack: which memory it is in (CPU arrays go to the
host backend, GPU tensors to the GPU one), which stream the collective runs
on, and framework quirks DLPack does not cover.

Frameworks are looked up in ``sys.modules`` only: ferrocomm never imports
torch or CuPy itself, so it costs nothing where they are absent.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from ._errors import InvalidArgument

# DLPack device types (dlpack.h).
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_ROCM = 10
KDL_ROCM_HOST = 11
KDL_CUDA_MANAGED = 13

HOST_MEMORY = (KDL_CPU, KDL_CUDA_HOST, KDL_ROCM_HOST)
GPU_MEMORY = (KDL_CUDA, KDL_ROCM, KDL_CUDA_MANAGED)


def device_type(t: Any) -> int:
    """The DLPack device type of a tensor or array."""
    dev = getattr(t, "__dlpack_device__", None)
    if dev is not None:
        return int(dev()[0])
    if hasattr(t, "__array_interface__"):
        return KDL_CPU
    raise InvalidArgument(
        f"expected a tensor or array with __dlpack__ (torch, CuPy, JAX, NumPy) or __array_interface__, "
        f"got {type(t).__name__}"
    )


def _torch() -> Any:
    return sys.modules.get("torch")


def is_torch(t: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def prepare(t: Any) -> Any:
    """The tensor as DLPack can carry it, sharing its memory.

    torch refuses to export tensors that require grad (``detach()`` shares
    the storage); complex tensors travel as pairs of reals (sums stay
    exact per component); torch versions differ in exporting float8 through
    DLPack, and collectives only move those bits, so they go as bytes.
    """
    torch = _torch()
    if torch is None or not isinstance(t, torch.Tensor):
        return t
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _torch_plain_dtypes(torch):
        return t
    if t.is_complex():
        t = torch.view_as_real(t)
    elif t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool):
        t = t.view(torch.uint8)
    return t


_PLAIN_DTYPES: Optional[frozenset] = None


def _torch_plain_dtypes(torch: Any) -> frozenset:
    """torch's dtypes that DLPack carries as they are (the eager path's
    common case, answered by one set lookup)."""
    global _PLAIN_DTYPES
    if _PLAIN_DTYPES is None:
        _PLAIN_DTYPES = frozenset(
            (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8)
        )
    return _PLAIN_DTYPES


def torch_gpu(t: Any) -> Optional[int]:
    """The GPU a torch tensor is on, or None (not torch, or not on a GPU):
    torch's C-implemented attributes, cheaper than ``__dlpack_device__``,
    which torch writes in Python."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor) and t.is_cuda:
        return t.get_device()
    return None


def stream_handle(stream: Any) -> Optional[int]:
    """A raw stream handle from an int, a torch/CuPy stream object, or None."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise InvalidArgument("stream must be an int handle or a stream object, not a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise InvalidArgument(f"stream handle {stream} is negative")
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise InvalidArgument(
        f"stream {stream!r}: expected an int (CUstream / hipStream_t) or an object with .cuda_stream "
        "(torch) or .ptr (CuPy)"
    )


def current_stream(t: Any) -> Optional[int]:
    """The framework's current stream on the tensor's device, for torch
    (``torch.cuda.current_stream().cuda_stream``) and CuPy; None otherwise
    (the collective then runs on the communicator's stream and the call
    waits for it)."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        if t.device.type != "cuda":
            return None
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _torch_current_stream(torch, index)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return int(cupy.cuda.get_current_stream().ptr)
    return None


def current_device_stream(device: int) -> Optional[int]:
    """torch's current stream on GPU ``device`` when torch is loaded (where
    a window's signal and wait run by default, as its puts of torch
    tensors do); None otherwise (the communicator's own stream)."""
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return None
    return _torch_current_stream(torch, device)


_CURRENT_RAW_STREAM: Any = None


def _torch_current_stream(torch: Any, device: int) -> int:
    """torch's current stream on GPU ``device``, as a raw handle (torch's
    own raw-stream call where it has one, looked up once)."""
    global _CURRENT_RAW_STREAM
    if _CURRENT_RAW_STREAM is None:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _CURRENT_RAW_STREAM = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return int(_CURRENT_RAW_STREAM(device))


def torch_current_stream(device: int) -> int:
    """torch's current stream on GPU ``device`` (torch is loaded: a torch
    tensor is there), as a raw handle."""
    return _torch_current_stream(_torch(), device)


def call_stream(comm: Any, stream: Any, tensor: Any, what: str) -> Optional[int]:
    """The stream a call of a window or an EP buffer (``what``, for the
    error) of ``comm`` runs on: none on the host backend, which refuses
    ``stream=``; else ``stream``, else the current stream of ``tensor``'s
    framework, else (no tensor: a window's signal and wait) torch's
    current stream on the communicator's device."""
    if comm.backend == "host":
        if stream is not None:
            raise InvalidArgument(f"stream= is for GPU {what}; the host backend has none")
        return None
    if stream is not None:
        return stream_handle(stream)
    if tensor is not None:
        return current_stream(tensor)
    return current_device_stream(comm.device)
