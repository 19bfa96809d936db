"""The metadata broadcaster: one writer rank sends bytes to every other
rank, in order, the way engines broadcast per-step metadata from their
driver rank (vLLM's ``MessageQueue``). Readers on the writer's node take
messages from a lock-free ring in shared memory; messages larger than a
slot, and every message to readers on other nodes, go through a socket.
Pickling is the caller's::

    bc = comm.broadcaster(1 << 20)          # collective; rank 0 writes
    if bc.is_writer:
        bc.send(pickle.dumps(step_metadata))
    else:
        step_metadata = pickle.loads(bc.recv())

A writer blocked by readers that fall behind (every slot still unread by
someone) raises :class:`CommTimeout` naming them (``.missing``) after
``timeout`` (default: the communicator's), having sent nothing, so a retry
may succeed; a reader that closed or died raises at once, naming it. A
reader whose writer closed or died gets every message sent before, then an
error naming it. A receive that runs out of time may be retried. Ctrl-C
ends any wait.
"""

from __future__ import annotations

from typing import Any

from . import _ferrocomm as _native
from ._call import Timeout, seconds

__all__ = ["Broadcaster"]


class Broadcaster:
    """One rank's end of a broadcaster (:meth:`Communicator.broadcaster`)."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def send(self, data: Any, timeout: Timeout = None) -> None:
        """Send ``data`` (bytes, bytearray, or any contiguous bytes-like
        object, copied) to every reader; writer only. Returns once the ring
        holds it and the socket readers' kernels have taken it."""
        if not isinstance(data, (bytes, bytearray)):
            data = memoryview(data).tobytes()
        self._native.send(data, seconds(timeout))

    def recv(self, timeout: Timeout = None) -> bytes:
        """The next message; readers only."""
        return self._native.recv(seconds(timeout))

    def close(self) -> None:
        """Close this rank's end (also done when the object is collected)."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def size(self) -> int:
        return self._native.size

    @property
    def writer(self) -> int:
        """The rank that sends."""
        return self._native.writer

    @property
    def is_writer(self) -> bool:
        return self._native.is_writer

    @property
    def max_bytes(self) -> int:
        """Bytes of a ring slot (larger messages take the socket)."""
        return self._native.max_bytes

    @property
    def slots(self) -> int:
        return self._native.slots

    @property
    def messages(self) -> int:
        """Messages sent (writer) or received (reader) so far."""
        return self._native.messages

    @property
    def uses_ring(self) -> bool:
        """Whether this rank uses the shared-memory ring."""
        return self._native.uses_ring

    def __enter__(self) -> "Broadcaster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._native)
