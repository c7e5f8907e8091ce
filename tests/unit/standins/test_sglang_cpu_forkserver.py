"""SGLang's children forked from a pre-imported fork server (kvalign.standins.sglang_cpu.forkserver).

The patch's effect on a real worker (one fork server, two forked children, the cluster serving) is
measured by the e2e real-engine tests and docs/development.md; here: the start method SGLang asks
for is read as ``forkserver`` with the preload, nothing else is touched, and a child's SIGQUIT
reaches the worker through the fork server.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
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
    from kvalign.standins.sglang_cpu.forkserver import fork_server_now
    got = []

    def child(q):
        q.put(signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL)  # spawned children have the default
        q.put(forkserver._forkserver._preload_modules)  # what a grandchild's fork server would import
        os.kill(os.getppid(), signal.SIGQUIT)  # SGLang's failure report: parent_process.send_signal

    if __name__ == "__main__":
        if os.environ.get("FORKED") == "1":  # the server a fork of this process, before main() sets handlers
            assert fork_server_now(sys.argv[1:]) is not None
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


@pytest.mark.parametrize("forked", ["0", "1"])
@pytest.mark.parametrize("preload, relayed", [(["kvalign.standins.sglang_cpu.forkserver_preload"], True),
                                              ([], False)])  # the control: without the relay it is lost
def test_a_child_s_sigquit_reaches_the_worker_and_its_own_children_get_the_preload(tmp_path, preload, relayed, forked):
    script = tmp_path / "relay.py"
    script.write_text(RELAY)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FORKED": forked}
    out = subprocess.run([sys.executable, str(script), *preload], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(relayed), str(relayed)]


SERVER = textwrap.dedent("""
    import json, multiprocessing, os, sys, threading
    from multiprocessing import forkserver as mp_forkserver
    from kvalign.standins.sglang_cpu import forkserver
    import marker  # the worker's imports: each import of it writes a line
    import prometheus_client  # imported before the engine sets PROMETHEUS_MULTIPROC_DIR, as in dynamo.sglang

    def child(q):
        import setproctitle
        from prometheus_client import values
        setproctitle.setproctitle("kvalign::child")  # as SGLang titles its scheduler, which teardown checks read
        title = open("/proc/self/cmdline", "rb").read().split(b"\\0")[0].decode()
        q.put((os.getppid(), os.environ.get("PROMETHEUS_MULTIPROC_DIR"), values.ValueClass.__name__, title))

    if __name__ == "__main__":
        how = sys.argv[1]
        if how == "threaded":  # a second thread running, as once Dynamo's runtime has started
            gate = threading.Event()
            threading.Thread(target=gate.wait, daemon=True).start()
        server = forkserver.fork_server_now(["marker"]) if how != "spawned" else None
        multiprocessing.set_forkserver_preload(["marker"])
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]  # what the engine sets after the fork
        ctx = multiprocessing.get_context("forkserver")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        parent, metrics_dir, value_class, title = q.get(timeout=60)
        p.join(60)
        print(json.dumps({"server": server, "used": mp_forkserver._forkserver._forkserver_pid, "parent": parent,
                          "metrics_dir": metrics_dir, "value_class": value_class, "title": title}))
