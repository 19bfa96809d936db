"""Communicator.broadcaster on the host backend, each rank its own process:
every size through the shared-memory ring and the socket, readers on
another pseudo-node, a stalled and a killed reader, a receive ended by a
signal handler."""

import pytest

from _ranks import expect_ok, launch


@pytest.mark.parametrize("world", [2, 3])
def test_every_size_through_ring_and_socket(world):
    results = launch(world, "broadcaster_messages")
    expect_ok(results)
    assert all("uses_ring=True" in r.output for r in results), [r.output for r in results]


def test_readers_on_another_pseudo_node_take_the_socket():
    results = launch(4, "broadcaster_messages", "1", env={"FERROCOMM_LOCAL_SIZE": "2"})
    expect_ok(results)
    rings = ["uses_ring=True" in r.output for r in results]
    assert rings == [True, True, False, False], [r.output for r in results]


def test_stalled_reader_is_named():
    results = launch(3, "broadcaster_stalled_reader", timeout=60)
    expect_ok(results)
    assert "missing=[2]" in results[0].output, results[0].output
    assert all("recv interrupted" in r.output for r in results[1:]), [r.output for r in results]


def test_killed_reader_is_named_within_the_timeout():
    results = launch(3, "broadcaster_killed_reader", timeout=60)
    assert results[2].returncode == 17, results[2].output
    expect_ok(results[:2])
    assert "reader rank 2" in results[0].output, results[0].output
