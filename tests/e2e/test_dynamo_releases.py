"""Dynamo #11764 live, on the release that shipped it: the prefill router of Dynamo 1.3.1 built its
KV chooser with EAGLE hashing off whatever the prefill workers' cards said, so on 2 prefill + 1
decode workers that key pages by bigrams it credits 0 where kvalign predicts the shared prefix.

Every process of the cluster (frontend, router, the fake workers' runtime bindings) runs Dynamo
1.3.1 from ``kvalign matrix``'s wheel cache (``kvalign e2e run --engine fake-cpu --dynamo 1.3.1``);
the fake workers register ``enable_eagle`` from SGLang's ``is_eagle()``, what a correct card says.
The same scenario on the environment's Dynamo (1.6.1) passes in ``tests/e2e/test_disagg_eagle.py``.

And the in-process ingest cell of 1.3.1 x 0.5.23 (its relay stopping during a ``check`` run) out of
process: with 1.3.1's relay in each worker's process and its router in the frontend's, aggregated
EAGLE workers, the router credits exactly kvalign's prediction on every request of a long run.
"""

from __future__ import annotations

import pytest

from kvalign.model.causes import Cause
from kvalign.live.runs import disagg_eagle
from kvalign.live.runs.disagg_eagle import E2eOptions

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BROKEN = "1.3.1"  # shipped the prefill router's eagle-off chooser; 1.4.2 and 1.5.1 credit the prefix


@pytest.fixture
def release_1_3_1(cpu_live_stack: None) -> str:
    """Dynamo 1.3.1 in the wheel cache (installed in set-up, not in the test's timeout)."""
    from kvalign.verify.report.matrix import MatrixError, ensure_release

    try:
        ensure_release("dynamo", BROKEN)
    except MatrixError as exc:
        pytest.skip(f"ai-dynamo {BROKEN} cannot be installed into the wheel cache here: {exc}")
    return BROKEN


def test_prefill_router_of_1_3_1_credits_nothing_on_eagle_prefill_workers(release_1_3_1, live_run_dir):
    opts = E2eOptions(engine="fake-cpu", dynamo=release_1_3_1, startup_timeout_s=300)
    plan, kind = disagg_eagle.build(opts, live_run_dir)
    from kvalign.live.cluster.lifecycle import Cluster

    with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s) as cluster:
        assert all(h.enable_eagle for h in cluster.workers.values())  # every card says eagle
        result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    records = result.records
    assert [r.observed for r in records] == [0.0] * len(records), result.report()
    # blind routing scatters the requests, so kvalign's prediction for the worker the router chose is
    # > 0 on the requests that landed where the prefix is (at least one of requests 3 and 4 does)
    assert any(r.predicted > 0 for r in records[1:]), result.report()
    second = [f for f in result.failures if f.startswith("assertion 2 ")]
    assert len(second) == 1 and f"cause: {Cause.ROUTER_EAGLE_OFF.name}" in second[0], result.report()
    assert "the card registered enable_eagle=True" in second[0], result.report()


def test_relay_and_router_of_1_3_1_in_their_own_processes_keep_indexing(release_1_3_1, live_run_dir):
    from kvalign.live.cluster.lifecycle import Cluster, make_plan
    from kvalign.live.cluster.topology import CpuWorkerKind, Topology
    from kvalign.live.runs import scenario
    from kvalign.verify.report.matrix import ensure_release

    plan = make_plan(Topology.aggregated(2, eagle=True), live_run_dir, dynamo_dir=ensure_release("dynamo", BROKEN),
                     dynamo_version=BROKEN)
    with Cluster(plan, CpuWorkerKind(), startup_timeout_s=300) as cluster:
        records = scenario.run_prefix_extension(cluster, 12)
    table = scenario.table(records)
    print(table)
    assert [r.observed for r in records] == [r.predicted for r in records], table  # exact, every request
    # the relay never stopped: every request sent to a worker that served an earlier (prefix) request
    # is credited; the router may send one to the other worker (load), which holds nothing yet: 0 there
    warm = [r for i, r in enumerate(records) if r.worker in {p.worker for p in records[:i]}]
    assert len(warm) >= len(records) // 2 and all(r.observed > 0 for r in warm), table
