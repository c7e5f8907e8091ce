"""``kvalign live`` end to end: the scenario verdict, and teardown when the CLI is interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvalign.model.causes import Cause
from kvalign.live.cluster.processes import group_alive, pids_with_env, run_pids
from kvalign.live.cluster.topology import RUN_MARKER_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _kvalign(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvalign", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


@contextmanager
def _held_cluster(args: list[str], run_dir, *, ready_s: float) -> Iterator[subprocess.Popen]:
    """``kvalign live up ARGS`` holding a ready cluster (killed on the way out if still running)."""
    proc = _kvalign("live", "up", *args, "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + ready_s
        line = ""
        while time.monotonic() < deadline and not line.startswith("frontend"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"kvalign exited early: {proc.stderr.read()}"
        assert line.startswith("frontend"), "cluster never became ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_live_up_scenario_passes_and_negative_control_fails(live_run_dir, cpu_live_stack):
    ok = _kvalign("live", "up", "--workers", "2", "--scenario", "--run-dir", str(live_run_dir / "ok"))
    out, err = ok.communicate(timeout=100)
    assert ok.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert out.rstrip().endswith("PASS")

    neg = _kvalign("live", "up", "--workers", "2", "--register-eagle", "off", "--scenario",
                   "--run-dir", str(live_run_dir / "neg"))
    out, err = neg.communicate(timeout=100)
    assert neg.returncode == 1, f"stdout:\n{out}\nstderr:\n{err}"
    assert "FAIL check_hit_positive" in out and f"cause: {Cause.ROUTER_EAGLE_OFF.value}" in out, out
    assert not pids_with_env(RUN_MARKER_ENV, str(live_run_dir / "neg"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_live_up_interrupted_tears_everything_down(live_run_dir, cpu_live_stack, sig):
    run_dir = live_run_dir / "held"
    with _held_cluster(["--workers", "1"], run_dir, ready_s=90) as proc:
        started = pids_with_env(RUN_MARKER_ENV, str(run_dir))
        assert len(started) == 3, f"expected broker + worker + frontend, found pids {started}"
        proc.send_signal(sig)
        proc.wait(timeout=90)
        assert not pids_with_env(RUN_MARKER_ENV, str(run_dir)), "processes survived the interrupted CLI"


@pytest.mark.timeout(300)
def test_real_engine_live_up_terminated_tears_every_process_down(live_run_dir, sglang_cpu_engine):
    """``dynamo.sglang`` ignores SIGTERM for seconds and forks SGLang's scheduler and
    detokenizer: a terminated ``kvalign live up --engine sglang-cpu`` must still leave nothing."""
    run_dir = live_run_dir / "real"
    with _held_cluster(["--engine", "sglang-cpu", "--workers", "1"], run_dir, ready_s=240) as proc:
        started = run_pids(RUN_MARKER_ENV, str(run_dir))
        names = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] for p in started}
        assert {b"sglang::scheduler", b"sglang::detokenizer"} <= names, f"SGLang's children not found: {names}"
        groups = {os.getpgid(p) for p in started}
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert not run_pids(RUN_MARKER_ENV, str(run_dir)), "processes survived the terminated CLI"
        assert not [g for g in groups if group_alive(g)], "a process group survived the terminated CLI"
