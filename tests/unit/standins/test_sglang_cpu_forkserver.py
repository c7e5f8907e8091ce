"""SGLang's children forked from a pre-imported fork server (kvalign.standins.sglang_cpu.forkserver).

The patch's effect on a real worker (one fork server, two forked children, the cluster serving) is
measured by the e2e real-engine tests and docs/development.md; here: the start method SGLang asks
for is read as ``forkserver`` with the preload, nothing else is touched, and a child's SIGQUIT
reaches the worker through the fork server.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from kvalign.live.engines.sglang_cpu import SglangCpuWorkerKind
from kvalign.standins.sglang_cpu import forkserver

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    seen: list[tuple] = []
    monkeypatch.setattr(multiprocessing, "set_start_method", lambda m, force=False: seen.append(("method", m, force)))
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", lambda mods: seen.append(("preload", list(mods))))
    return seen


def test_spawn_is_read_as_forkserver_with_sglang_s_child_modules_preloaded(calls):
    forkserver._Multiprocessing().set_start_method("spawn", force=True)
    assert calls == [("preload", forkserver.PRELOAD), ("method", "forkserver", True)]


def test_another_start_method_passes_through_unchanged(calls):
    mp = forkserver._Multiprocessing()
    mp.set_start_method("fork")
    assert calls == [("method", "fork", False)]
    assert mp.Process is multiprocessing.Process and mp.Pipe is multiprocessing.Pipe


def test_the_patch_replaces_the_engine_modules_mp_and_refuses_an_engine_it_does_not_know(monkeypatch):
    engine = types.ModuleType("sglang.srt.entrypoints.engine")
    engine.mp = multiprocessing
    monkeypatch.setitem(sys.modules, engine.__name__, engine)
    forkserver.forkserver_children()
    assert isinstance(engine.mp, forkserver._Multiprocessing)
    with pytest.raises(RuntimeError, match="no longer imports multiprocessing as mp"):
        forkserver.forkserver_children()  # mp is no longer the module itself


def test_workers_are_armed_by_default_and_not_when_turned_off():
    assert SglangCpuWorkerKind("/draft").device_env(None)[forkserver.FORKSERVER_ENV] == "1"
    assert forkserver.FORKSERVER_ENV not in SglangCpuWorkerKind("/draft", forkserver=False).device_env(None)


RELAY = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from multiprocessing import forkserver
    got = []

    def child(q):
        q.put(signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL)  # spawned children have the default
        q.put(forkserver._forkserver._preload_modules)  # what a grandchild's fork server would import
        os.kill(os.getppid(), signal.SIGQUIT)  # SGLang's failure report: parent_process.send_signal

    if __name__ == "__main__":
        signal.signal(signal.SIGQUIT, lambda *a: got.append("quit"))  # the worker's SIGQUIT handler
        multiprocessing.set_forkserver_preload(sys.argv[1:])
        ctx = multiprocessing.get_context("forkserver")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        default, preload = q.get(timeout=60), q.get(timeout=60)
        p.join(60)
        # until the worker has the quit, or the fork server is gone (SIGQUIT's default action: without
        # the relay the signal ends the fork server and is lost), rather than sitting out the bound
        server = forkserver._forkserver._forkserver_pid
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            if os.waitid(os.P_PID, server, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            time.sleep(0.01)
        print(default, got == ["quit"], preload == sys.argv[1:] + ["sglang.srt.managers.scheduler",
                                                                 "sglang.srt.managers.detokenizer_manager"])
""")


@pytest.mark.parametrize("preload, relayed", [(["kvalign.standins.sglang_cpu.forkserver_preload"], True),
                                              ([], False)])  # the control: without the relay it is lost
def test_a_child_s_sigquit_reaches_the_worker_and_its_own_children_get_the_preload(tmp_path, preload, relayed):
    script = tmp_path / "relay.py"
    script.write_text(RELAY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script), *preload], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(relayed), str(relayed)]
