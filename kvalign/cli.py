"""``kvalign`` command line: one subcommand per module in :mod:`kvalign.commands`.

Exit codes are part of the interface: 0 aligned / success, 1 misaligned (a real finding),
2 usage or environment error, reported as a single line with no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvalign.errors import UsageError
from kvalign.events import EventDecodeError
from kvalign.oracles.base import OracleUnavailable

# Each module exposes register(subparsers) -> None and sets a `run(args) -> int` default.
COMMAND_MODULES = [
    "kvalign.commands.capture",
    "kvalign.commands.replay",
    "kvalign.commands.diagnose",
    "kvalign.commands.watch",
    "kvalign.commands.check",
    "kvalign.commands.matrix",
    "kvalign.commands.report",
    "kvalign.commands.hash",
    "kvalign.commands.live",
    "kvalign.commands.e2e",
    "kvalign.commands.metrics",
]

EXIT_OK, EXIT_MISALIGNED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit 2; keep it one line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvalign", description="Prove Dynamo's KV router and SGLang's radix cache key the same KV "
                     "blocks, and say where and why they stop agreeing.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args))
    except BrokenPipeError:  # e.g. `kvalign check --json | head`: the reader left, nothing to report
        sys.stderr.close()
        return EXIT_OK
    except (UsageError, EventDecodeError, OracleUnavailable, ValueError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"kvalign: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvalign: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
