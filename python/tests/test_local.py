"""One-rank checks in this process: argument validation (the right
exception, nothing queued), DLPack import paths, memory lifetime, the
Python-side helpers."""

import contextlib
import datetime
import secrets
import sys

import numpy as np
import pytest

import ferrocomm
from ferrocomm import ReduceOp
from _ranks import free_port


@contextlib.contextmanager
def one_rank_env():
    """This process as the only rank of a world of one, as a launcher sets
    it up (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK and a fresh
    FERROCOMM_TOKEN), for `ferrocomm.init()` here; restored on exit."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            FERROCOMM_TOKEN=secrets.token_hex(16),
        ).items():
            mp.setenv(k, v)
        mp.delenv("FERROCOMM_TOKEN_FILE", raising=False)
        yield


@pytest.fixture(scope="module")
def comm():
    with one_rank_env():
        c = ferrocomm.init(backend="host", name="local", timeout=30)
    yield c
    c.finalize()


def test_properties(comm):
    assert (comm.rank, comm.size, comm.name, comm.backend) == (0, 1, "local", "host")
    assert "host" in ferrocomm.BACKENDS and isinstance(ferrocomm.__version__, str)


def test_world_one_collectives(comm):
    x = np.arange(10, dtype=np.float32)
    comm.all_reduce(x)
    assert x.tolist() == list(range(10))
    out = np.zeros(10, np.float32)
    comm.all_gather_single(out, x)
    assert out.tolist() == x.tolist()
    comm.broadcast(x, 0)
    comm.barrier()


def test_invalid_arguments_are_value_errors(comm):
    x = np.ones(8, np.float32)
    cases = {
        "non-contiguous": lambda: comm.all_reduce(np.ones((4, 4), np.float32)[:, ::2]),
        "read-only": lambda: comm.all_reduce(_readonly(np.ones(4, np.float32))),
        "int16": lambda: comm.all_reduce(np.ones(4, np.int16)),
        "complex": lambda: comm.all_reduce(np.ones(4, np.complex64)),
        "not a tensor": lambda: comm.all_reduce([1.0, 2.0]),
        "root": lambda: comm.broadcast(x, 3),
        "premul_sum without factor": lambda: comm.all_reduce(x, "premul_sum"),
        "unknown op": lambda: comm.all_reduce(x, "median"),
        "bitwise on floats": lambda: comm.all_reduce(x, ReduceOp.BAND),
        "timeout": lambda: comm.all_reduce(x, timeout=-1),
        "timeout type": lambda: comm.all_reduce(x, timeout="soon"),
        "stream for CPU": lambda: comm.all_reduce(x, stream=1234),
        "gather length": lambda: comm.all_gather([np.ones(8, np.float32)] * 2, x),
        "dtype mix": lambda: comm.all_gather_single(np.ones(8, np.int32), x),
        "splits": lambda: comm.all_to_all_v_single(np.ones(8, np.float32), x, [3], [8]),
        "p2p op": lambda: ferrocomm.P2POp("bcast", x, 0),
    }
    for what, call in cases.items():
        with pytest.raises(ferrocomm.FerrocommError) as info:
            call()
        e = info.value
        assert isinstance(e, ValueError) and isinstance(e, ferrocomm.InvalidArgument), (what, type(e), e)
        assert e.kind == "invalid_argument" and str(e), what
    # Nothing was queued or broken: the communicator still works.
    comm.all_reduce(x)
    assert x.tolist() == [1.0] * 8


def _readonly(a):
    a.setflags(write=False)
    return a


def test_read_only_input_is_fine(comm):
    # Inputs are only read: a read-only array may be one.
    src = _readonly(np.arange(4, dtype=np.float32))
    out = np.zeros(4, np.float32)
    comm.all_gather_single(out, src)
    assert out.tolist() == [0, 1, 2, 3]


class OnlyArrayInterface:
    """An array-like that speaks only the NumPy array interface."""

    def __init__(self, a):
        self.a = a
        self.__array_interface__ = a.__array_interface__


def test_array_interface_fallback(comm):
    a = np.arange(6, dtype=np.int32)
    out = np.zeros(6, np.int32)
    comm.all_gather_single(OnlyArrayInterface(out), OnlyArrayInterface(a))
    assert out.tolist() == a.tolist()


class LegacyDLPack:
    """A producer older than DLPack 1.0: no max_version keyword."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_legacy_dlpack_producer(comm):
    a = np.full(5, 3.0, np.float64)
    comm.broadcast(LegacyDLPack(a), 0)
    assert a.tolist() == [3.0] * 5


