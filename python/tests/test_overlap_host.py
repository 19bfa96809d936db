"""ferrocomm.ops' chunked all-gather and reduce-scatter on the host
backend, each rank its own process, against NumPy (the torch operations on
top of them are GPU tests: test_overlap_torch.py). The module also imports
without torch."""

import subprocess
import sys

import pytest

from _ranks import expect_ok, launch


def test_ops_module_imports_without_torch():
    """Importing ferrocomm.ops loads no torch (it is imported when a torch
    operation is called), in a fresh interpreter."""
    code = (
        "import sys, ferrocomm.ops as o; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert callable(o.all_gather_matmul) and callable(o.matmul_reduce_scatter)"
    )
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.returncode == 0, p.stdout


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_operations(world):
    expect_ok(launch(world, "chunked_ops", worker="_overlap_host_worker.py"))
