"""Which vLLM mismatches a router without cache namespaces explains (:mod:`kvalign.verify.props.vllm.namespace`).

Dynamo 1.3.1's block hash takes no ``cache_namespace``: a salted tenant's blocks get the unsalted tenant's keys, so
its ``ingest`` / ``hashes`` rows saw "never indexed" (published as ``EVENTS_DROPPED``) and its ``tenants`` rows one
tenant credited another's blocks (``TENANTS_SHARE_KEYS``), where the cause is the namespace the release drops.

The fast tier runs the logic on the installed Dynamo's real hash (1.6.1: it keeps the namespace, the negative
control) and on that hash with ``cache_namespace`` dropped as :func:`~kvalign.oracles.dynamo.adapt_hasher` drops it
for a release whose binding lacks it (1.3.1's own binding is in its release environment). The nightly test drives
the failing examples through Dynamo 1.3.1's real relay, in its own process, with the official vLLM 0.23.0 wheel, and
the same examples through Dynamo 1.6.1's (control).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvalign.model.causes import Cause
from kvalign.oracles.dynamo import adapt_hasher
from kvalign.verify.props.vllm import namespace

B = 16
ROOT = Path(__file__).resolve().parents[5]


def _no_namespace_hasher():
    """The installed binding with the signature of a release that has no ``cache_namespace`` (1.3.1's)."""
    from dynamo._core import compute_block_hash_for_seq as binding

    def old(tokens, kv_block_size, block_mm_infos=None, lora_name=None, is_eagle=None):
        return binding(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle=is_eagle)

    hasher = adapt_hasher(old)
    assert hasher.missing == ("cache_namespace",)
    return hasher


def _stored(hashes, parent, first_token):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(first_token, first_token + B * len(hashes)))}


def test_two_namespaces_of_one_lora_share_keys_only_where_the_release_hash_drops_the_namespace():
    old, today = _no_namespace_hasher(), namespace.release_hasher()
    block = range(B)
    assert namespace.shared_key(old, block, (None, None), (None, "t1"))
    assert namespace.shared_key(old, block, ("adapterA", "t1"), ("adapterA", None))
    assert not namespace.shared_key(old, block, (None, None), ("adapterA", "t1"))  # another LoRA keys apart
    assert not namespace.shared_key(old, block, (None, "t1"), (None, "t1"))  # one tenant: nothing to explain
    assert not namespace.shared_key(today, block, (None, None), (None, "t1"))  # the control: 1.6.1 keeps it
    assert namespace.tenant_sharing(old, block, (None, None), [(None, None), (None, "t1")]) == (None, "t1")
    assert namespace.tenant_sharing(today, block, (None, None), [(None, None), (None, "t1")]) is None


def test_a_block_never_indexed_is_traced_to_another_tenant_holding_its_keys_on_a_release_without_namespaces():
    """As measured on 1.3.1: the unsalted tenant stores two blocks, the salted one the same two and a third in one
    event, none of which the router indexes (the third under its ancestor's event)."""
    for hasher, named in ((_no_namespace_hasher(), True), (namespace.release_hasher(), False)):
        log = namespace.StoreLog(hasher, B)
        log.add(_stored([1, 2], None, 0), (None, None))
        log.add(_stored([11, 12, 13], None, 0), (None, "t1"))
        log.add({"type": "BlockRemoved", "block_hashes": [1]}, (None, None))  # ignored: a store log
        indexed = {1, 2}
        why = log.collision(13, indexed)
        assert (why is not None) == named, why
        if named:
            assert why.startswith("the router holds the keys of vLLM's block 13 of tenant (None, 't1') (its ancestor "
                                  "12's event) under block 2 of tenant (None, None)")
            assert "takes no cache_namespace" in why
            assert "block 11" in log.collision(11, indexed) and "ancestor" not in log.collision(11, indexed)


