"""Dynamo's relay in a process of its own (:class:`~kvalign.oracles.relay_process.ProcessRouterPath`), for real.

The re-check of issue 46 moves each worker's relay out of kvalign's process; these hold that it is out
(another pid, ended on close), that SGLang's events still reach the router through it (the sentinel
barrier, and a stored page in the router's dump), and that a negative control's broken hop between
SGLang and the relay still applies there (every batch dropped: the barrier fails).
"""

from __future__ import annotations

import os

import pytest

from kvalign.oracles.base import OracleUnavailable


def _open(*args):
    from kvalign.oracles.relay_process import ProcessRouterPath

    try:
        return ProcessRouterPath(*args)
    except OracleUnavailable as exc:
        pytest.skip(f"the relay-apart path cannot start here: {exc}")


@pytest.mark.timeout(300)
def test_the_relay_runs_in_its_own_process_and_the_router_indexes_what_sglang_publishes():
    path = _open()
    try:
        worker = path.worker(4, False)
        child = worker.relay.proc
        assert child.pid != os.getpid() and child.poll() is None
        assert worker.barrier() and worker.barrier()  # two sentinels in a row, each indexed
        base = worker.token_space()
        page = worker.publisher.sentinel(10_000 + base, 4)
        worker.publisher.publish([page])
        assert worker.barrier()
        assert page.block_hashes[0] in {h for _p, h, _t in worker.dump()}
    finally:
        path.close()
    assert child.poll() is not None  # closing the path ends the relay's process


@pytest.mark.timeout(300)
def test_a_broken_hop_before_the_relay_applies_out_of_process_too(monkeypatch):
    from kvalign.oracles import router_path

    path = _open(lambda frames: None)  # every SGLang batch dropped on its way to the relay
    # a sentinel that can never arrive: 1 s (two sends, the relay indexes one in milliseconds) is the
    # control's whole point, the default 4 s was only waited out
    monkeypatch.setattr(router_path, "INGEST_TIMEOUT_S", 1.0)
    try:
        assert not path.worker(4, False).barrier()
    finally:
        path.close()