def test_memory_is_released_after_the_work(comm):
    a = np.ones(1024, np.float32)
    before = sys.getrefcount(a)
    comm.all_reduce(a)
    assert sys.getrefcount(a) == before, "a synchronous call keeps no reference"
    work = comm.all_reduce(a, async_op=True)
    assert sys.getrefcount(a) > before, "queued work keeps the array alive"
    assert work.name == "all_reduce" and "all_reduce" in repr(work)
    work.wait(timeout=datetime.timedelta(seconds=10))
    assert work.is_completed()
    del work
    comm.barrier()  # the next call lets go of completed work
    assert sys.getrefcount(a) == before


def test_work_wait_validates_timeout(comm):
    work = comm.all_reduce(np.ones(4, np.float32), async_op=True)
    with pytest.raises(ferrocomm.InvalidArgument):
        work.wait(timeout=0)
    work.wait()


def test_reduce_op_spellings():
    assert ReduceOp.PRODUCT == ReduceOp.PROD == ferrocomm._ops.as_op("product")
    assert ReduceOp.premul_sum(2) == ReduceOp.PREMUL_SUM(2.0)
    assert repr(ReduceOp.SUM) == "ReduceOp.SUM"

    class TorchLike:  # torch.distributed.ReduceOp.RedOpType.MAX has .name
        name = "MAX"

    assert ferrocomm._ops.as_op(TorchLike()) == ReduceOp.MAX
    with pytest.raises(ferrocomm.InvalidArgument):
        ReduceOp("median")


def test_finalize_twice_and_abort():
    with one_rank_env():
        c = ferrocomm.init(backend="host")
        c.abort()
        with pytest.raises(ferrocomm.Aborted):
            c.all_reduce(np.ones(2, np.float32))
        c.finalize()
        with pytest.raises(ferrocomm.Finalized):
            c.finalize()


