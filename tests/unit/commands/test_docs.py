"""The commands in README.md and docs/ run, and every kvalign command they show parses.

Convention (docs/development.md, "Commands in the docs"): a fenced block tagged ```` ```bash doc-run ````
holds commands the test runs, one per line, each expected to exit 0; they must be cheap (seconds).
Every other ``kvalign`` command line in a fence (``$ .venv/bin/kvalign ...`` in an output block,
or a line of a ``bash`` block) is parsed with kvalign's own argument parser, so a renamed or
removed flag fails here instead of in a reader's terminal.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
#: a kvalign command line: in a ``bash`` block any line that runs it, elsewhere only a ``$ `` line
IN_BASH = re.compile(r"(?:^|&&\s*|\|\s*)(?:\.venv/bin/)?kvalign\s+(.*)$")
PROMPTED = re.compile(r"^\$\s+(?:\.venv/bin/)?kvalign\s+(.*)$")
VENV = re.compile(r"(?<![\w/.])\.venv/bin/(kvalign|python)\b")


def _blocks() -> list[tuple[str, str, str]]:
    """(file, info string, body) for every fenced block in the docs."""
    return [(p.relative_to(ROOT).as_posix(), m.group(1).strip(), m.group(2))
            for p in DOCS for m in FENCE.finditer(p.read_text())]


def _lines(body: str) -> list[str]:
    return [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]


RUNNABLE = [(f, ln) for f, info, body in _blocks() if info == "bash doc-run" for ln in _lines(body)]
SHOWN = [(f, m.group(1)) for f, info, body in _blocks() if info != "bash doc-run"
         for ln in body.splitlines() if (m := (IN_BASH if info == "bash" else PROMPTED).search(ln.strip()))]


def _argv(rest: str) -> list[str]:
    """A shown command's arguments: comments, pipes, redirections and ``[optional]`` parts removed."""
    rest = re.sub(r"\s+#.*$", "", rest)
    rest = re.split(r"\s[|<>]|\s2>", rest)[0]
    rest = re.sub(r"\s\[[^\]]*\]", "", rest)
    return shlex.split(rest)


def test_the_docs_have_runnable_and_shown_commands():
    assert len(RUNNABLE) >= 4 and len(SHOWN) >= 10, (RUNNABLE, SHOWN)


@pytest.mark.parametrize(("doc", "command"), RUNNABLE, ids=[f"{f}: {c[:60]}" for f, c in RUNNABLE])
def test_documented_command_runs(doc, command):
    """Run as written, with this checkout's code and interpreter standing in for ``.venv/``."""
    python = shlex.quote(sys.executable)
    line = VENV.sub(lambda m: f"{python} -m kvalign" if m.group(1) == "kvalign" else python, command)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"{doc}: {command}\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(("doc", "rest"), SHOWN, ids=[f"{f}: {r[:60]}" for f, r in SHOWN])
def test_documented_kvalign_command_parses(cli_parser, doc, rest):
    argv = _argv(rest)
    if argv[:1] == ["--version"]:
        return
    args = cli_parser.parse_args(argv)  # raises UsageError (one line) on an unknown flag or value
    assert args.command == argv[0]


def test_a_misspelt_flag_is_caught(cli_parser):
    """Negative control: the parse check rejects what a stale doc would show."""
    from kvalign.errors import UsageError

    with pytest.raises(UsageError, match="unrecognized arguments: --exampels"):
        cli_parser.parse_args(_argv("check --exampels 5   # a typo"))
