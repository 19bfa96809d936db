"""Creating communicators: from the launcher's environment (torchrun and
friends), from an existing torch.distributed group, or from any store.
ferrocomm never needs a launcher of its own."""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Optional

from . import _ferrocomm as _native
from ._call import Timeout, seconds
from ._comm import Communicator
from ._errors import InvalidArgument

__all__ = ["init", "from_torch", "from_store"]

_BACKENDS = ("auto", "host", "cpu", "cuda", "rocm", "hip")


def _at_exit() -> None:
    """At exit: leave the store of every ``init()`` rendezvous. Rank 0 hosts
    it, and waits here (at most the communicator's timeout; Ctrl-C ends
    it) until the other ranks have finalized their communicators or
    exited, so that none finds the store closed in its last request. Then
    let the background kernel compiles that are running finish: one still
    inside the compiler when C's exit handlers run crashes the process."""
    try:
        late = _native.leave_stores()
    except KeyboardInterrupt:
        late = []
    for line in late:
        print(f"ferrocomm: closing the store at exit: {line}", file=sys.stderr)
    _native.pause_compiles()


atexit.register(_at_exit)


def _check_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise InvalidArgument(f"backend {backend!r}: expected one of 'auto', 'host', 'cuda', 'rocm'")
    return backend


def _device_index(device: Any) -> Optional[int]:
    """A device index from an int, ``"cuda:1"``, a ``torch.device``; None
    when the caller left it to the default."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise InvalidArgument("device must be an index, 'cuda:N' or a torch.device")
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is not None:
        return int(index)
    if isinstance(device, str):
        tail = device.rsplit(":", 1)[-1]
        if tail.isdigit():
            return int(tail)
        if device in ("cuda", "hip", "rocm", "cpu", "host"):
            return None
    raise InvalidArgument(f"device {device!r}: expected an index, 'cuda:N' or a torch.device")


def _default_device(backend: str) -> Optional[int]:
    """torch's current device when torch is imported and has initialised
    CUDA (the tensors live there); else None: LOCAL_RANK."""
    torch = sys.modules.get("torch")
    if torch is None or backend in ("host", "cpu"):
        return None
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        return None
    return None


def init(
    backend: str = "auto",
    device: Any = None,
    name: Optional[str] = None,
    timeout: Timeout = None,
) -> Communicator:
    """A communicator of every rank of the job, from the launcher's
    environment: ``torchrun``, or ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE`` (``LOCAL_RANK``) with the job's secret in
    ``FERROCOMM_TOKEN`` (or a 0600 file named by ``FERROCOMM_TOKEN_FILE``).

    ``backend``: ``"auto"`` (CUDA, else ROCm, else the host), ``"host"``,
    ``"cuda"``, ``"rocm"``; every rank must end up on the same one.
    ``device``: the GPU, default torch's current device when torch has
    initialised CUDA, else ``LOCAL_RANK``. ``timeout``: every wait's bound
    (seconds or a timedelta; default ``FERROCOMM_TIMEOUT_SECONDS`` or 600 s).
    """
    backend = _check_backend(backend)
    index = _device_index(device)
    if index is None:
        index = _default_device(backend)
    native = _native.Comm.from_env(backend, index, name, seconds(timeout))
    return Communicator(native)


def from_store(
    store: Any,
    rank: int,
    world_size: int,
    backend: str = "auto",
    device: Any = None,
    name: Optional[str] = None,
    timeout: Timeout = None,
) -> Communicator:
    """A communicator over an existing key-value store: a
    ``torch.distributed.Store`` (TCPStore, FileStore, PrefixStore, ...) or
    any object with its methods (``set``, ``get``, ``add``, ``check``,
    ``delete_key``, ``wait``). Collective: ranks ``0..world_size`` call it
    with the same store. Keys go under ``fc/`` and ``fcpy/``; give each
    group its own prefix (``torch.distributed.PrefixStore``) when several
    groups share a store.
    """
    backend = _check_backend(backend)
    index = _device_index(device)
    if index is None:
        index = _default_device(backend)
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", rank))
    native = _native.Comm.from_store(store, int(rank), int(world_size), backend, index, name, seconds(timeout))
    return Communicator(native)


def from_torch(
    group: Any = None,
    backend: str = "auto",
    device: Any = None,
    name: Optional[str] = None,
    timeout: Timeout = None,
) -> Communicator:
    """A communicator of a torch.distributed process group's ranks (the
    default group when None), beside whatever backend (NCCL, Gloo) that
    group has: it rendezvouses through the group's store, so an engine
    that already called ``init_process_group`` needs nothing else.
    Collective over the group's ranks; ranks outside ``group`` must not
    call it.
    """
    import torch.distributed as dist  # the caller has torch: it passed us a group

    if not dist.is_initialized():
        raise InvalidArgument("torch.distributed is not initialised: call init_process_group first, or use init()")
    c10d = dist.distributed_c10d
    pg = group if group is not None else c10d._get_default_group()
    rank = dist.get_rank(pg)
    if rank < 0:
        raise InvalidArgument("this rank is not a member of the group")
    world = dist.get_world_size(pg)
    base = c10d._get_default_store()
    # One prefix per group: ranks are numbered per group, and two groups'
    # communicators must never meet on the same keys.
    tag = getattr(pg, "group_name", None) or "-".join(str(r) for r in dist.get_process_group_ranks(pg))
    store = dist.PrefixStore(f"ferrocomm/{tag}/", base)
    if device is None and backend not in ("host", "cpu"):
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.current_device()
    return from_store(store, rank, world, backend=backend, device=device, name=name, timeout=timeout)
