"""``kvalign`` command line: one subcommand per module in :mod:`kvalign.commands`.

Exit codes are part of the interface: 0 aligned / success, 1 misaligned (a real finding),
2 usage or environment error, reported as a single line with no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvalign.errors import UsageError
from kvalign.model.events import EventDecodeError
from kvalign.oracles.base import OracleUnavailable
from kvalign.runtime_log import RuntimeLog, console
from kvalign.releases.versions import version_lines

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

#: What a command raises for bad input or a broken environment: one line, exit 2, no traceback.
USER_ERRORS = (UsageError, EventDecodeError, OracleUnavailable, ValueError, OSError)

#: Commands whose runtime logs (Dynamo's, SGLang's) go to a file unless ``--verbose`` is given.
QUIET_COMMANDS = ("check", "matrix", "diagnose", "capture", "replay", "watch")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit 2; keep it one line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvalign", description="Prove Dynamo's KV router and SGLang's radix cache key the same KV "
                     "blocks, and say where and why they stop agreeing.")
    parser.add_argument("--version", action="store_true",
                        help="print the kvalign, Dynamo runtime, SGLang and torch versions, one per line")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for name in QUIET_COMMANDS:
        sub.choices[name].add_argument("--verbose", action="store_true",
                                       help="show Dynamo's and SGLang's own log lines (default: they go to a log file)")
    return parser


def _one_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _run(args: argparse.Namespace, *, until_exit: bool) -> int:
    """Run the command; for a quiet command, with the runtimes' logs in a file named on failure."""
    if args.command not in QUIET_COMMANDS or args.verbose:
        return int(args.run(args))
    log = RuntimeLog(args.command, until_exit=until_exit)
    try:
        with log:
            code = int(args.run(args))
    except BrokenPipeError:
        raise
    except USER_ERRORS as exc:
        if log.path is None:
            raise
        raise UsageError(f"{_one_line(exc)} (runtime logs: {log.path})") from None
    if code != EXIT_OK and log.path is not None:
        line = f"kvalign: Dynamo and SGLang runtime logs: {log.path}"  # the path on a line of its own past 100 columns
        print(line if len(line) <= 100 else f"kvalign: Dynamo and SGLang runtime logs:\n  {log.path}", file=console(),
              flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """The ``kvalign`` command; ``argv`` None means this process is the command (``kvalign ...``)."""
    try:
        args = build_parser().parse_args(argv)
        if args.version:
            print("\n".join(version_lines()))
            return EXIT_OK
        if args.command is None:
            raise UsageError("a command is required (kvalign --help lists them)")
        code = _run(args, until_exit=argv is None)
        if argv is None and getattr(args, "quick_exit", False):
            _exit(code)
        return code
    except BrokenPipeError:  # e.g. `kvalign check --json | head`: the reader left, nothing to report
        console().close()
        return EXIT_OK
    except USER_ERRORS as exc:
        print(f"kvalign: error: {_one_line(exc)}", file=console())
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvalign: interrupted", file=console())
        return 130


def _exit(code: int) -> None:
    """The process's own command ends here. A command whose parser sets ``quick_exit`` (``check``: it
    owns no children or files that exit handlers must clean up) skips the interpreter's teardown of
    torch, SGLang and Dynamo, whose exit handlers took about 3 s after ``check --property card``'s
    report was printed; everything kvalign had to say is flushed first."""
    sys.stdout.flush()
    console().flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
