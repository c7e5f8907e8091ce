"""The parent-death signal of :mod:`kvalign.lifeline`, with a real parent killed outright (SIGKILL: it runs no
clean-up). A grandchild armed with it dies with its parent; its negative control, the same grandchild unarmed,
outlives it (re-parented), so the test can fail on what it guards. And a parent that died before the signal was
armed is reported, not assumed alive."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from kvalign.lifeline import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _grandchild_after_its_parent_is_killed(armed: bool) -> bool:
    """Fork a parent that forks a sleeping grandchild (armed or not), kill the parent once the grandchild has said
    its pid, and say whether the grandchild still lives after a bounded wait (then kill it)."""
    r, w = os.pipe()
    parent = os.fork()
    if parent == 0:  # the parent: fork the grandchild, then wait to be killed
        os.close(r)
        me = os.getpid()
        if os.fork() == 0:  # the grandchild: armed (its parent alive at that point), it says its pid
            if armed and not die_with_parent(me):
                os._exit(1)
            os.write(w, os.getpid().to_bytes(8, "big"))
            time.sleep(30)
            os._exit(0)
        time.sleep(30)
        os._exit(0)
    os.close(w)
    data = b""
    while len(data) < 8 and (chunk := os.read(r, 8 - len(data))):
        data += chunk
    os.close(r)
    assert len(data) == 8, "the grandchild did not start"
    grandchild = int.from_bytes(data, "big")
    os.kill(parent, signal.SIGKILL)
    os.waitpid(parent, 0)
    deadline = time.monotonic() + 1.0  # the signal comes with the parent's death; the control waits it out
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = _alive(grandchild)
    if alive:
        os.kill(grandchild, signal.SIGKILL)
    return alive


def test_an_armed_child_dies_with_its_parent():
    assert not _grandchild_after_its_parent_is_killed(armed=True)


def test_negative_control_an_unarmed_child_outlives_its_parent():
    assert _grandchild_after_its_parent_is_killed(armed=False)


def test_a_parent_that_is_gone_before_arming_is_reported():
    """In a forked child, so the test's own process is never armed (its xdist controller is its parent)."""
    child = os.fork()
    if child == 0:
        ok = die_with_parent(os.getppid()) is True and die_with_parent(os.getpid()) is False  # not its own parent
        os._exit(0 if ok else 1)
    _pid, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
