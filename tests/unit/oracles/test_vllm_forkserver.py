"""vLLM children forked from their environment's fork server: two engines open at once are both forks of the
one interpreter that imported vLLM, and answer what a fresh interpreter's vLLM answers (prefix hits and
events). Negative control: with ``KVALIGN_VLLM_FORK=0`` a third engine open beside them is a fresh
interpreter (this process's child, no server in its command line), whose answers the forks' are compared
with. A forked child killed mid-run is still reported by its exit status (first: the control below leaves
a fresh child idle, which a later engine would reuse)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvalign.errors import OracleUnavailable
from kvalign.oracles import vllm
from kvalign.oracles.vllm_forkserver import FORK_ENV, ForkedChild

B = 16
TOKENS = list(range(1, 3 * B + 2))  # three full blocks and one token


def _parent(pid: int) -> int:
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["PPid"])


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _answers(engine: vllm.VllmEngine) -> tuple[int, int, list[tuple[str, list[object]]]]:
    first = engine.prefill(TOKENS)
    hit = engine.match(TOKENS)
    events = [(e["type"], e.get("block_hashes")) for e in engine.take_events(publish=False)]
    return first, hit, events


def test_a_killed_forked_child_is_reported_with_its_exit():
    engine = vllm.VllmEngine(B, 8)
    try:
        assert isinstance(engine._proc, ForkedChild)
        os.kill(engine._proc.pid, signal.SIGKILL)
        engine._proc.wait(timeout=30)
        with pytest.raises(OracleUnavailable, match=r"vLLM's process exited \(-9\)"):
            engine.match(TOKENS)
    finally:
        engine.close()


@pytest.mark.slow  # its control starts a fresh vLLM interpreter on purpose (about 12 CPU-s); every fast vLLM test runs forked
def test_engines_open_at_once_are_forks_of_one_server_answering_as_a_fresh_interpreter(monkeypatch):
    with vllm.VllmEngine(B, 32) as a, vllm.VllmEngine(B, 32) as b:
        server = vllm._SERVERS[a._key]
        for engine in (a, b):
            assert isinstance(engine._proc, ForkedChild)
            pid = engine._proc.pid
            assert _parent(pid) == server.proc.pid != os.getpid()
            assert "--fork-server" in _cmdline(pid)  # the server's interpreter, not a fresh one
        assert a._proc.pid != b._proc.pid
        answers = _answers(a)
        assert answers[:2] == (0, 3 * B) and [t for t, _ in answers[2]] == ["BlockStored"]
        assert _answers(b) == answers
        monkeypatch.setenv(FORK_ENV, "0")  # the control: no idle child is left, so this one starts fresh
        with vllm.VllmEngine(B, 32) as fresh:
            assert not isinstance(fresh._proc, ForkedChild)
            assert _parent(fresh._proc.pid) == os.getpid() and "--fork-server" not in _cmdline(fresh._proc.pid)
            assert _answers(fresh) == answers
