"""Ports chosen for child processes: free, distinct, and outside the kernel's ephemeral
range (where an outgoing connection could take one before the child binds it)."""

from __future__ import annotations

import socket

import pytest

from kvc import processes
from kvc.processes import free_port, free_ports, port_free


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = processes._ephemeral_low()
    ports = [free_port() for _ in range(50)] + free_ports(50)
    assert len(set(ports)) == 100
    assert all(processes._PORT_FLOOR <= port < low for port in ports)
    assert all(port_free("127.0.0.1", port, reuse_addr=False) for port in ports)


def test_a_consecutive_run_is_one_block_of_free_ports() -> None:
    ports = free_ports(12, consecutive=True)
    assert ports == list(range(ports[0], ports[0] + 12))
    assert all(port_free("127.0.0.1", port) for port in ports)


def test_a_port_somebody_listens_on_is_never_handed_out() -> None:
    picker = processes._PortPicker()
    with socket.socket() as held:
        held.bind(("127.0.0.1", picker._next))
        held.listen()
        taken = held.getsockname()[1]
        assert not port_free("127.0.0.1", taken)
        assert picker.take(1, "127.0.0.1", consecutive=False) != [taken]
        run = picker.take(4, "127.0.0.1", consecutive=True)
        assert taken not in run


def test_the_walk_wraps_at_the_top_of_the_range() -> None:
    picker = processes._PortPicker()
    picker._next = picker._high - 2
    run = picker.take(5, "127.0.0.1", consecutive=True)
    assert run[0] >= picker._low
    assert run[-1] < picker._high


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "_ephemeral_low", lambda: processes._PORT_FLOOR + 10)
    picker = processes._PortPicker()
    ports = picker.take(3, "127.0.0.1", consecutive=False)
    assert len(set(ports)) == 3


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        free_ports(0)
