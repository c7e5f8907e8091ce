"""GPU tests on a machine without the GPUs: skipped with the reason, and no child process started."""

from __future__ import annotations

import subprocess

from gpu_skip import skip_reason

from kvalign.live.engines import gpu

SMI = "0, GPU-11111111-aaaa-bbbb-cccc-000000000000, NVIDIA H200, 143771\n"


def _no_children(monkeypatch):
    started = []
    real_run = subprocess.run

    def run(argv, *a, **kw):
        if argv and argv[0] != "nvidia-smi" and "nvidia-smi" not in str(argv[0]):
            started.append(argv)
        return real_run(argv, *a, **kw)

    monkeypatch.setattr(gpu.subprocess, "run", run)
    return started


def test_without_gpus_the_reason_names_them_and_no_import_child_starts(monkeypatch, tmp_path):
    started = _no_children(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    why = skip_reason(2, models=(str(tmp_path / "model"), str(tmp_path / "draft")))
    assert why is not None and why.startswith("needs 2 NVIDIA GPUs, none visible: nvidia-smi not found")
    assert f"model {tmp_path / 'model'}: no such path" in why and "checked only where the GPUs are" in why
    assert started == []


def test_with_enough_gpus_the_test_runs_its_own_full_check(monkeypatch):
    monkeypatch.setattr(gpu, "visible_gpus", lambda: (gpu.parse_nvidia_smi(SMI * 2), None))
    assert skip_reason(2, models=("/nonexistent/m", "/nonexistent/d")) is None
    monkeypatch.setattr(gpu, "visible_gpus", lambda: (gpu.parse_nvidia_smi(SMI), None))
    assert skip_reason(2, models=("/nonexistent/m", "/nonexistent/d")).startswith("needs 2 NVIDIA GPUs, 1 visible")
    assert skip_reason(1, models=("/nonexistent/m", "/nonexistent/d")) is None
    assert skip_reason(0) is None


def _skipped(reason: str) -> "pytest.TestReport":
    import pytest

    return pytest.TestReport("t.py::test_gpu", ("t.py", 1, "test_gpu"), {}, "skipped", ("t.py", 1, f"Skipped: {reason}"),
                             "setup")


def test_on_a_runner_that_must_have_gpus_a_skipped_gpu_test_fails_with_its_reason():
    from gpu_skip import REQUIRE_ENV, fail_if_required

    report = _skipped("needs 2 NVIDIA GPUs, none visible")
    fail_if_required(report, 2, {REQUIRE_ENV: "1"})
    assert report.failed and "needs 2 NVIDIA GPUs, none visible" in str(report.longrepr)
    # elsewhere (CI on CPU, a developer's machine) the skip stays a skip, and a test needing no GPU is never touched
    for needed, env in ((2, {}), (2, {REQUIRE_ENV: "0"}), (0, {REQUIRE_ENV: "1"})):
        report = _skipped("x")
        fail_if_required(report, needed, env)
        assert report.skipped
