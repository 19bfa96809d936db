"""Exceptions. Every failure ferrocomm reports is a :class:`FerrocommError`
carrying the Rust error's text (``str(e)``) and its ``kind``; subclasses also
derive from the matching built-in where there is one, so ``except
ValueError`` or ``except TimeoutError`` catches what it should.

Raised by the native module (``_ferrocomm``), which picks the class by the
Rust ``ferrocomm::Error`` variant.
"""

from __future__ import annotations

__all__ = [
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


class FerrocommError(RuntimeError):
    """Base class. ``kind`` names the Rust error variant."""

    kind = "error"


class InvalidArgument(FerrocommError, ValueError):
    """Bad input (a tensor, a rank, a dtype, an option). Nothing was changed
    or queued."""

    kind = "invalid_argument"


class NotCompiled(FerrocommError):
    """The backend asked for is not in this build."""

    kind = "not_compiled"


class LibraryMissing(FerrocommError):
    """A vendor library (libcuda, NVRTC, libamdhip64, NCCL) could not be
    loaded. ``library`` names it."""

    kind = "library_missing"
    library: str | None = None


class NoDevice(FerrocommError):
    """The backend's library loaded, but there is no such device."""

    kind = "no_device"


class BackendError(FerrocommError):
    """A call into the vendor library failed."""

    kind = "backend"


class CompileError(FerrocommError):
    """A kernel failed to compile at run time."""

    kind = "compile"


class CommTimeout(FerrocommError, TimeoutError):
    """A wait ran past its deadline. ``missing`` lists the ranks that never
    arrived, when known; ``after`` is the deadline in seconds."""

    kind = "timeout"
    missing: list[int] | None = None
    after: float | None = None


class Mismatch(FerrocommError):
    """Ranks issued different collectives (count, dtype, op, root, splits).
    ``peer`` is a rank that disagreed with ``rank``."""

    kind = "mismatch"
    rank: int | None = None
    peer: int | None = None


class Aborted(FerrocommError):
    """The communicator was aborted (by ``abort()``, or after an earlier
    fatal error) and refuses further work."""

    kind = "aborted"


class Finalized(FerrocommError):
    """The communicator was finalized; create a new one."""

    kind = "finalized"


class StoreError(FerrocommError):
    """The bootstrap store failed (connection, authentication, limits)."""

    kind = "store"


class FerrocommOSError(FerrocommError, OSError):
    """An operating-system call failed."""

    kind = "io"


class Unsupported(FerrocommError, NotImplementedError):
    """The API has the operation, this backend or build has no path for it."""

    kind = "unsupported"


class InternalError(FerrocommError):
    """A bug in ferrocomm (a Rust panic, caught at the boundary)."""

    kind = "internal"
