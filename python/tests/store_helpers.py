"""A torch.distributed-like store (set/get/add/check/delete_key/wait) served
by a multiprocessing manager: the Python-store path of ferrocomm (the one
from_torch takes) tested without torch."""

from __future__ import annotations

import datetime
import threading
import time
from multiprocessing.managers import BaseManager


class _KV:
    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._d[key] = bytes(value)

    def get(self, key: str):
        with self._lock:
            return self._d.get(key)

    def add(self, key: str, delta: int) -> int:
        with self._lock:
            v = int(self._d.get(key, b"0")) + int(delta)
            self._d[key] = str(v).encode()
            return v

    def check(self, keys: list) -> bool:
        with self._lock:
            return all(k in self._d for k in keys)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._d.pop(key, None) is not None


_THE_KV = _KV()


def _kv() -> _KV:
    return _THE_KV


class _Manager(BaseManager):
    pass


_Manager.register("kv", callable=_kv)


def serve(authkey: bytes) -> tuple[str, threading.Thread]:
    """Serve the store from a thread of this process; returns its address."""
    mgr = _Manager(address=("127.0.0.1", 0), authkey=authkey)
    server = mgr.get_server()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    host, port = server.address
    return f"{host}:{port}", t


class ManagerStore:
    """The client side, with torch.distributed.Store's method names."""

    def __init__(self, kv) -> None:
        self._kv = kv

    @classmethod
    def connect(cls, address: str, authkey: str) -> "ManagerStore":
        host, port = address.rsplit(":", 1)
        mgr = _Manager(address=(host, int(port)), authkey=authkey.encode())
        mgr.connect()
        return cls(mgr.kv())

    def set(self, key: str, value) -> None:
        self._kv.set(key, value if isinstance(value, bytes) else str(value).encode())

    def get(self, key: str) -> bytes:
        self.wait([key], datetime.timedelta(seconds=300))
        return self._kv.get(key)

    def add(self, key: str, delta: int) -> int:
        return self._kv.add(key, delta)

    def check(self, keys: list) -> bool:
        return self._kv.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self._kv.delete(key)

    def wait(self, keys: list, timeout: datetime.timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self._kv.check(list(keys)):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Wait timeout for keys {keys}")
            time.sleep(0.002)
