"""Why Dynamo's ``shared_cache_type="hicache"`` route is not driven, held to the installed packages (issue 43).

The storage finding's routing impact is measured on Dynamo's per-worker tiers (``kvalign.verify.props.storage.impact``).
Dynamo 1.6.1 documents a second route for a store shared by workers: ``--shared-cache-type hicache``. The
reason kvalign gives for not driving it rests on facts of the installed wheels, checked here; the test then
skips with that reason, and fails where the reason stops holding (a ``mooncake`` module importable: the route
could then be driven and must be).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def test_the_shared_cache_route_is_not_driven_for_the_reason_it_says() -> None:
    from kvalign.verify.props.storage.impact import HICACHE_ROUTE_SKIPPED

    spec = importlib.util.find_spec("dynamo.sglang.register")
    if spec is None or spec.origin is None:
        pytest.skip("dynamo.sglang is not installed here")
    register = Path(spec.origin).read_text(encoding="utf-8")
    # the router's layout for the store comes only from a mooncake backend's registration
    assert 'SGLANG_HICACHE_MOONCAKE_RUNTIME_KEY = "sglang_hicache_mooncake"' in register
    assert '"hicache_storage_backend", None) != "mooncake"' in register
    assert "DYN_MOONCAKE_KV_EVENTS_ENDPOINT" in register
    import dynamo._core as core

    assert "shared_cache_type" in (core.KvRouterConfig.__text_signature__ or "")
    core.KvRouterConfig(shared_cache_type="hicache")  # the route exists in the installed router
    if importlib.util.find_spec("mooncake") is not None:
        pytest.fail("a mooncake module is importable here: the shared_cache_type=hicache route can be driven, and the "
                    f"reason kvalign gives for not driving it no longer holds: {HICACHE_ROUTE_SKIPPED}")
    pytest.skip(HICACHE_ROUTE_SKIPPED)


def test_the_default_threshold_trials_straddle_the_disk_credit() -> None:
    """At SGLang's default prefetch_threshold the stretch is too many pages to route every k: the k kept are
    none, one, either side of where pages x weight equals k, all but one and all."""
    from kvalign.verify.props.storage.impact import default_threshold_ks

    assert default_threshold_ks(64, 0.25) == [0, 1, 16, 17, 63, 64]
    assert default_threshold_ks(2, 0.25) == [0, 1, 2]
