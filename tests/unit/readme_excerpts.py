"""README.md's output excerpts, held to what their commands print.

An excerpt is a fenced block whose first line is ``$ COMMAND``; a ``...`` line stands for lines
left out. The printed output must hold every other line, in order, numbers and column padding aside
(timings and case counts move with the machine and with the strategies).
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)


def excerpt(command: str) -> list[str]:
    """The README's shown output of ``$ command`` (its lines after the command)."""
    for m in FENCE.finditer(README.read_text()):
        lines = m.group(2).splitlines()
        if lines and lines[0] == f"$ {command}":
            return lines[1:]
    raise LookupError(f"README.md shows no output of $ {command}")


def _normalized(line: str) -> str:
    """Numbers as N, runs of spaces as one (a table's columns widen with its numbers)."""
    return re.sub(r"\s+", " ", re.sub(r"\d+(\.\d+)?", "N", line)).strip()


def missing(command: str, printed: str) -> list[str]:
    """The excerpt's lines that the printed output lacks (in order, numbers aside): [] when it holds."""
    actual = iter(_normalized(ln) for ln in printed.splitlines())
    return [ln for ln in excerpt(command) if ln.strip() not in ("...", "") and _normalized(ln) not in actual]
