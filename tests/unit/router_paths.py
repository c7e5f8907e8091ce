"""Opening the real relay -> router path in a test: the path, or a skip that says why it cannot run here.

Under ``KVALIGN_REQUIRE_REAL_PATHS=1`` (``.ci/run``: its set-up installs Dynamo's runtime) that skip is
a failure naming the same reason, so a run whose real-path tests all skipped cannot pass having
checked nothing; the GPU tests' ``KVALIGN_REQUIRE_GPU`` (tests/gpu_skip.py) does the same for theirs.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvalign.oracles.base import OracleUnavailable

#: Set where the router path must start: there a real-path test that cannot start it fails.
REQUIRE_ENV = "KVALIGN_REQUIRE_REAL_PATHS"


def open_router_path(why: str, *args: Any) -> Any:
    """``RouterPath(*args)``, or a skip naming ``why`` and the runtime's own reason (a failure under
    ``KVALIGN_REQUIRE_REAL_PATHS=1``)."""
    from kvalign.oracles.router_path import RouterPath

    try:
        return RouterPath(*args)
    except OracleUnavailable as exc:
        reason = f"{why}: {exc}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1, but the real router path cannot start: {reason}", pytrace=False)
    pytest.skip(reason)
