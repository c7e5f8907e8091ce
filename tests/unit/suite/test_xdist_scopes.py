"""tests/xdist_scopes.py: the node id alone decides which tests share an xdist worker."""

from __future__ import annotations

import xdist_scopes
from xdist_scopes import FAKE_WORKERS, MM_ORACLES, REAL_ENGINE, scope


def test_a_unit_file_is_its_own_scope():
    assert scope("tests/unit/model/test_hashing.py::test_block_hashes_equal_router_binding[1]") == "tests/unit/model/test_hashing.py"


def test_real_engine_tests_share_one_scope_by_file_or_name():
    assert scope("tests/e2e/test_fuzz.py::TestShippedPair::test_lost_removal_fails_no_stale_credit") == REAL_ENGINE
    assert scope("tests/e2e/test_disagg_eagle.py::test_real_engine_cpu_routes_by_prefix_and_keeps_speculating") == REAL_ENGINE
    assert scope("tests/e2e/test_router_cpu_cli.py::test_real_engine_live_up_terminated_tears_every_process_down") == REAL_ENGINE


def test_other_live_tests_share_the_fake_worker_scope():
    for nodeid in ("tests/e2e/test_disagg_eagle.py::test_same_scenario_through_cpu_workers_passes",
                   "tests/e2e/test_router_cpu.py::test_prefix_requests_stick_to_one_worker_with_predicted_hit_rate[eagle]",
                   "tests/e2e/test_control_plane.py::test_prefix_requests_over_etcd_and_nats",
                   "tests/e2e/test_router_cpu_cli.py::test_live_up_interrupted_tears_everything_down[sigterm]"):
        assert scope(nodeid) == FAKE_WORKERS, nodeid
    # a name that merely mentions the engine later on is not a real-engine test
    assert scope("tests/e2e/test_router_cpu.py::test_fake_like_the_real_engine") == FAKE_WORKERS


def test_the_real_engine_goes_out_first():
    assert xdist_scopes.LIVE_SCOPES[0] == REAL_ENGINE


def test_the_multimodal_oracles_files_share_one_scope():
    """Their session fixture (a frontend process and SGLang's processor) then starts once."""
    for nodeid in ("tests/unit/oracles/test_frontend_mm.py::test_fields_of_a_preprocessed_request",
                   "tests/unit/oracles/test_sglang_mm.py::test_without_the_frontends_hash_sglang_hashes_the_pixels",
                   "tests/unit/verify/props/mm/test_mm.py::test_aligned_baseline_holds[True]"):
        assert scope(nodeid) == MM_ORACLES, nodeid
    assert scope("tests/unit/verify/runner/test_check.py::test_check_json_report") == "tests/unit/verify/runner/test_check.py"
