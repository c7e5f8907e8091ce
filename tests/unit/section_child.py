"""A child interpreter that runs named sections of test code in turn, so that several slow tests share one start.

The stand-in's children per SGLang release (``tests/unit/standins/standin_child.py``) and the child in Dynamo
1.0.2's environment (``tests/unit/oracles/release_probes.py``) each pay seconds of imports (SGLang, torch) before
their first section; every test that reads a section shares that start.

``python section_child.py FIRST_PATH SECTIONS_JSON``: ``FIRST_PATH`` replaces ``sys.path[0]`` (this file's
folder, which the sections must not import from by accident; the caller names the folder its sections did
import from when each was a script of its own), ``SECTIONS_JSON`` is ``{name: code}``. Each section runs in
turn in this one process, its stdout and any traceback kept apart, a failing one not stopping the next; the
last line of stdout is ``{name: {"out": ..., "error": ...}}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

#: the script a caller runs (``[python, SCRIPT, first_path, sections_json]``)
SCRIPT = str(Path(__file__).resolve())


def serve(sections: dict[str, str]) -> None:
    """Run each section, then print every section's stdout and traceback as one JSON line."""
    done = {}
    for name, code in sections.items():
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, name, "exec"), {"__name__": name})
            error = None
        except BaseException:  # noqa: BLE001 - reported as the section's failure, the next section still runs
            error = traceback.format_exc()
        done[name] = {"out": out.getvalue(), "error": error}
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    sys.path[0] = sys.argv[1]
    serve(json.loads(sys.argv[2]))
