"""Run inside a release pair's environment: a kvalign command, then where its release modules came from.

``python origins_child.py --root dynamo=DIR [--root sglang=DIR] -- check ...`` runs the command in
this process (its own output discarded) and prints one JSON line: its exit code, the ``dynamo.*`` /
``sglang.*`` modules it imported, and those loaded from outside their release directory
(:func:`kvalign.releases.namespaces.foreign`). Test-side: kvalign's releases layer may not import its CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", action="append", default=[], metavar="PACKAGE=DIR")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    roots = {name: Path(where) for name, _, where in (r.partition("=") for r in args.root)}
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from kvalign.cli import main as kvalign
    from kvalign.releases.namespaces import foreign

    with contextlib.redirect_stdout(io.StringIO()):
        code = kvalign(command)
    modules = sorted(m for m in sys.modules if m.partition(".")[0] in roots)
    print(json.dumps({"exit": code, "modules": modules, "foreign": foreign(dict(sys.modules), roots)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
