"""Errors the CLI turns into one line on stderr and exit code 2 (never a traceback).

A leaf every layer may import: the stand-ins raise :class:`OracleUnavailable` too, below the
oracles that re-export it.
"""


class UsageError(Exception):
    """Bad input or environment: the message is the whole story for the user."""


class OracleUnavailable(RuntimeError):
    """A real system cannot be loaded here; the message says what to install."""


class MissingValue(ValueError):
    """A value a real system should have given is absent: named, never read as 0, 1 or "ok" (exit 2)."""

    def __init__(self, field: str, where: str) -> None:
        super().__init__(f"{where} has no {field}: kvalign will not guess it")
        self.field = field
