"""``kvalign e2e fuzz`` on real SGLang CPU workers (EAGLE3) behind the real router.

Three live clusters, each started once and shared by its tests (a test flushes every worker
before it runs, through Dynamo's ``clear_kv_blocks``, and the flush is confirmed on the engine's
stream before any request):

* **Dynamo 1.6.1 x SGLang 0.5.21, aggregated** — the pair Dynamo 1.6.1 ships: one generated run
  must hold every invariant while exercising every rule, and one committed script per invariant
  must fail naming *that* invariant (each beside its passing twin);
* **2 prefill + 1 decode** (the nightly's topology, the environment's SGLang): one generated run,
  with the prefill worker's reuse read from the frontend's metrics and decode speculation checked
  per window of requests;
* **router eagle off, disagreeing draft** (aggregated): the two controls that need a cluster
  registered or built differently, replayed one after the other.

The driver runs in this process (the CLI is tested on its own in tests/unit/live/test_live_fuzz_cli.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import OUT_ROOT, sglang_cpu_missing
from kvalign.commands.fuzz import DEFAULT_SEED, DISAGG_SEED, DISAGG_SHORT
from kvalign.live.cluster.ranks import split_label
from kvalign.live.runs.fuzz.driver import FuzzDriver
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.plan import fuzz_cluster
from kvalign.live.runs.advertised import advertised_rows
from kvalign.live.runs.fuzz.machine import FuzzResult, replay, run_fuzz

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
SCRIPTS = Path(__file__).parent / "fuzz_scripts"
SHIPPED_SGLANG = "0.5.21"  # ai-dynamo[sglang]==1.6.1 pins it (docs/releases.md)
ENGINE_FAULT = ["engine_matches_index", "router_credits_engine_reuse"]
#: Each control script: every invariant its failing request breaks, in evaluation order; the first is
#: the one the run's failure names (docs/live-fuzz.md, "Each invariant's live control").
CONTROLS = {
    "router-eagle-off.json": ["router_credits_engine_reuse", "router_matches_prediction"],
    "salt-stripped.json": ["router_credits_engine_reuse", "router_matches_prediction"],
    "lost-batch.json": ["router_matches_prediction"],
    "unpublished-batch.json": ENGINE_FAULT,
    "lost-removal.json": ["no_stale_credit"],
    "routing-against-cache.json": ["best_worker_chosen"],
    "draft-disagrees.json": ["decode_keeps_speculating"],
    "publisher-drop-store.json": ENGINE_FAULT,
    "publisher-wrong-parent.json": ENGINE_FAULT,
    "publisher-wrong-hash.json": ENGINE_FAULT,
    "publisher-drop-removal.json": ENGINE_FAULT,
    "dp-rank0-only.json": ENGINE_FAULT,
}


class Live:
    """One started fuzz cluster and a driver factory for its tests."""

    def __init__(self, cluster: Any, hop: Any, opts: FuzzOptions, run_dir: Path) -> None:
        self.cluster, self.hop, self.opts, self.run_dir = cluster, hop, opts, run_dir
        self.log = (run_dir / "progress.log").open("a")

    def driver(self, **changes: Any) -> FuzzDriver:
        opts = FuzzOptions(**{**self.opts.__dict__, **changes})
        self.hop.strip_salt, self.hop.hide_gaps = opts.strip_salt, opts.hide_gaps
        self.hop.silenced = {lab for lab in self.hop.downstream if split_label(lab)[1]} if opts.rank0_only else set()
        return FuzzDriver(self.cluster, self.hop, opts, lambda m: print(m, file=self.log, flush=True))

    def replay(self, name: str, **changes: Any) -> FuzzResult:
        script = load(name)
        return self.replay_script(script, **changes)

    def replay_script(self, script: dict[str, Any], **changes: Any) -> FuzzResult:
        keys = ("gap_check", "strip_salt", "hide_gaps", "rank0_only")
        given = {k: v for k, v in script["options"].items() if k in keys}
        return replay(self.driver(**{**given, **changes}), script, self.run_dir / "replayed.json")


def load(name: str) -> dict[str, Any]:
    return json.loads((SCRIPTS / name).read_text())


@contextlib.contextmanager
def _live(request: pytest.FixtureRequest, name: str, opts: FuzzOptions) -> Iterator[Live]:
    """A started cluster for one class of tests; its run dir (logs, captures, progress.log) is
    kept when any test that used it failed."""
    missing = sglang_cpu_missing(opts.sglang)
    if missing:
        pytest.skip(f"real SGLang engine cannot run on this CPU: {missing}")
    run_dir = OUT_ROOT / f"fuzz-{name}-{os.getpid()}"
    failed_before = request.session.testsfailed
    with fuzz_cluster(opts, run_dir) as (cluster, hop):
        live = Live(cluster, hop, opts, run_dir)
        try:
            yield live
        finally:
            live.log.close()
    if request.session.testsfailed == failed_before:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"\nkvalign fuzz run dir kept: {run_dir}")


@pytest.fixture(scope="class")
def shipped(request: pytest.FixtureRequest) -> Iterator[Live]:
    with _live(request, "shipped", FuzzOptions(sglang=SHIPPED_SGLANG, publisher_faults=True)) as live:
        yield live


@pytest.fixture(scope="class")
def disagg(request: pytest.FixtureRequest) -> Iterator[Live]:
    with _live(request, "disagg", FuzzOptions(topology="disagg")) as live:
        yield live


@pytest.fixture(scope="class")
def dynamo_format(request: pytest.FixtureRequest) -> Iterator[Live]:
    if not (os.environ.get("KVALIGN_NIGHTLY") or os.environ.get("HYPOTHESIS_PROFILE") == "nightly"):
        pytest.skip("SGLang's dynamo KV-event format on its own cluster: nightly only (KVALIGN_NIGHTLY=1); "
                    "check --event-format both covers it in every run")
    with _live(request, "dynamo-format", FuzzOptions(event_format="dynamo", page_size=8)) as live:
        yield live


@pytest.fixture(scope="class")
def data_parallel(request: pytest.FixtureRequest) -> Iterator[Live]:
    with _live(request, "dp", FuzzOptions(workers=1, dp_size=2)) as live:
        yield live


@pytest.fixture(scope="class")
def blind(request: pytest.FixtureRequest) -> Iterator[Live]:
    with _live(request, "blind", FuzzOptions(router_eagle=False, draft="disagree")) as live:
        yield live


def generated(live: Live, seed: int = DEFAULT_SEED, examples: int = 3, steps: int = 10) -> dict[str, Any]:
    d = live.driver()
    res = run_fuzz(d, examples=30 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else examples, steps=steps,
                   seed=seed, shrink_seconds=60, script_path=live.run_dir / "fuzz-failure.json",
                   report=lambda m: print(m, file=live.log, flush=True))
    out = res.as_json()
    out["advertised"] = [r.as_json() for r in advertised_rows(live.cluster)]
    (OUT_ROOT / f"{live.run_dir.name}.json").write_text(json.dumps(out, indent=1) + "\n")  # the run's figures, kept
    assert res.passed, f"{out['failure']} (progress: {live.run_dir / 'progress.log'})"
    # every publishing worker registered, advertised (SGLang's /server_info) and published its page size
    assert all(r["ok"] for r in out["advertised"]) and any(r["checked"] for r in out["advertised"]), out["advertised"]
    assert {r["registered"] for r in out["advertised"]} == {live.opts.page_size}, out["advertised"]
    return out


def failed(res: FuzzResult, script: str) -> dict[str, Any]:
    """The control's failure, holding the full set of invariants its failing request broke."""
    assert res.failure is not None, "the control passed: the invariant did not see the fault"
    f = res.failure.as_json()
    assert f["invariant"] == CONTROLS[script][0] and f["failing"] == CONTROLS[script], f
    return f


