"""``kvalign e2e fuzz`` on bad input: one clear line, exit 2, no traceback, no cluster started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts the CLI in a child process (about 2 s)


def kvalign(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvalign", "e2e", "fuzz", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, says", [
    (["--examples", "0"], "--examples and --steps must be >= 1"),
    (["--engine", "fake-cpu"], "cannot run here: --engine fake-cpu"),
    (["--replay", "/nonexistent/script.json"], "cannot read /nonexistent/script.json"),
    (["--sglang", "0.4.0"], "supports sglang 0.5.19, 0.5.21, 0.5.23, not sglang 0.4.0"),
    (["--workers", "1", "--topology", "disagg"], "the fuzz needs at least 2 workers"),
    (["--spec-window", "0"], "--spec-window must be >= 1, got 0"),
])
def test_bad_arguments_fail_in_one_line(args: list[str], says: str) -> None:
    p = kvalign(*args)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


@pytest.mark.parametrize("content", ["{not json", '{"steps": []}', '[1, 2]', '{"kvalign_fuzz_script": 1, "steps": 3}'])
def test_a_file_that_is_not_a_fuzz_script_is_refused(tmp_path: Path, content: str) -> None:
    f = tmp_path / "s.json"
    f.write_text(content)
    p = kvalign("--replay", str(f))
    assert p.returncode == 2 and "is not a kvalign fuzz script" in p.stderr and "Traceback" not in p.stderr
    assert f.read_text() == content  # never rewritten
