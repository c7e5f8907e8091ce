"""``kvalign matrix --engine vllm``'s options (kvalign/commands/matrix_vllm.py): SGLang-only options refused,
bad versions and counts one line with exit 2, and the command the README's table names."""

from __future__ import annotations

import pytest

from kvalign.cli import build_parser, main
from kvalign.commands.matrix_vllm import reproduce


@pytest.mark.parametrize("argv, message", [
    (["--sglang", "0.5.23"], "--sglang: SGLang's matrix only, not with --engine vllm"),
    (["--live"], "--live: SGLang's matrix only"),
    (["--property", "hash"], "--property: SGLang's matrix only"),
    (["--event-format", "both"], "--event-format: SGLang's matrix only"),
    (["--vllm", "0.33.x"], "--vllm takes comma-separated release versions"),
    (["--examples", "0"], "--examples must be >= 1, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc = main(["matrix", "--engine", "vllm", "--dynamo", "1.6.1", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_vllm_releases_without_engine_vllm_is_a_usage_error(capsys):
    assert main(["matrix", "--dynamo", "1.6.1", "--vllm", "0.33.0"]) == 2
    assert "--vllm names vLLM releases: it goes with --engine vllm" in capsys.readouterr().err


def test_the_table_s_command_reproduces_the_run_and_parses():
    command = reproduce(["1.6.1", "1.5.1"], ["0.33.0"], True, None)
    assert command == "kvalign matrix --engine vllm --dynamo 1.6.1,1.5.1 --vllm 0.33.0 --shipped --markdown"
    args = build_parser().parse_args(command.split()[1:])
    assert (args.engine, args.dynamo, args.vllm, args.shipped, args.markdown) == ("vllm", "1.6.1,1.5.1", "0.33.0",
                                                                                  True, True)
    assert reproduce(None, None, False, 7) == "kvalign matrix --engine vllm --examples 7 --markdown"
    # the matrix's own default (5 cases per row) is what a command without --examples runs: left out
    assert reproduce(None, None, False, 5) == "kvalign matrix --engine vllm --markdown"
    assert reproduce(["1.6.1"], None, True, None, True) == "kvalign matrix --engine vllm --dynamo 1.6.1 --shipped --all --markdown"


def test_vllm_pairs_run_one_at_a_time_unless_jobs_is_given(monkeypatch):
    """Two Dynamo 1.6.1 vLLM checks at once exceed Linux's 128 inotify instances per user: the default is 1;
    SGLang's matrix keeps 2."""
    from kvalign.verify.report import matrix_vllm

    seen: dict[str, int] = {}

    def stop(pairs, *, examples, jobs, all_props, **_kw):
        seen.update(jobs=jobs, examples=examples, all_props=all_props)
        return []

    monkeypatch.setattr(matrix_vllm, "run_matrix", stop)
    monkeypatch.setattr(matrix_vllm, "shipped_vllm", lambda d, log=None: "0.31.0")
    for argv, jobs in ([], 1), (["--jobs", "3"], 3):
        main(["matrix", "--engine", "vllm", "--dynamo", "1.6.1", "--shipped", *argv])
        assert seen == {"jobs": jobs, "examples": matrix_vllm.EXAMPLES, "all_props": False}


def test_all_runs_each_pairs_opt_in_vllm_properties_and_the_table_says_what_did_not_run(monkeypatch, capsys):
    """--all is each pair's check --all (vLLM's bytes block hashes); without it the line under the table names them."""
    from kvalign.verify.report import matrix_vllm

    seen: list[bool] = []
    monkeypatch.setattr(matrix_vllm, "run_matrix", lambda pairs, *, all_props, **_kw: seen.append(all_props) or [])
    monkeypatch.setattr(matrix_vllm, "shipped_vllm", lambda d, log=None: "0.31.0")
    main(["matrix", "--engine", "vllm", "--dynamo", "1.6.1", "--shipped", "--markdown"])
    default = capsys.readouterr().out
    main(["matrix", "--engine", "vllm", "--dynamo", "1.6.1", "--shipped", "--all", "--markdown"])
    everything = capsys.readouterr().out
    assert seen == [False, True]
    assert "not run: vllm_bytes (--all runs every property)" in default and "not run" not in everything
    assert everything.rstrip().endswith("`kvalign matrix --engine vllm --dynamo 1.6.1 --shipped --all --markdown`")
