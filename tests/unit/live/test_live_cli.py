"""``kvalign live`` argument handling and dry run (no process is started)."""

from __future__ import annotations

import pytest

from kvalign.cli import main


def test_plan_prints_every_process_loopback_only(tmp_path, capsys):
    assert main(["live", "plan", "--prefill", "2", "--decode", "1", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line[2:] for line in out.splitlines() if line.startswith("# ")] == ["broker", "prefill0", "prefill1", "decode0", "frontend"]
    assert "--router-mode kv" in out and "--http-host 127.0.0.1" in out and "0.0.0.0" not in out
    assert out.count("--speculative-algorithm EAGLE3") == 3 and "--register-eagle" not in out


def test_negative_control_and_plain_flags_reach_the_workers(tmp_path, capsys):
    assert main(["live", "plan", "--workers", "1", "--register-eagle", "off", "--run-dir", str(tmp_path)]) == 0
    assert "--register-eagle off" in capsys.readouterr().out
    assert main(["live", "plan", "--workers", "1", "--no-eagle", "--run-dir", str(tmp_path / "b")]) == 0
    assert "--speculative-algorithm" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--workers", "0"], "--workers must be >= 1"),
    (["--prefill", "1", "--decode", "0"], "needs --prefill >= 1 and --decode >= 1"),
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--register-eagle", "maybe"], "invalid choice"),
])
def test_bad_arguments_are_one_line_exit_2(tmp_path, capsys, argv, msg):
    assert main(["live", "plan", *argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvalign: error: ") and msg in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()  # nothing created for a rejected command
