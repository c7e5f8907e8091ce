"""Errors the CLI turns into one line on stderr and exit code 2 (never a traceback).

A leaf every layer may import: the stand-ins raise :class:`OracleUnavailable` too, below the
oracles that re-export it.
"""


class UsageError(Exception):
    """Bad input or environment: the message is the whole story for the user."""


class OracleUnavailable(RuntimeError):
    """A real system cannot be loaded here; the message says what to install."""