def requeried_and_diagnosed(out: dict[str, Any]) -> None:
    """Every fault a rule injected was looked at again, and every lost store was named."""
    counts = out["counts"]
    assert counts["evicted_requeried"] >= 1 and counts["flushed_requeried"] >= 1 and counts["lost_requeried"] >= 1, counts
    assert counts["lost_batches_diagnosed"] == counts["dropped_batches"] >= 1 and not out["notes"], out


# ---- Dynamo 1.6.1 x its shipped SGLang (0.5.21), aggregated ------------------------------------


class TestShippedPair:
    """Dynamo 1.6.1 x SGLang 0.5.21 aggregated: the generated run and one control per invariant."""

    def test_generated_workload_on_the_shipped_pair_holds_every_invariant(self, shipped: Live) -> None:
        out = generated(shipped)
        assert out["sglang"] == SHIPPED_SGLANG and out["topology"] == "agg"
        inv = out["invariants"]
        assert inv["router_credits_engine_reuse"]["checked"] >= 30 and all(v["failed"] == 0 for v in inv.values()), inv
        assert out["unattributable"] <= 0.1 * out["requests"], out
        requeried_and_diagnosed(out)
        assert inv["best_worker_chosen"]["checked"] >= 1, inv
        assert inv["decode_keeps_speculating"]["checked"] >= 1, inv


    def test_lost_store_with_the_gap_check_off_fails_router_matches_prediction(self, shipped: Live) -> None:
        failed(shipped.replay("lost-batch.json"), "lost-batch.json")
        assert shipped.replay("lost-batch.json", gap_check=True).passed  # twin: the loss is modelled


    def test_diagnose_names_a_lost_batch_even_when_the_hop_hides_the_gap(self, shipped: Live) -> None:
        """Why ``gap_diagnosed`` is no invariant: even a hop that renumbers the stream after the loss
        leaves orphaned stores behind, and ``kvalign diagnose`` names the loss from them."""
        for hide in (True, False):
            res = shipped.replay("gap-hidden.json", hide_gaps=hide)
            assert res.passed, res.failure
            assert res.driver.counts["lost_batches_diagnosed"] == 1 and res.driver.tally.hop_faulted == 1, hide

    def test_a_batch_lost_unpublished_fails_engine_matches_index(self, shipped: Live) -> None:
        f = failed(shipped.replay("unpublished-batch.json"), "unpublished-batch.json")
        assert f["cause"] == "ENGINE_EVENTS_MISSING" and f["evidence"]["kind"] == "never_stored", f  # lost to every subscriber
        twin = copy.deepcopy(load("unpublished-batch.json"))
        twin["steps"][0]["unpublished"] = False
        res = shipped.replay_script(twin)
        assert res.passed and res.driver.tally.hop_faulted == 1, res.failure

    def test_lost_removal_fails_no_stale_credit(self, shipped: Live) -> None:
        failed(shipped.replay("lost-removal.json"), "lost-removal.json")
        twin = copy.deepcopy(load("lost-removal.json"))
        twin["steps"][0]["lose"] = False
        res = shipped.replay_script(twin)
        assert res.passed, res.failure
        assert res.driver.counts["flushed_requeried"] == 1


    def test_a_hop_that_strips_cache_salt_fails_router_credits_engine_reuse_naming_tenants(self, shipped: Live) -> None:
        f = failed(shipped.replay("salt-stripped.json"), "salt-stripped.json")
        assert f["cause"] == "TENANTS_SHARE_KEYS", f
        assert f["router_tokens"] == 0 and f["engine_tokens"] > 0, f
        res = shipped.replay("salt-stripped.json", strip_salt=False)  # twin: an honest hop
        assert res.passed, res.failure
        assert res.driver.tally.checked["router_credits_engine_reuse"] == 2


    def test_routing_against_the_cache_view_fails_best_worker_chosen(self, shipped: Live) -> None:
        failed(shipped.replay("routing-against-cache.json"), "routing-against-cache.json")
        twin = copy.deepcopy(load("routing-against-cache.json"))
        del twin["steps"][1]["pin"]
        res = shipped.replay_script(twin)
        assert res.passed and res.driver.tally.checked["best_worker_chosen"] == 1, res.failure

    @pytest.mark.parametrize("script, kind", [("publisher-drop-store.json", "never_stored"),
                                              ("publisher-wrong-parent.json", "outside_chain"),
                                              ("publisher-wrong-hash.json", "outside_chain")])
    def test_a_fault_in_sglangs_own_publisher_is_named_as_the_engines_events(self, shipped: Live, script: str,
                                                                              kind: str) -> None:
        """A fault injected into SGLang's publisher inside the real worker (a test control): the engine
        reuses page 3, its own stream never stored it in the prompt's chain; never none or a prompt shift."""
        res = shipped.replay(script)
        f = failed(res, script)
        assert f["cause"] == "ENGINE_EVENTS_MISSING" and f["evidence"]["kind"] == kind, f
        assert f["evidence"]["pages"] == [3, 3] and f["engine_tokens"] == 64 and f["router_tokens"] == 48, f
        assert [x["fired"] for x in res.driver.faults_fired] == [True], res.driver.faults_fired

    def test_an_eviction_sglang_never_published_is_named_from_the_engines_state(self, shipped: Live) -> None:
        """The engine freed the first prompt's pages and its publisher dropped the removal (a test control):
        the router credits 18 pages the engine no longer holds, named ENGINE_REMOVALS_MISSING from the engine's
        stream against its reuse, never none; the same steps with the eviction published pass."""
        res = shipped.replay("publisher-drop-removal.json")
        f = failed(res, "publisher-drop-removal.json")
        assert f["cause"] == "ENGINE_REMOVALS_MISSING" and f["evidence"]["kind"] == "never_removed", f
        assert f["evidence"]["pages"] == [0, 17] and f["engine_tokens"] == 0 and f["router_tokens"] == 288, f
        assert [x["fired"] for x in res.driver.faults_fired] == [True], res.driver.faults_fired
        twin = copy.deepcopy(load("publisher-drop-removal.json"))
        del twin["steps"][1]["publisher_fault"]
        res = shipped.replay_script(twin)
        assert res.passed and res.driver.tally.checked["router_credits_engine_reuse"] == 3, res.failure

    def test_benign_reshapings_of_sglangs_stream_pass(self, shipped: Live) -> None:
        """The same requests with the stream split (one page per batch) and merged (two batches as one):
        the twin of the publisher-fault controls, every invariant held, both reshapings really made."""
        res = shipped.replay("publisher-reshaped.json")
        assert res.passed and res.driver.tally.checked["router_credits_engine_reuse"] == 3, res.failure
        assert not res.driver.notes, res.driver.notes  # the settle counts a merged batch as the frontend applies it
        split, merge = res.driver.faults_fired
        assert split["fired"] and split["batches_out"] == 3 and merge["fired"] and merge["batches_in"] == 2, \
            res.driver.faults_fired

    def test_the_blind_clusters_scripts_pass_on_an_honest_cluster(self, shipped: Live) -> None:
        res = shipped.replay("router-eagle-off.json")  # the card says eagle: the router credits the reuse
        assert res.passed and res.driver.tally.checked["router_credits_engine_reuse"] == 2, res.failure
        res = shipped.replay("draft-disagrees.json")  # the agreeing draft keeps speculating
        assert res.passed and res.driver.tally.checked["decode_keeps_speculating"] == 1, res.failure