def test_bad_backend_and_missing_environment(monkeypatch):
    with pytest.raises(ferrocomm.InvalidArgument):
        ferrocomm.init(backend="tpu")
    for k in ("MASTER_PORT", "FERROCOMM_TOKEN", "FERROCOMM_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ferrocomm.InvalidArgument, match="MASTER_PORT|FERROCOMM_TOKEN"):
        ferrocomm.init(backend="host")


def test_gpu_backend_without_gpu_is_a_clear_error():
    # No GPU on CI: asking for one must be an error naming why, not a crash.
    if "cuda" not in ferrocomm.BACKENDS:
        pytest.skip("built without the cuda backend")
    with one_rank_env():
        try:
            c = ferrocomm.init(backend="cuda", device=0)
        except (ferrocomm.LibraryMissing, ferrocomm.NoDevice) as e:
            assert str(e)
        else:  # a machine with a GPU
            c.finalize()


def test_ctrl_c_ends_a_rendezvous_waiting_for_a_missing_rank():
    """Rank 1 never comes: SIGINT must end rank 0's wait at once (the wait
    would otherwise last the rendezvous timeout)."""
    import os
    import signal
    import subprocess
    import time

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="2",
               FERROCOMM_TOKEN="t" * 16, PYTHONUNBUFFERED="1")
    env.pop("FERROCOMM_TOKEN_FILE", None)
    # The child installs Python's own SIGINT handler, so that the test does
    # not depend on the disposition it inherits: SIG_IGN survives exec (a
    # shell's `cmd &` without job control sets it), and Python then never
    # raises KeyboardInterrupt.
    code = (
        "import ferrocomm, signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "print('waiting', flush=True)\n"
        "try:\n"
        "    ferrocomm.init(backend='host')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "waiting"
    time.sleep(1.0)
    start = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    assert "interrupted" in out, out
    assert time.monotonic() - start < 5


def test_jax_cpu_array_as_input(comm):
    """JAX arrays through DLPack (as inputs: JAX arrays are immutable)."""
    import os

    if "jax" not in sys.modules:
        # CPU only: this test must not make JAX take GPU memory.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jnp = pytest.importorskip("jax.numpy")
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        src = jnp.arange(6, dtype=jnp.float32)
    out = np.zeros(6, np.float32)
    comm.all_gather_single(out, src)
    assert out.tolist() == list(range(6))


def test_heap_tensor_dlpack_export(comm):
    """A heap tensor's DLPack capsules (legacy and versioned), the hold an
    unconsumed capsule keeps, NumPy views in place, collectives on it."""
    t = comm.heap_tensor((2, 3), np.float16)
    assert t.__dlpack_device__() == (1, 0) and t.shape == (2, 3) and t.dtype == "float16"
    cap = t.__dlpack__()
    assert '"dltensor"' in repr(cap), repr(cap)
    with pytest.raises(ferrocomm.InvalidArgument, match="still held"):
        t.free()
    del cap  # never consumed: its destructor lets go
    cap = t.__dlpack__(max_version=(1, 1))
    assert '"dltensor_versioned"' in repr(cap), repr(cap)
    del cap
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(2, 0))
    a = np.from_dlpack(t)
    a[1, 2] = 5
    assert np.from_dlpack(t)[1, 2] == 5 and a.flags.writeable
    x = comm.heap_tensor(4, "float32")
    np.from_dlpack(x)[:] = 2
    comm.all_reduce(x)  # collectives take heap tensors as they are
    assert np.from_dlpack(x).tolist() == [2.0] * 4
    del a
    t.free()
    x.free()
    with pytest.raises(ferrocomm.InvalidArgument, match="freed"):
        np.from_dlpack(t)


def test_heap_tensor_bits(comm):
    """bits(): a bfloat16 (or float8) heap tensor's memory as NumPy sees it,
    unsigned integers of the element's width, in place; its exports hold
    the tensor as the tensor's own do."""
    t = comm.heap_tensor((2, 3), "bfloat16")
    b = t.bits()
    assert isinstance(b, ferrocomm.HeapTensorBits) and t.dtype == "bfloat16", (t, b)
    assert b.dtype == "uint16" and b.shape == (2, 3) and b.data_ptr() == t.data_ptr(), b
    assert b.__dlpack_device__() == t.__dlpack_device__() and "bfloat16" in repr(b), repr(b)
    a = np.from_dlpack(b)
    assert a.dtype == np.uint16 and a.shape == (2, 3) and a.ctypes.data == t.data_ptr() and not a.any(), a
    want = (np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5).view(np.uint32) >> 16  # exact in bf16
    a[:] = want
    out = comm.heap_tensor((2, 3), "bfloat16")
    comm.all_gather_single(out, t)  # ferrocomm takes the heap tensor as bf16
    assert np.from_dlpack(out.bits()).tolist() == want.tolist()
    with pytest.raises(ferrocomm.InvalidArgument, match="still held"):
        t.free()
    del a
    t.free()
    out.free()
    with pytest.raises(ferrocomm.InvalidArgument, match="freed"):
        np.from_dlpack(b)
    f8 = comm.heap_tensor(4, "float8_e4m3fn")
    bytes_ = np.from_dlpack(f8.bits())
    assert f8.bits().dtype == "uint8" and bytes_.dtype == np.uint8 and bytes_.shape == (4,), bytes_
    bytes_[:] = [0x38, 0x40, 0xB8, 0]  # 1.0, 2.0, -1.0, 0.0 in e4m3
    assert np.from_dlpack(f8.bits()).tolist() == [0x38, 0x40, 0xB8, 0]
    del bytes_
    f8.free()
    x = comm.heap_tensor(2, "float32")  # any dtype: the bits of its width
    assert x.bits().dtype == "uint32" and np.from_dlpack(x.bits()).dtype == np.uint32
    x.free()
