"""README.md stays a user's five minutes, and every command in it runs.

- Its size: at most 12 KiB.
- Its two set-up-and-run commands, exactly: the check (run here as written, in the slow tier, and
  its output held to the README's excerpt, no line past 100 columns), and the tests (``.ci/run``
  runs exactly that line).
- Its compatibility table: the ``--markdown`` output of the one command printed under it; the
  nightly runs that command and requires the same table.
- Its other commands: ``bash doc-run`` blocks, which ``test_docs.py`` runs; any other command line
  in a fence fails here, so a new one comes with a way to run it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import readme_excerpts

from kvalign.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
LIMIT = 12 * 1024
WIDTH = 100
CHECK_COMMAND = "./scripts/setup.sh && .venv/bin/kvalign check --page-size 16"
TEST_COMMAND = "./scripts/setup.sh && .venv/bin/python -m pytest"
TABLE_HEAD = "| dynamo | sglang | verdict | causes (properties) |"
#: The vLLM compatibility table's head (``kvalign matrix --engine vllm --markdown``)
VLLM_HEAD = "| dynamo | vllm | verdict | causes (properties) |"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"(?:^|&&\s*|\|\s*|^\$\s+)(\./scripts/setup\.sh|(?:\.venv/bin/)?(?:kvalign|python)\b.*)")


def _text() -> str:
    return README.read_text()


def _fences() -> list[tuple[str, str]]:
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(_text())]


def _commands(info: str, body: str) -> list[str]:
    """The command lines of a fence: every line of a ``bash`` block, ``$ `` lines of an output block."""
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return lines if info.startswith("bash") else [ln[2:] for ln in lines if ln.startswith("$ ")]


def _table(head: str = TABLE_HEAD) -> tuple[str, str]:
    """The compatibility table with this head as it stands in the README, and the command under it."""
    lines = _text().splitlines()
    start = lines.index(head)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("`kvalign matrix "))
    return "\n".join(lines[start:end + 1]), lines[end].strip("`")


def test_the_readme_fits_12_kib():
    size = len(README.read_bytes())
    assert size <= LIMIT, f"README.md is {size} bytes, over {LIMIT}: move detail to docs/"


def test_the_readme_has_its_two_commands_and_ci_runs_the_second():
    setup = [c for info, body in _fences() if info == "bash" for c in _commands(info, body)
             if c.startswith("./scripts/setup.sh")]
    assert setup == [CHECK_COMMAND, TEST_COMMAND]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == TEST_COMMAND


#: Fenced README commands that are not doc-run lines, and the test that runs each.
RUN_ELSEWHERE = {
    CHECK_COMMAND: "below, as written (slow)",
    CHECK_COMMAND.partition(" && ")[2]: "below, as written (slow): its output is the README's excerpt",
    TEST_COMMAND: ".ci/run (CI)",
    ".venv/bin/kvalign check": "tests/unit/verify/runner/test_check.py::test_check_real_pair_is_aligned_but_for_small_hicache_"
                               "pages_and_quiet, with --examples 15 (slow): its output holds the README's excerpt",
}


def test_every_command_in_the_readme_runs_in_a_test():
    """A fenced command is a doc-run line (test_docs.py runs it) or one of :data:`RUN_ELSEWHERE`."""
    elsewhere = set(RUN_ELSEWHERE)
    stray = [c for info, body in _fences() if info != "bash doc-run" for c in _commands(info, body)
             if c not in elsewhere]
    assert stray == [], f"README commands no test runs (put cheap ones in a ```bash doc-run block): {stray}"
    assert any(info == "bash doc-run" for info, _ in _fences())


@pytest.mark.parametrize("head, engine", [(TABLE_HEAD, "sglang"), (VLLM_HEAD, "vllm")], ids=["sglang", "vllm"])
def test_the_table_is_a_markdown_table_with_its_command_under_it(head, engine):
    table, command = _table(head)
    argv = shlex.split(command)
    assert argv[:2] == ["kvalign", "matrix"] and argv[-1] == "--markdown"
    args = build_parser().parse_args(argv[1:])
    assert args.markdown and args.merge is None and args.cell is None and args.engine == engine
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")][1:]
    assert rows and all(ln.count(" | ") == 3 and ln.endswith(" |") for ln in rows), rows


@pytest.mark.slow  # the README's check, as written: set-up (reused) and the whole check at page size 16, ~2 min
@pytest.mark.timeout(900)
def test_the_readme_s_check_command_runs_as_written_and_prints_what_the_readme_shows():
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("runs ./scripts/setup.sh, which reuses this checkout's .venv: only from that .venv's python")
    env = {k: v for k, v in os.environ.items() if k not in ("DYN_LOG", "PYTHONPATH")}  # as a user runs it
    res = subprocess.run(["bash", "-c", CHECK_COMMAND], cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wide = [ln for ln in (res.stdout + res.stderr).splitlines() if len(ln) > WIDTH]
    assert wide == [], wide
    lacking = readme_excerpts.missing(CHECK_COMMAND.partition(" && ")[2], res.stdout)
    assert lacking == [], f"README's check output is not what the command prints (numbers aside): {lacking}"
    assert all(ln.startswith(("[setup] ", "  ")) for ln in res.stderr.splitlines()), res.stderr  # progress only


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("head", [TABLE_HEAD, VLLM_HEAD], ids=["sglang", "vllm"])
def test_the_readme_table_is_what_its_command_prints(request, head):
    expr = request.config.getoption("markexpr") or ""
    if not (os.environ.get("KVALIGN_NIGHTLY") or "matrix" in expr or "nightly" in expr):
        pytest.skip("the README's release matrix: nightly only (select with -m matrix or KVALIGN_NIGHTLY=1)")
    table, command = _table(head)
    res = subprocess.run([sys.executable, "-m", "kvalign", *shlex.split(command)[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=7000,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert res.returncode in (0, 1), res.stderr[-3000:]
    assert res.stdout.strip() == table, "the README's table is not what its command prints now: paste the new one"


def test_an_excerpt_is_held_to_its_lines_in_order_numbers_aside():
    """The control of the excerpt check the slow tests apply."""
    command = CHECK_COMMAND.partition(" && ")[2]
    shown = [ln for ln in readme_excerpts.excerpt(command) if ln != "..."]
    printed = "\n".join(shown)
    assert readme_excerpts.missing(command, printed) == []
    assert readme_excerpts.missing(command, re.sub(r"\d", "7", printed)) == []  # other counts and timings
    assert readme_excerpts.missing(command, printed.replace("\nALIGNED", "\nMISALIGNED")) != []
    assert readme_excerpts.missing(command, "\n".join(reversed(shown))) != []


def test_the_release_findings_say_what_the_table_says():
    """Issue 36: docs/release-findings.md once headed an entry "1.5.1 and 1.6.1 with SGLang 0.5.23 are aligned on
    every piece but one" while the table listed two cache-blind DP causes for 1.5.1 x 0.5.23. A pair the table
    calls misaligned is never called aligned in an entry's heading there, and a cause the table does not mark
    reproduced live (from its recorded run) is never called reproduced live where the findings name it with its
    pair."""
    findings = (ROOT / "docs" / "release-findings.md").read_text()
    bullets = ["- " + b for b in re.split(r"\n- ", "\n" + findings)[1:]]
    headings = [m.group(1).replace("\n", " ") for b in bullets for m in [re.match(r"- \*\*(.*?)\*\*", b, re.S)] if m]
    table, _ = _table()
    for row in [ln for ln in table.splitlines() if ln.startswith("| ")][2:]:
        dynamo, sglang, verdict, causes = [c.strip() for c in row.strip("|").split("|")]
        sglang = sglang.strip("*").split()[0]
        for cause, notes in re.findall(r"([A-Z][A-Z_]+) \(([^)]*)\)", causes.split("; n/a:")[0]):
            if "reproduced live" not in notes:
                said = [b for b in bullets if cause in b and dynamo in b and sglang in b]
                assert not any(re.search(r"(?<!not )reproduced live", b) for b in said), (cause, dynamo, sglang)
        if verdict.startswith("misaligned"):
            claims = [h for h in headings if dynamo in h and sglang in h and re.search(r"\bare aligned|aligned on every", h)]
            assert not claims, f"{dynamo} x {sglang} is misaligned in the table, aligned in release-findings: {claims}"
