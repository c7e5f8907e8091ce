"""Fixtures shared by the oracle tests."""

from __future__ import annotations

import pytest
from release_probes import Probes


@pytest.fixture(scope="session")
def dynamo_1_0_2() -> tuple[str, dict[str, str]]:
    """(python, env) of Dynamo 1.0.2's release environment beside the installed SGLang 0.5.23, installed into the wheel
    cache on first use (the matrix's own machinery); a skip naming why where it cannot be installed here."""
    from kvalign.verify.report.matrix import MatrixError, ensure_release, pair_env

    try:
        return pair_env(ensure_release("dynamo", "1.0.2"), None, "0.5.23")
    except MatrixError as exc:
        pytest.skip(f"ai-dynamo 1.0.2 cannot be installed here: {exc}")


@pytest.fixture(scope="session")
def dynamo_1_0_2_probes(dynamo_1_0_2: tuple[str, dict[str, str]]) -> Probes:
    """One child in Dynamo 1.0.2's environment running every probe the oracle files added (:mod:`release_probes`),
    once per session (``tests/xdist_scopes.py`` keeps those files on one worker)."""
    return Probes(*dynamo_1_0_2)