# ---- 2 prefill + 1 decode ------------------------------------------------------------------------


class TestTwoPrefillOneDecode:
    """The nightly's topology: prefill reuse from the frontend's metrics, decode speculation per window of requests."""

    def test_generated_workload_on_two_prefill_one_decode_holds_every_invariant(self, disagg: Live) -> None:
        seed, examples, steps = DISAGG_SHORT  # the CLI default (DISAGG_SEED, 3 x 10) runs at night
        out = generated(disagg, *((DISAGG_SEED, 3, 10) if os.environ.get("HYPOTHESIS_PROFILE") == "nightly"
                                  else (seed, examples, steps)))
        assert out["topology"] == "disagg"
        inv = out["invariants"]
        assert all(v["failed"] == 0 for v in inv.values()), inv
        assert inv["router_credits_engine_reuse"]["checked"] + out["hop_faulted"] == out["requests"], out
        assert inv["decode_keeps_speculating"]["checked"] >= 1 and inv["best_worker_chosen"]["checked"] >= 1, inv
        # every request sent alone handed its KV to decode over NIXL, and SGLang's checksum verified it there
        assert inv["kv_transferred"]["checked"] >= 1 and out["transfers"]["backend"] == "nixl", out["transfers"]
        assert out["transfers"]["checksum_verified"] == inv["kv_transferred"]["checked"], out["transfers"]
        requeried_and_diagnosed(out)  # what the aggregated run asserts


