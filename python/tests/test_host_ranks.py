"""Every collective on the host backend, at worlds 2 and 3, each rank its
own process, checked bit for bit against NumPy; and the failure cases that
need several ranks (mismatched calls, a killed rank)."""

import secrets

import pytest

from _ranks import expect_ok, launch


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["all_reduce", "data_movement", "reductions_to", "point_to_point"])
def test_collectives(world, scenario):
    expect_ok(launch(world, scenario))


@pytest.mark.parametrize("world", [2, 3])
def test_fused_all_reduce_epilogues(world):
    expect_ok(launch(world, "fused"))


def test_split_and_lifecycle():
    expect_ok(launch(3, "split_and_lifecycle"))


def test_mismatch_raises_on_every_rank():
    results = launch(2, "mismatch", timeout=60)
    expect_ok(results)


def test_killed_peer_raises_comm_timeout():
    results = launch(3, "killed_peer", timeout=90)
    survivors, dead = results[:-1], results[-1]
    assert dead.returncode == 17, dead.output
    expect_ok(survivors)
    assert all("raised CommTimeout" in r.output for r in survivors), [r.output for r in survivors]


def test_python_store_object():
    from store_helpers import serve

    authkey = secrets.token_hex(8)
    address, _ = serve(authkey.encode())
    expect_ok(launch(2, "python_store", address, authkey))
