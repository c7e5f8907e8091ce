"""Where a finding's source line is: the first line of a release's file holding a given text. One search for both
engines' reports (SGLang's and Dynamo's files in this interpreter, vLLM's in its own environment's directory), so a
release where the text moved says so the same way in each."""

from __future__ import annotations

from pathlib import Path


def find_text(file: Path, text: str) -> tuple[int, str] | str:
    """``(line number, the line stripped)`` of the first line of ``file`` holding ``text``, or why none is."""
    if not file.is_file():
        return "file not in this release"
    for i, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if text in line:
            return i, line.strip()
    return "text not found in this release"