# ---- SGLang's "dynamo" KV-event format, at another page size --------------------------------------


class TestDynamoEventFormat:
    """``--kv-events-config '{"format": "dynamo"}'`` at page 8: the same invariants, the live block sizes at
    a second page size, and a salted tenant through namespaced hashes (``check --event-format dynamo``: ok)."""

    def test_generated_workload_in_the_dynamo_format_holds_every_invariant(self, dynamo_format: Live) -> None:
        out = generated(dynamo_format, examples=2)
        assert all(v["failed"] == 0 for v in out["invariants"].values()), out["invariants"]
        assert {r["advertised"] for r in out["advertised"]} == {8} and {tuple(r["emitted"]) for r in out["advertised"]} == {(8,)}

    def test_a_salted_tenant_is_credited_and_a_salt_stripping_hop_is_named(self, dynamo_format: Live) -> None:
        res = dynamo_format.replay("salt-stripped.json", strip_salt=False)
        assert res.passed and res.driver.tally.checked["router_credits_engine_reuse"] == 2, res.failure
        f = failed(dynamo_format.replay("salt-stripped.json"))
        assert f["invariant"] == "router_credits_engine_reuse" and f["cause"] == "TENANTS_SHARE_KEYS", f


# ---- controls that need their own cluster --------------------------------------------------------


