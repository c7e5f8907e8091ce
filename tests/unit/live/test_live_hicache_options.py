"""``--hicache [POLICY]`` / ``--hicache-ratio`` on ``live``, ``e2e run|plan`` and ``e2e fuzz``: where the flags
reach (the workers that cache prompts, never a decode worker) and bad input (one line, exit 2, nothing started)."""

from __future__ import annotations

import pytest

from kvalign.cli import main
from kvalign.live.engines.hicache import HiCache

FLAGS = "--enable-hierarchical-cache --hicache-write-policy write_back --hicache-ratio 3"


@pytest.mark.slow  # plans real-engine workers: builds the tiny models with torch
def test_the_host_tier_flags_reach_the_prefill_workers_only(tmp_path, capsys):
    assert main(["live", "plan", "--engine", "sglang-cpu", "--prefill", "2", "--decode", "1", "--hicache", "write_back",
                 "--hicache-ratio", "3", "--run-dir", str(tmp_path)]) == 0
    blocks = capsys.readouterr().out.split("# ")[1:]
    with_flags = sorted(b.split("\n")[0] for b in blocks if FLAGS in b)
    assert with_flags == ["prefill0", "prefill1"]
    assert not any("hierarchical" in b for b in blocks if b.startswith("decode0"))


@pytest.mark.slow  # plans real-engine workers: builds the tiny models with torch
def test_hicache_alone_is_sglangs_default_policy_on_aggregated_workers(tmp_path, capsys):
    assert main(["e2e", "plan", "--engine", "sglang-cpu", "--hicache"]) == 0
    out = capsys.readouterr().out
    assert "HiCache write_through (host pool 2x the device pool) on the prefill workers" in out
    assert out.count("--enable-hierarchical-cache") == 2  # the two prefill workers of the scenario
    assert main(["live", "plan", "--engine", "sglang-cpu", "--workers", "2", "--hicache", "--run-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("--hicache-write-policy write_through --hicache-ratio 2") == 2


@pytest.mark.slow  # plans real-engine workers: builds the tiny models with torch
def test_negative_control_without_the_flag_no_worker_gets_a_host_tier(tmp_path, capsys):
    assert main(["live", "plan", "--engine", "sglang-cpu", "--workers", "2", "--run-dir", str(tmp_path)]) == 0
    assert "hierarchical" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["live", "plan", "--engine", "fake-cpu", "--hicache"], "--hicache runs SGLang's host tier on the real engine"),
    (["live", "plan", "--engine", "sglang-cpu", "--hicache-ratio", "3"], "--hicache-ratio sizes the host tier: it needs --hicache"),
    (["live", "plan", "--engine", "sglang-cpu", "--hicache", "--hicache-ratio", "0"], "--hicache-ratio must be > 0"),
    (["live", "plan", "--engine", "sglang-cpu", "--hicache", "write_sometimes"], "invalid choice"),
    (["e2e", "plan", "--engine", "fake-cpu", "--hicache"], "it needs --engine sglang-cpu or sglang-gpu, not fake-cpu"),
    (["e2e", "fuzz", "--hicache-ratio", "2"], "--hicache-ratio sizes the host tier: it needs --hicache"),
    (["e2e", "fuzz", "--hicache", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["e2e", "fuzz", "--engine", "fake-cpu", "--hicache"], "cannot run here: --engine fake-cpu"),
])
def test_bad_hicache_input_is_one_line_exit_2_and_starts_nothing(tmp_path, capsys, argv, says):
    assert main([*argv, *(["--run-dir", str(tmp_path / "r")] if argv[0] == "live" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvalign: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_the_settings_describe_themselves_and_refuse_unknown_policies():
    assert HiCache().args() == ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
                                "--hicache-ratio", "2"]
    with pytest.raises(ValueError, match="--hicache takes a write policy of write_through"):
        HiCache("write_around")
