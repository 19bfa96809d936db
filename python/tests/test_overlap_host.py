"""ferrocomm.ops' chunked all-gather and reduce-scatter on the host
backend, each rank its own process, against NumPy (the torch operations on
top of them are GPU tests: test_overlap_torch.py). The module also imports
without torch."""

import pytest

from _ranks import expect_ok, launch


def test_ops_module_imports_without_torch():
    import sys

    import ferrocomm.ops

    assert callable(ferrocomm.ops.all_gather_matmul) and callable(ferrocomm.ops.matmul_reduce_scatter)
    assert "torch" not in sys.modules or sys.modules["torch"] is not None


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_operations(world):
    expect_ok(launch(world, "chunked_ops", worker="_overlap_host_worker.py"))
