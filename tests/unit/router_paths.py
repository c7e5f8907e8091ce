"""Opening the real relay -> router path in a test: the path, or a skip that says why it cannot run here."""

from __future__ import annotations

from typing import Any

import pytest

from kvalign.oracles.base import OracleUnavailable


def open_router_path(why: str, *args: Any) -> Any:
    """``RouterPath(*args)``, or a skip naming ``why`` and the runtime's own reason."""
    from kvalign.oracles.router_path import RouterPath

    try:
        return RouterPath(*args)
    except OracleUnavailable as exc:
        pytest.skip(f"{why}: {exc}")
