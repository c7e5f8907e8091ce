"""``kvalign check`` and ``kvalign hash`` as a user runs them (in-process ``main``)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvalign.cli import main
from kvalign.releases.versions import installed_versions

pytestmark = pytest.mark.usefixtures("cli_parser")  # main() runs 25 times in this module


def run_cli(capsys, *argv: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


#: The only lines `kvalign check` may write to stderr on an aligned pair: one progress line per row.
PROGRESS = re.compile(r"^  (card|advertised|hash|pages|overlap|ingest|tenants|tier|servable|dp)/(plain|eagle)/[a-z0-9_+-]+: "
                      r"(ok|n/a|credit-skew: HOST_CREDIT_NOT_SERVABLE)(; \d+ LAST_PAGE_CAPPED apart)? "
                      r"\(\d+ cases, \d+\.\ds\)$")
#: The widest line `kvalign check` prints (kvalign/commands/check_text.py), on stdout and stderr alike.
WIDTH = 100


#: ``check`` in the test's own process, where SGLang and Dynamo are already imported: the default
#: (a worker per core) would fork two workers that open their own router paths, for no parallelism
#: in a fast tier whose xdist workers already fill both cores (with the fork server the pool had
#: before, about 9 s of CPU per run). ``test_check_json_report`` runs in-process too: with the pool it
#: cost 12.9 s of CPU (cgroup, the fork server's SGLang import most of it), in-process 1.8 s. The pool
#: is ``tests/unit/verify/runner/test_pool.py``'s (``slow``: the same rows as ``--jobs 1``, a failing
#: worker named).
IN_PROCESS = ("--jobs", "1")

PROPS = ("card", "advertised", "hash", "pages", "overlap", "ingest", "tenants", "tier", "servable", "dp")


def wide_lines(*texts: str) -> list[str]:
    """Lines over WIDTH columns, but for a line that is one path alone: check puts the log's path on a
    line of its own because it cannot be wrapped, and its length is the user's (here pytest's tmp dir)."""
    return [ln for text in texts for ln in text.splitlines()
            if len(ln) > WIDTH and not (len(ln.split()) == 1 and ln.strip().startswith("/"))]


@pytest.mark.slow  # the whole check as a user runs it; each property's negative control stays in the fast tier
def test_check_real_pair_is_aligned_but_for_small_hicache_pages_and_quiet(router_hasher, sglang_available, tmp_path,
                                                                        capfd, monkeypatch):
    # In a subprocess, as a user runs it: the ingest rows start a Dynamo runtime, and the first runtime of
    # a process owns its TCP server (tests/unit/live/test_live_discovery.py needs to own it in this one).
    # DYN_LOG is unset so that Dynamo logs at its own default level, as for a user.
    root = Path(__file__).resolve().parents[4]
    env = {k: v for k, v in os.environ.items() if k != "DYN_LOG"}
    env.update(PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), KVALIGN_LOG_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "kvalign", "check", "--examples", "15"], capture_output=True, text=True,
                         timeout=600, cwd=root, env=env)
    rc, out = res.returncode, res.stdout
    # every page size the strategies draw: the servable rows find HOST_CREDIT_NOT_SERVABLE at page 2 or 4, a
    # credit skew (the keys agree): an advisory with its bound and measured routing impact, exit 0
    assert rc == 0, out + res.stderr[-2000:]
    verdict = next(i for i, ln in enumerate(out.splitlines()) if ln.startswith(("ALIGNED", "MISALIGNED: ")))
    verdict = " ".join(ln.strip() for ln in out.splitlines()[verdict:])
    # the default leaves the opt-in properties out, and its verdict says so: never a bare "ALIGNED: ..."
    assert verdict.startswith("ALIGNED for deployments without image prompts, hybrid models or a storage tier ")
    assert "0 of 63 rows cache-blind, 2 credit-skew (advisory), 1 n/a" in verdict
    assert "not run: mm, hybrid, storage (--all runs every property)" in verdict
    assert "HOST_CREDIT_NOT_SERVABLE holds only with HiCache on and page sizes below" in verdict
    # card x 2 modes + advertised (9 rows, plain; its "other" row is n/a: the dLLM override) + (hash, pages,
    # overlap, ingest, tier) x 2 modes x 4 variants + tenants x 2 modes x 3 variants + dp x 4 layouts: ok;
    # servable x 2 modes: the advisory
    results = [ln.split(None, 5)[5] for ln in out.splitlines() if ln.split()[:1] and ln.split()[0] in PROPS
               and len(ln.split()) > 5]
    assert sum(r.startswith("ok") for r in results) == 61, out
    assert "n/a (did not run) advertised/plain/other: overrides.py's _dllm_page_size" in out
    assert [ln.split()[0] for ln in out.splitlines() if "  credit-skew: HOST_CREDIT_NOT_SERVABLE" in ln
            and ln.startswith("servable ")] == ["servable", "servable"]
    assert [ln.split()[0] for ln in out.splitlines() if ln.endswith(" ok")].count("ingest") == 8
    # the cause explained once, under the table, with its class, scope and counterexample; then the advisory
    assert out.count("\nHOST_CREDIT_NOT_SERVABLE (credit-skew): router credits host-tier pages") == 1
    assert "  rows: servable/plain/base, servable/eagle/base" in out and "  scope: holds only with HiCache on" in out
    assert "  counterexample (servable/plain/base): page size " in out and "    shrunk: {'page_size': " in out
    flat = " ".join(out.split())
    assert "advisory (credit-skew, exit 0; --strict fails on it): HOST_CREDIT_NOT_SERVABLE in" in flat
    assert "SGLang's load_back_threshold 10: at most 9 at any page size" in flat and "the router changes the worker" in flat
    assert "partly checked advertised/plain/default:" in flat and "not checked (kvalign's platform stand-in: xpu" in flat
    assert wide_lines(out, res.stderr) == []
    # README.md's excerpt of `kvalign check` is this output (numbers aside: it ran with 200 examples;
    # the tier and servable rows draw at most 12 runs either way, so their lines are the same)
    import readme_excerpts

    assert readme_excerpts.missing(".venv/bin/kvalign check", out) == []
    # quiet: stderr holds kvalign's progress lines only; the runtimes' own lines are in the kept log (a run
    # that exits 0 does not name it)
    lines = res.stderr.splitlines()
    assert not any(ln.startswith("kvalign: Dynamo and SGLang runtime logs:") for ln in lines), res.stderr
    lines = " \n".join(lines).replace(" \n    ", " ").split(" \n")  # a progress line wrapped at 100 columns
    assert len(lines) == 64 and all(PROGRESS.match(ln) for ln in lines), res.stderr
    # --strict: the same run's advisory fails it. In this process, where SGLang and Dynamo are imported (a child
    # cost about 8 CPU-s more, its start-up): the servable rows open the in-process router path the fast tier's
    # tier tests open, and their one job runs in the process whatever --jobs says, as it did in a child (capfd: the
    # path's start-up watchdog, faulthandler, writes to stderr's file descriptor)
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))
    rc, strict, _ = run_cli(capfd, "check", "--examples", "15", "--strict", "--property", "servable", "--mode", "plain")
    assert rc == 1 and "\nMISALIGNED: " in strict, strict[-2000:]
    assert all(log.name.startswith("check-") and log.stat().st_size for log in tmp_path.iterdir())


def test_check_catches_router_that_ignores_is_eagle(capsys, router_hasher, sglang_available):
    rc, out, err = run_cli(capsys, "check", *IN_PROCESS, "--examples", "15", "--router-hash", "kvalign.verify.misaligned:ignore_eagle",
                         "--property", "hash", "--property", "pages", "--property", "overlap")
    assert rc == 1
    rows = [line.split() for line in out.splitlines() if line.startswith(("hash ", "pages ", "overlap "))]
    assert {r[1] for r in rows if "cache-blind:" in r} == {"eagle"}  # plain mode is genuinely aligned
    assert {r[-1] for r in rows if "cache-blind:" in r} == {"ROUTER_EAGLE_OFF"}  # the short name in the table
    # the cause once under the table, with its class, rows, scope and shrunk counterexample; no line past 100 columns
    assert out.count("\nROUTER_EAGLE_OFF (cache-blind): router eagle off vs engine bigram keys\n") == 1
    assert "\nMISALIGNED: " in out and " rows cache-blind" in out
    assert "  scope: these rows, at every page size the strategies draw" in out and "    shrunk: {" in out
    assert wide_lines(out, err) == []


def test_page_size_pins_every_generated_case(capsys, router_hasher, sglang_available):
    """``--page-size 3`` (a size the strategies rarely draw): the negative control still fails, and its
    shrunk counterexample is at page 3, so the flag reaches the generated cases."""
    rc, out, _ = run_cli(capsys, "check", *IN_PROCESS, "--examples", "15", "--json", "--page-size", "3", "--mode", "eagle",
                         "--router-hash", "kvalign.verify.misaligned:ignore_eagle", "--property", "hash")
    report = json.loads(out)
    assert rc == 1 and report["page_size"] == 3 and report["exit"] == 1 and report["aligned"] is False
    assert [r["counterexample"]["block_size"] for r in report["rows"]] == [3] * 4
    assert {r["cause_name"] for r in report["rows"]} == {"ROUTER_EAGLE_OFF"}
    assert {(r["class"], r["status"]) for r in report["rows"]} == {("cache-blind", "finding")}


def test_event_format_both_runs_event_properties_per_format(capsys, router_hasher, sglang_available):
    """``--event-format both``: every row says its format; a property that reads events has rows in both,
    one that does not (hash) runs once as "any"; the dynamo rows say so in the table too."""
    rc, out, _ = run_cli(capsys, "check", *IN_PROCESS, "--examples", "5", "--json", "--event-format", "both", "--property", "hash",
                         "--property", "pages", "--mode", "plain")
    report = json.loads(out)
    assert rc == 0 and report["event_formats"] == ["default", "dynamo"]
    by = {(r["prop"], r["event_format"]) for r in report["rows"]}
    assert by == {("hash", "any"), ("pages", "default"), ("pages", "dynamo")}
    assert all(r["mismatches"] == 0 for r in report["rows"])
    rc, out, _ = run_cli(capsys, "check", *IN_PROCESS, "--examples", "5", "--event-format", "dynamo", "--property", "pages",
                         "--mode", "plain")
    assert rc == 0 and "pages     plain  lora [dynamo]" in out


def test_a_release_without_the_dynamo_format_is_said():
    from kvalign.commands.check import formats_to_run
    from kvalign.errors import UsageError

    assert formats_to_run("both", True, "0.5.23") == ("default", "dynamo")
    assert formats_to_run("both", False, "0.5.21") == ("default", "dynamo")  # its dynamo rows: skipped, with why
    with pytest.raises(UsageError, match="SGLang 0.5.21 has no \"dynamo\" KV-event format"):
        formats_to_run("dynamo", False, "0.5.21")


def test_check_json_report(capsys, router_hasher, sglang_available):
    rc, out, _ = run_cli(capsys, "check", "--examples", "20", "--json", "--property", "overlap", *IN_PROCESS,
                         "--router-hash", "kvalign.verify.misaligned:drop_namespace")
    report = json.loads(out)
    assert rc == 1 and report["aligned"] is False
    assert report["versions"] == installed_versions() and set(report["versions"]) == {"kvalign", "ai-dynamo-runtime", "sglang", "torch"}
    bad = [r for r in report["rows"] if r["mismatches"]]
    assert bad and all(r["variant"] in ("namespace", "lora+namespace") for r in bad)
    assert {r["cause"] for r in bad} == {"cache namespace (cache_salt) dropped from the hash seed"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--router-hash", "nosuchmodule:fn"], "cannot import router hasher module 'nosuchmodule'"),
        (["check", "--router-hash", "kvalign.model.hashing"], "must look like MODULE:FUNCTION"),
        (["check", "--router-hash", "kvalign.model.hashing:nope"], "has no callable 'nope'"),
        (["check", "--examples", "0"], "--examples must be >= 1"),
        (["check", "--ingest-examples", "0"], "--ingest-examples must be >= 1"),
        (["check", "--dp-examples", "0"], "--dp-examples must be >= 1"),
        (["check", "--property", "prefill"], "invalid choice: 'prefill'"),
        (["check", "--cache", "bogus"], "invalid choice: 'bogus'"),
        (["check", "--page-size", "0"], "--page-size: must be >= 1, got 0"),
        (["check", "--page-size", "-4"], "--page-size: must be >= 1, got -4"),
        (["check", "--page-size", "4.5"], "--page-size: expected a positive integer, got '4.5'"),
        (["check", "--page-size", "x"], "--page-size: expected a positive integer, got 'x'"),
    ],
)
def test_check_usage_errors_are_one_line_exit_2(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("kvalign: error: ")


def test_hash_command_matches_router(capsys, monkeypatch, router_hasher):
    toks = list(range(1, 40))
    rc, out, _ = run_cli(capsys, "hash", "--block-size", "4", "--eagle", "--lora", "L", "--namespace", "ns",
                         stdin=json.dumps(toks), monkeypatch=monkeypatch)
    assert rc == 0 and json.loads(out) == router_hasher(toks, 4, None, "L", True, "ns")
    rc, out, _ = run_cli(capsys, "hash", "--block-size", "4", "--sequence", stdin="[1,2,3,4,5,6,7,8]", monkeypatch=monkeypatch)
    from kvalign.model.hashing import block_hashes, sequence_hashes

    assert rc == 0 and json.loads(out) == sequence_hashes(block_hashes(list(range(1, 9)), 4))


@pytest.mark.parametrize(
    ("stdin", "argv", "message"),
    [
        ("[1, -2]", ["--block-size", "4"], "token at position 1 is out of the u32 range"),
        ("[4294967296]", ["--block-size", "4"], "token at position 0 is out of the u32 range"),
        ("[1, 2.5]", ["--block-size", "4"], "token at position 1 is not an integer"),
        ("[1, 2", ["--block-size", "4"], "stdin is not JSON"),
        ('{"a": 1}', ["--block-size", "4"], "must be a JSON list"),
        ("[1, 2]", ["--block-size", "0"], "block size must be in [1, 2^32-1], got 0"),
    ],
)
def test_hash_bad_input_is_one_line_exit_2(capsys, monkeypatch, stdin, argv, message):
    rc, out, err = run_cli(capsys, "hash", *argv, stdin=stdin, monkeypatch=monkeypatch)
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


def test_a_mismatch_that_does_not_recur_is_replayed_and_unconfirmed_with_its_rate():
    """A relay that drops a batch once and not on replay (issue 46): the failing example is run again at
    once, does not fail, and the search goes on; with nothing else found, the mismatch is returned
    unconfirmed with its rate over REPLAYS replays, and no example counts as failing."""
    from hypothesis import strategies as st

    from kvalign.model.causes import Cause
    from kvalign.verify.runner.check import run_search
    from kvalign.verify.engine.properties import Mismatch
    from kvalign.verify.engine.search import REPLAYS

    calls: list[int] = []

    def body(x: int) -> None:  # fails on its first call only
        calls.append(x)
        if len(calls) == 1:
            raise Mismatch("ingest", "the router still holds 1 block(s) SGLang removed", Cause.INGEST_STALE, x)

    cases, failures, found = run_search(body, st.integers(0, 3), 5)
    assert found is not None and found.cause is Cause.INGEST_STALE and failures == 0 and cases > 1
    assert found.unconfirmed == f"recurred in 0 of {REPLAYS} replays of its example"
    assert calls[-(REPLAYS - 1):] == [found.example] * (REPLAYS - 1)

    seen: list[int] = []

    def real_after_flaky(x: int) -> None:  # a flaky mismatch first, then one that recurs: the real one is found
        seen.append(x)
        if len(seen) == 1:
            raise Mismatch("ingest", "stale", Cause.INGEST_STALE, x)
        if x == 3:
            raise Mismatch("ingest", "indexed without its cache_salt", Cause.TENANTS_SHARE_KEYS, x)

    _cases, failures, found = run_search(real_after_flaky, st.integers(0, 3), 50)
    assert found is not None and found.cause is Cause.TENANTS_SHARE_KEYS and found.unconfirmed is None
    assert failures == 1

    broken_calls: list[int] = []

    def broken(x: int) -> None:  # a harness bug that does not recur is still a crash, not a row
        broken_calls.append(x)
        if len(broken_calls) == 1:
            raise KeyError("not a mismatch")

    with pytest.raises(Exception, match="not a mismatch|Flaky|flaky"):
        run_search(broken, st.integers(0, 3), 5)
