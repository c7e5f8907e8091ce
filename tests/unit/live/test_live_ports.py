"""Loopback port allocation for live runs."""

from __future__ import annotations

import socket

import pytest

from kvalign.live.cluster.ports import LOOPBACK, PORT_RANGE, PortPool, is_free


def test_ports_are_distinct_stable_free_and_i16():
    pool = PortPool(seed=1)
    names = [f"w{i}.{k}" for i in range(8) for k in ("rpc", "kv", "sys", "boot")]
    ports = [pool.take(n) for n in names]
    assert len(set(ports)) == len(ports)
    assert all(PORT_RANGE[0] <= p <= PORT_RANGE[1] <= 32767 for p in ports)  # DYN_SYSTEM_PORT is an i16
    assert pool.take(names[0]) == ports[0]
    assert all(is_free(p) for p in ports)


def test_busy_port_is_detected_and_skipped():
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not is_free(busy)
        pool = PortPool(port_range=(busy, busy))
        with pytest.raises(RuntimeError, match="no free port"):
            pool.take("x")


def test_bad_range_is_rejected():
    with pytest.raises(ValueError):
        PortPool(port_range=(0, 10))
