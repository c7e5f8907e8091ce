"""Each worker of the in-process router path is distinct to its router: no row indexes another row's blocks (issue 46).

Every worker of one in-process runtime has the runtime's worker id, and Dynamo 1.0.2's relays publish on the one
topic ``kv-events`` whatever their namespace: on one shared event-plane broker, a plain and an EAGLE worker of the
same page size each indexed the other's stored page as their own, so what a row's router held followed which rows
ran before it. :meth:`~kvalign.oracles.router_path.RouterPath.event_plane` gives each worker a broker of its own.
The negative control runs the same probe with every worker on the runtime's one broker (the setup before the fix)
and must show the foreign page.
"""

from __future__ import annotations

import json

import pytest
import release_probes

PROBE = """
import json
from kvalign.oracles.router_path import RouterPath

class SharedPlane(RouterPath):  # the negative control: every worker on the runtime's one broker, as before the fix
    def event_plane(self):
        return self.broker

out = {}
for name, cls in (("fixed", RouterPath), ("shared", SharedPlane)):
    path = cls()
    try:
        a, b = path.worker(2, False), path.worker(2, True)  # two rows' workers: same page size, plain and EAGLE
        kv = a.publisher.kv
        ha, hb = (1 << 61) + 1, (1 << 61) + 2
        for w, h, toks in ((a, ha, [7, 8]), (b, hb, [9, 10])):
            w.publisher.publish([kv.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=toks, block_size=2,
                                                lora_id=None, medium="GPU")])
        barriers = [a.barrier(), b.barrier()]
        held = {n: sorted({h for _p, h, _t in w.dump()} & {ha, hb}) for n, w in (("a", a), ("b", b))}
        out[name] = {"barriers": barriers, "held": held, "ha": ha, "hb": hb, "version": path.version,
                     "b_on_a_tokens": b.overlap([7, 8], None, None)}
    finally:
        path.close()
print(json.dumps(out))
"""
#: run in the one Dynamo 1.0.2 child the oracle files share (:mod:`release_probes`)
release_probes.add("crosstalk", PROBE)


@pytest.mark.slow  # installs (or reuses) ai-dynamo 1.0.2 into the wheel cache, then starts its relays and routers
@pytest.mark.timeout(600)
def test_1_0_2s_routers_index_only_their_own_workers_blocks(dynamo_1_0_2_probes):
    out = json.loads(dynamo_1_0_2_probes.section("crosstalk").strip().splitlines()[-1])
    fixed, shared = out["fixed"], out["shared"]
    assert fixed["version"] == shared["version"] == "1.0.2"
    assert fixed["barriers"] == shared["barriers"] == [True, True], out
    ha, hb = fixed["ha"], fixed["hb"]
    # each router holds its own worker's page only, and credits nothing on the other worker's tokens
    assert fixed["held"] == {"a": [ha], "b": [hb]}, out
    assert fixed["b_on_a_tokens"] == 0, out
    # the control: on one broker, each router holds both pages and credits the other worker's
    assert shared["held"] == {"a": [ha, hb], "b": [ha, hb]}, out
    assert shared["b_on_a_tokens"] == 1, out
