"""The broadcaster's rank scenarios (test_broadcaster.py launches them
through _worker.py, which finds them in scenarios.py)."""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import time

import ferrocomm


def _comm(timeout: float) -> ferrocomm.Communicator:
    return ferrocomm.init(backend="host", timeout=timeout)


def _message(m: int, n: int) -> bytes:
    """Message `m` of `n` bytes: every byte depends on both."""
    return bytes((i * 131 ^ m * 7919) & 0xFF for i in range(n)) if n < 4096 else (bytes([m & 0xFF]) * n)


def broadcaster_messages(writer: str = "0") -> None:
    """Every size through the ring and the socket (slots of 4 KiB, 4 of
    them, so the ring wraps), bytes-likes of every kind, pickled objects,
    and the wrong calls refused."""
    comm = _comm(timeout=30)
    bc = comm.broadcaster(4096, writer=int(writer), slots=4)
    assert bc.is_writer == (comm.rank == int(writer)) and bc.writer == int(writer), bc
    sizes = [0, 64, 4096, 4097, 1 << 20] + [(i * 997) % 8195 for i in range(40)]
    for m, n in enumerate(sizes):
        if bc.is_writer:
            data = _message(m, n)
            # bytes, bytearray and a memoryview all send as the same bytes.
            bc.send([data, bytearray(data), memoryview(data)][m % 3])
        else:
            got = bc.recv(timeout=datetime.timedelta(seconds=30))
            assert isinstance(got, bytes), type(got)
            assert got == _message(m, n), (m, n, len(got))
    step = {"step": 7, "seqs": list(range(100)), "blob": b"x" * 10000}
    if bc.is_writer:
        bc.send(pickle.dumps(step))
        try:
            bc.recv()
        except ferrocomm.InvalidArgument as e:
            print(f"writer recv refused: {e}")
        else:
            raise AssertionError("recv on the writer did not raise")
    else:
        assert pickle.loads(bc.recv()) == step
        try:
            bc.send(b"x")
        except ferrocomm.InvalidArgument as e:
            print(f"reader send refused: {e}")
        else:
            raise AssertionError("send on a reader did not raise")
    assert bc.messages == len(sizes) + 1, bc.messages
    print(f"rank {comm.rank}: {bc.messages} messages, uses_ring={bc.uses_ring}")
    bc.close()
    assert bc.closed
    comm.finalize()


def broadcaster_stalled_reader() -> None:
    """Rank 2 reads one message, then sleeps: the writer's send times out
    naming it, having sent nothing, and a retry goes through once it reads."""
    comm = _comm(timeout=20)
    bc = comm.broadcaster(128, slots=2)
    if comm.rank == 0:
        for m in range(3):
            bc.send(_message(m, 50))
        start = time.monotonic()
        try:
            bc.send(_message(3, 50), timeout=0.5)
        except ferrocomm.CommTimeout as e:
            took = time.monotonic() - start
            print(f"raised CommTimeout after {took:.2f} s: {e} (missing={e.missing})")
            assert e.missing == [2], e.missing
            assert 0.5 <= took < 5, took
        else:
            raise AssertionError("a send past a stalled reader did not time out")
        for m in range(3, 10):
            bc.send(_message(m, 50))
        # The readers now wait for a message that does not come until a
        # signal handler of theirs raises: the wait ends with its exception.
        time.sleep(3)
        bc.send(b"after the alarm")
    else:
        for m in range(10):
            if comm.rank == 2 and m == 1:
                time.sleep(2)
            assert bc.recv() == _message(m, 50), m
        _interrupted_recv(bc)
        assert bc.recv() == b"after the alarm"
    bc.close()
    comm.finalize()


class _Alarm(Exception):
    pass


def _interrupted_recv(bc) -> None:
    """A receive with a long timeout, ended by SIGALRM's handler after 0.3 s;
    the broadcaster stays usable."""

    def ring(signum, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    start = time.monotonic()
    try:
        bc.recv(timeout=20)
    except _Alarm:
        took = time.monotonic() - start
        print(f"recv interrupted after {took:.2f} s")
        assert took < 2, took
    else:
        raise AssertionError("the signal did not end the receive")
    finally:
        signal.signal(signal.SIGALRM, old)


def broadcaster_killed_reader() -> None:
    """Rank 2 dies after the first message: the writer raises within the
    timeout, naming it; rank 1 reads on until the writer closes."""
    comm = _comm(timeout=3)
    bc = comm.broadcaster(256, slots=4)
    if comm.rank == 0:
        bc.send(b"first")
        start = time.monotonic()
        try:
            for m in range(100_000):
                bc.send(_message(m, 200))
        except ferrocomm.FerrocommError as e:
            took = time.monotonic() - start
            print(f"raised {type(e).__name__} after {took:.2f} s: {e}")
            assert "reader rank 2" in str(e), e
            assert took < 2 * 3, took
        else:
            raise AssertionError("sending to a dead reader never raised")
        bc.close()
        return
    assert bc.recv() == b"first"
    if comm.rank == 2:
        os._exit(17)
    try:
        m = 0
        while True:
            assert bc.recv() == _message(m, 200), m
            m += 1
    except ferrocomm.FerrocommError as e:
        print(f"reader raised {type(e).__name__} after {m} messages: {e}")
        assert "writer rank 0" in str(e), e