def test_the_same_block_under_another_prefix_is_no_collision():
    """Dynamo keys a block under its parent: one tenant's block 0 at the root and another's block 0 after block 1
    are two nodes, so a release without namespaces explains nothing there."""
    log = namespace.StoreLog(_no_namespace_hasher(), B)
    log.add(_stored([1], None, 0), (None, None))
    log.add(_stored([21], None, B), (None, "t1"))
    log.add(_stored([22], 21, 0), (None, "t1"))  # block 0's tokens, after block 1
    assert log.collision(22, {1}) is None


def test_the_tenant_blind_control_expects_the_namespace_where_the_release_keys_the_salt_as_the_base_tenant():
    old, today = _no_namespace_hasher(), namespace.release_hasher()
    assert namespace.blind_cause((None, "t1"), B, old) == Cause.NAMESPACE_DROPPED
    assert namespace.blind_cause(("adapterA", "t1"), B, old) == Cause.TENANTS_SHARE_KEYS  # its LoRA still differs
    assert namespace.blind_cause((None, "t1"), B, today) == Cause.TENANTS_SHARE_KEYS


#: Run in a Dynamo release's interpreter, vLLM 0.23.0 in the oracle: each body on its fixed example, with the relay
#: in a process of its own (as deployed); prints {row: [cause, detail] or None}.
DRIVE = """
import json
from kvalign.oracles.relay_process import ProcessRouterPath
from kvalign.oracles.vllm_router import vllm_worker
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.vllm import bodies, encodings
from kvalign.verify.props.vllm.strategies import Served

both = [Served((0, 1), 1, (None, None)), Served((0, 1, 2), 1, (None, "t1"))]
cases = {"ingest": (bodies.ingest_body, both), "hashes": (encodings.hashes_body, both),
         "tenants": (bodies.tenants_body, [Served((0, 1), 1, (None, "t1"))])}
path, out = ProcessRouterPath(), {}
try:
    for row, (make, seq) in cases.items():
        worker = vllm_worker(path, 16, 10)
        try:
            make(worker)(seq)
            out[row] = None
        except Mismatch as exc:
            out[row] = [exc.cause.name, str(exc)]
        finally:
            worker.close()
finally:
    path.close()
print("RESULT" + json.dumps(out))
"""


def _drive(python: str) -> dict:
    from kvalign.releases.release_env import child_env
    from kvalign.releases.vllm_env import RELEASE_ENV

    env = {**child_env(), RELEASE_ENV: "vllm==0.23.0", "DYN_LOG": "error",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([python, "-c", DRIVE], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_on_dynamo_1_3_1_with_vllm_0_23_0_the_rows_name_the_namespace_its_relay_drops(official_vllm_wheels):
    """Dynamo 1.3.1 (its shipped vLLM 0.23.0, official wheel), relay in its own process: the unsalted and the salted
    tenant store the same two blocks, and the salted tenant's store is never indexed (ingest, hashes); a salted store
    is credited to the unsalted tenant (tenants): each named NAMESPACE_DROPPED, with the tenant whose keys it got.
    The control: the same examples through Dynamo 1.6.1's relay (it keys the namespace) run clean."""
    from kvalign.releases.release_env import python_for
    from kvalign.verify.report import matrix_vllm
    from kvalign.verify.report.matrix import ensure_release

    matrix_vllm.probe("0.23.0")  # installs the official wheel once
    old = _drive(python_for([ensure_release("dynamo", "1.3.1")]))
    assert {row: got and got[0] for row, got in old.items()} == dict.fromkeys(old, "NAMESPACE_DROPPED"), old
    assert "under block" in old["ingest"][1] and "of tenant (None, None)" in old["ingest"][1]
    assert "the router keys it as tenant (None, 't1')" in old["tenants"][1]
    today = _drive(matrix_vllm.pair_env(None, "0.23.0")[0])  # the installed Dynamo (1.6.1)
    assert today == dict.fromkeys(old), today
