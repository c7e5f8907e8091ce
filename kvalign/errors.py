"""Errors the CLI turns into one line on stderr and exit code 2 (never a traceback)."""


class UsageError(Exception):
    """Bad input or environment: the message is the whole story for the user."""