class TestBlindCluster:
    """Router eagle off and a disagreeing draft: each control's passing twin is the same script on
    the shipped pair's honest cluster (TestShippedPair)."""

    def test_router_eagle_off_fails_router_credits_engine_reuse(self, blind: Live) -> None:
        f = failed(blind.replay("router-eagle-off.json"), "router-eagle-off.json")
        assert f["cause"] == "ROUTER_EAGLE_OFF", f
        assert f["router_tokens"] == 0 and f["engine_tokens"] > 0, f

    def test_a_disagreeing_draft_fails_decode_keeps_speculating(self, blind: Live) -> None:
        failed(blind.replay("draft-disagrees.json"), "draft-disagrees.json")


# ---- one worker, two data-parallel ranks ----------------------------------------------------------


class TestDataParallel:
    """One worker with ``--dp-size 2``: two schedulers, two KV caches, two event streams, and the
    router choosing (worker, rank). Each rank's credit must be its own reuse; with every rank but 0
    silent (what SGLang did before each rank published), the rank-1 request fails naming that rank."""

    def test_each_rank_is_credited_with_what_it_reused_and_served_what_it_was_routed(self, data_parallel: Live) -> None:
        res = data_parallel.replay("dp-two-ranks.json")
        out = res.as_json()
        assert res.passed, out["failure"]
        ranks, inv = out["counts"]["requests_by_rank"], out["invariants"]
        assert set(ranks) == {"worker0.dp0", "worker0.dp1"} and min(ranks.values()) >= 2, ranks
        by_rank = inv["router_credits_engine_reuse"]["by_rank"]
        # both ranks' events indexed: the router credited a request on each, and it equalled that rank's reuse
        assert all(v["checked"] >= 2 and v["failed"] == 0 and v["credited_requests"] >= 1 for v in by_rank.values()), by_rank
        assert inv["routed_rank_served"]["checked"] >= 4 and inv["routed_rank_served"]["failed"] == 0, inv

    def test_only_rank_0_publishing_fails_naming_rank_1(self, data_parallel: Live) -> None:
        f = failed(data_parallel.replay("dp-rank0-only.json"), "dp-rank0-only.json")
        assert f["cause"] == "DP_RANK_UNPUBLISHED" and f["rank"] == "worker0.dp1", f
        assert f["router_tokens"] == 0 and f["engine_tokens"] > 0, f
