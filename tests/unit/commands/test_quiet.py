"""Quiet by default: the runtimes' log lines go to a file, kvalign's own lines reach the terminal.

`check` as a user runs it (a subprocess, real runtimes) is held to this in
``test_check.py::test_check_real_pair_is_aligned_but_for_small_hicache_pages_and_quiet``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvalign import runtime_log
from kvalign.cli import main
from kvalign.runtime_log import RuntimeLog, console


def test_fd2_goes_to_the_log_and_kvalign_lines_to_the_console(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))
    with RuntimeLog("check") as log:
        os.write(2, b"ERROR dynamo_llm::kv_router: written by a runtime straight to fd 2\n")
        print("kvalign line", file=console(), flush=True)
    assert log.path is not None
    assert "written by a runtime" in log.path.read_text()
    err = capfd.readouterr().err
    assert "kvalign line" in err and "written by a runtime" not in err
    os.write(2, b"after the block\n")  # fd 2 is restored
    assert "after the block" in capfd.readouterr().err
    assert runtime_log.console() is sys.stderr


def test_an_empty_log_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))
    with RuntimeLog("replay") as log:
        pass
    assert log.path is None and list(tmp_path.iterdir()) == []


def test_a_failure_names_the_log(tmp_path, monkeypatch, capfd):
    """A command that fails after a runtime wrote to fd 2 says where that output went."""
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))
    capture = tmp_path / "missing.jsonl"

    def noisy_replay(args):
        os.write(2, b"a runtime complaint\n")
        raise FileNotFoundError(f"no such capture: {capture}")

    import kvalign.commands.replay as replay

    monkeypatch.setattr(replay, "run", noisy_replay)
    assert main(["replay", str(capture)]) == 2
    err = capfd.readouterr().err
    (logfile,) = tmp_path.iterdir()
    assert err.strip() == f"kvalign: error: no such capture: {capture} (runtime logs: {logfile})"
    assert logfile.read_text() == "a runtime complaint\n"


def test_version_prints_one_line_per_component(capsys):
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["kvalign", "dynamo-runtime", "sglang", "torch"]
    assert all(re.fullmatch(r"\S+ (\d+\.\d+\S*|not installed)", ln) for ln in lines), lines


def test_version_does_not_import_torch():
    code = "import sys; from kvalign.cli import main; main(['--version']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False"


def test_verbose_leaves_fd2_alone(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))

    def noisy_replay(args):
        os.write(2, b"a runtime line\n")
        return 0

    import kvalign.commands.replay as replay

    monkeypatch.setattr(replay, "run", noisy_replay)
    assert main(["replay", "x.jsonl", "--verbose"]) == 0
    assert "a runtime line" in capfd.readouterr().err
    assert list(tmp_path.iterdir()) == []
