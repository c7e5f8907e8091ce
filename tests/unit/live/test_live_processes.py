"""Process-group lifecycle: logs, crash detection, and teardown that leaves nothing behind."""

from __future__ import annotations

import sys
import time

import pytest

from kvalign.live.cluster.processes import ProcessExited, ProcessGroup, ProcessSpec, group_alive, pids_with_env

PY = sys.executable

# Ignores SIGTERM and forks a grandchild that also ignores it: only a group SIGKILL ends both.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    time.sleep(600)
print("up" + "-and-" + "running", flush=True)
time.sleep(600)
"""

# Records the moment it got SIGTERM, then exits.
RECORDER = """
import signal, sys, time
def bye(*_):
    open(sys.argv[1], "a").write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("up" + "-and-" + "running", flush=True)
time.sleep(600)
"""


def _wait_log(group: ProcessGroup, name: str, text: str, timeout: float = 10.0) -> None:
    p = next(p for p in group.procs if p.spec.name == name)
    deadline = time.monotonic() + timeout
    while text not in p.log_tail():
        assert time.monotonic() < deadline, f"{name} never logged {text!r}: {p.log_tail()!r}"
        time.sleep(0.02)


def test_stubborn_group_with_grandchild_is_killed_and_logged(tmp_path):
    marker = ("KVALIGN_TEST_RUN", str(tmp_path))
    group = ProcessGroup(tmp_path / "logs")
    p = group.start(ProcessSpec("stubborn", [PY, "-c", STUBBORN], {marker[0]: marker[1]}))
    _wait_log(group, "stubborn", "up-and-running")
    assert len(pids_with_env(*marker)) == 2  # leader + grandchild
    killed = group.stop(grace_s=0.5)
    assert killed == ["stubborn"] and group.killed == killed
    assert not group_alive(p.pid)
    deadline = time.monotonic() + 5
    while pids_with_env(*marker):
        assert time.monotonic() < deadline, "grandchild survived the group SIGKILL"
        time.sleep(0.05)
    log = (tmp_path / "logs" / "stubborn.log").read_text()
    assert log.startswith(f"$ {marker[0]}=") and "up-and-running" in log
    assert group.stop() == []  # idempotent


def test_services_stop_before_infrastructure(tmp_path):
    order = tmp_path / "order.txt"
    group = ProcessGroup(tmp_path / "logs")
    group.start(ProcessSpec("broker", [PY, "-c", RECORDER, str(order), "broker"], infrastructure=True))
    group.start(ProcessSpec("worker", [PY, "-c", RECORDER, str(order), "worker"]))
    for name in ("broker", "worker"):
        _wait_log(group, name, "up-and-running")
    assert group.stop() == []
    assert order.read_text().split() == ["worker", "broker"]


def test_dead_process_is_reported_with_its_log(tmp_path):
    group = ProcessGroup(tmp_path / "logs")
    group.start(ProcessSpec("crasher", [PY, "-c", "import sys; print('boom here'); sys.exit(3)"]))
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessExited, match=r"crasher \(pid \d+\) exited with code 3(.|\n)*boom here"):
        while time.monotonic() < deadline:
            group.check_alive()
            time.sleep(0.02)
    group.stop()


def test_duplicate_names_are_refused(tmp_path):
    group = ProcessGroup(tmp_path / "logs")
    group.start(ProcessSpec("a", [PY, "-c", "pass"]))
    with pytest.raises(ValueError, match="duplicate"):
        group.start(ProcessSpec("a", [PY, "-c", "pass"]))
    group.stop()


def test_command_line_is_shell_quoted():
    spec = ProcessSpec("w", ["python", "-c", "print('a b')"], {"X": "1 2"})
    assert spec.command_line() == "X='1 2' python -c 'print('\"'\"'a b'\"'\"')'"


def test_stop_one_ends_only_that_group_and_frees_its_name(tmp_path):
    """A worker restart: the stopped process's whole group goes (grandchild too), the other keeps
    running, and the name (and its log file) can be started again."""
    marker = ("KVALIGN_TEST_RUN", str(tmp_path))
    group = ProcessGroup(tmp_path / "logs")
    try:
        a = group.start(ProcessSpec("a", [PY, "-c", STUBBORN], {marker[0]: marker[1]}))
        b = group.start(ProcessSpec("b", [PY, "-c", RECORDER, str(tmp_path / "t"), "b"]))
        _wait_log(group, "a", "up-and-running")
        _wait_log(group, "b", "up-and-running")
        assert group.stop_one("a", grace_s=0.5) is True  # ignored SIGTERM: needed SIGKILL
        assert not group_alive(a.pid) and b.alive() and [p.spec.name for p in group.procs] == ["b"]
        group.start(ProcessSpec("a", [PY, "-c", RECORDER, str(tmp_path / "t"), "a2"]))
        _wait_log(group, "a", "up-and-running")
        assert (tmp_path / "logs" / "a.log").read_text().count("$ ") == 2  # one log, both runs
        with pytest.raises(ValueError, match="no process named 'zz'"):
            group.stop_one("zz")
    finally:
        group.stop(grace_s=1)


def test_environ_is_the_running_process_s_own_environment(tmp_path) -> None:
    """What a started process runs with, read from the kernel: its spec's settings over the inherited ones (the
    live rules read an engine's settings there, not from the command kvalign meant to start)."""
    group = ProcessGroup(tmp_path, base_env={"PATH": "/usr/bin:/bin", "KVALIGN_INHERITED": "a"})
    try:
        group.start(ProcessSpec("sleeper", [PY, "-c", "import time; time.sleep(60)"], {"KVALIGN_SET": "0"}))
        env = group.environ("sleeper")
        assert env is not None and env["KVALIGN_SET"] == "0" and env["KVALIGN_INHERITED"] == "a"
        assert group.environ("absent") is None
    finally:
        group.stop()
