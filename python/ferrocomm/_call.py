"""The per-call arguments every collective, window operation and EP call
takes: ``async_op``, ``hints``, ``timeout`` and ``stream`` (torchcomms'
names), turned here, in one place, into the native ``CallOpts`` that the
native call takes as ``opts=`` (checked once there: ``python/src/args.rs``).

The caller resolves ``stream`` first (a raw handle: ``stream=``, else the
current stream of the tensors' framework; ``_comm.Communicator._route``,
``_tensors.call_stream``), since where a call runs depends on its tensors.
"""

from __future__ import annotations

import datetime
from numbers import Real
from typing import Any, Mapping, Optional

from . import _ferrocomm as _native
from ._errors import InvalidArgument

__all__ = ["Timeout", "Hints", "Stream", "seconds", "call_opts"]

Timeout = Optional[Any]  # seconds (int/float) or datetime.timedelta
Hints = Optional[Mapping[str, Any]]  # string pairs: {"algo": "oneshot-ll"}
Stream = Any  # None, an int CUstream / hipStream_t, or an object with .cuda_stream or .ptr


def seconds(timeout: Timeout) -> Optional[float]:
    """A timeout in seconds from a number or a ``datetime.timedelta``."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, Real) and not isinstance(timeout, bool):
        return float(timeout)
    raise InvalidArgument(f"timeout {timeout!r}: expected seconds or a datetime.timedelta")


# The native options of calls with no hints and no timeout, by (async_op,
# stream): the eager path's common case, reused (CallOpts is immutable).
_PLAIN: dict = {}


def call_opts(async_op: bool, hints: Hints, timeout: Timeout, stream: Optional[int]) -> Any:
    """The native ``CallOpts`` of one call; ``stream`` already a raw handle
    (or None: the communicator's own stream)."""
    if not hints and timeout is None:
        key = (bool(async_op), stream)
        opts = _PLAIN.get(key)
        if opts is None:
            if len(_PLAIN) >= 256:
                _PLAIN.clear()
            opts = _PLAIN[key] = _native.CallOpts(async_op=key[0], stream=stream)
        return opts
    return _native.CallOpts(
        async_op=async_op,
        timeout=seconds(timeout),
        hints={str(k): str(v) for k, v in hints.items()} if hints else None,
        stream=stream,
    )