""")


def _run_server_script(tmp_path: Path, how: str) -> tuple[dict, list[str]]:
    (tmp_path / "marker.py").write_text(
        "import os\nwith open(os.environ['MARKER_LOG'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    script, log = tmp_path / "server.py", tmp_path / "imports.log"
    script.write_text(SERVER)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "MARKER_LOG": str(log)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    (tmp_path / "metrics").mkdir()
    out = subprocess.run([sys.executable, str(script), how, str(tmp_path / "metrics")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    # whichever server forked it, the child runs in the worker's environment of its start: the engine's
    # metrics directory, and prometheus_client in multiprocess mode (its metrics reach the worker's /metrics)
    assert seen["metrics_dir"] == str(tmp_path / "metrics") and seen["value_class"] == "MmapedValue", seen
    assert seen["title"] == "kvalign::child", seen  # the environment handed over without moving it off argv's block
    return seen, log.read_text().split()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
        time.sleep(0.02)
    return not Path(f"/proc/{pid}").exists()


def test_the_fork_server_is_a_fork_of_the_worker_so_nothing_is_imported_twice(tmp_path):
    seen, imports = _run_server_script(tmp_path, "forked")
    assert seen["server"] is not None and seen["used"] == seen["server"] == seen["parent"]
    assert len(imports) == 1, f"the worker's modules were imported again, by processes {imports}"
    assert _gone(seen["server"]), "the forked server outlived the worker"


def test_the_control_a_spawned_fork_server_imports_the_preload_again(tmp_path):
    seen, imports = _run_server_script(tmp_path, "spawned")
    assert seen["server"] is None and seen["used"] == seen["parent"]
    assert len(imports) == 2 and imports[1] == str(seen["parent"])


def test_with_a_second_thread_running_nothing_is_forked_and_multiprocessing_starts_its_own(tmp_path):
    seen, imports = _run_server_script(tmp_path, "threaded")
    assert seen["server"] is None and seen["used"] == seen["parent"] and len(imports) == 2


def test_an_armed_worker_forks_its_server_once_dynamo_sglang_main_is_imported(tmp_path):
    from kvalign.standins import sglang_cpu

    code = ("import sys\nfrom kvalign.standins.sglang_cpu.hooks import PatchOnImport\n"
            "[t] = [f.table for f in sys.meta_path if isinstance(f, PatchOnImport)]\n"
            "print([f.__name__ for f in t.get(sys.argv[1], ())])")
    for armed in (True, False):
        env = {k: v for k, v in os.environ.items() if k != forkserver.FORKSERVER_ENV}
        env |= sglang_cpu.worker_env(str(ROOT)) | ({forkserver.FORKSERVER_ENV: "1"} if armed else {})
        out = subprocess.run([sys.executable, "-c", code, forkserver.SERVER_FROM], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert ("fork_server_before_runtime" in out.stdout) is armed, out.stdout


def test_without_the_environment_passed_on_a_forked_child_keeps_the_import_time_one(monkeypatch):
    """The control of the environment's hand-over: a preparation without it leaves the environment alone."""
    import prometheus_client.values as values

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(values, "ValueClass", values.get_value_class())
    prepared: list[dict] = []
    prepare = forkserver._prepare_in_environ(prepared.append)
    prepare({"name": "child"})
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ and values.ValueClass is values.MutexValue
    environ = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": "/somewhere"}
    with monkeypatch.context() as m:
        m.setattr(os, "environ", os.environ.copy())
        prepare({"name": "child", forkserver.ENVIRON_KEY: environ})
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == "/somewhere" and values.ValueClass is not values.MutexValue
    assert [d["name"] for d in prepared] == ["child", "child"]


KILLED = textwrap.dedent("""
    import ctypes, multiprocessing, os, signal, sys, time
    from kvalign.standins.sglang_cpu import forkserver

    def child(armed):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # as SGLang's children: die with their parent
        armed.set()
        time.sleep(30)  # bounded: a failing run leaves it behind for this long at most

    if __name__ == "__main__":
        server = forkserver.fork_server_now([])
        ctx = multiprocessing.get_context("forkserver")
        armed = ctx.Event()
        p = ctx.Process(target=child, args=(armed,))
        p.start()
        armed.wait(60)
        with open(sys.argv[1], "w") as f:
            f.write(f"{server} {p.pid}")
        os.kill(os.getpid(), signal.SIGKILL)  # the worker killed outright: no teardown runs
""")


def test_a_worker_killed_outright_takes_its_forked_server_and_the_servers_children_with_it(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    pids, log = tmp_path / "pids", tmp_path / "stderr"
    with log.open("w") as err:  # no pipe: the child would hold it open
        rc = subprocess.run([sys.executable, str(script), str(pids)], stdout=subprocess.DEVNULL, stderr=err,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    assert rc == -9 and pids.exists(), log.read_text()
    server, child = (int(p) for p in pids.read_text().split())
    assert _gone(server) and _gone(child), "the forked server or its child outlived the killed worker"
