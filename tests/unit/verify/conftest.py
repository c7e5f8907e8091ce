"""Fixtures the verify tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvalign.oracles.base import OracleUnavailable


@pytest.fixture(scope="module")
def hicache_router_path(sglang_available: str) -> Iterator[Any]:
    """The real relay -> router path, for a SGLang whose host tier kvalign's HiCache stand-in covers (else skip)."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    try:
        path = RouterPath()
    except OracleUnavailable as exc:
        pytest.skip(f"real Dynamo router path unavailable: {exc}")
    yield path
    path.close()
