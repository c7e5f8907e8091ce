"""The publisher-fault test control (kvalign/standins/sglang_cpu/publisher_faults.py).

Fast: each fault reshapes a batch as intended, and the harness's control file arms a fault once
and reads back what it did. Slow (one child process, SGLang imported there only): the same faults
on SGLang's own ``KVEventBatch`` / ``BlockStored``, encoded by SGLang's encoder and decoded by
kvalign's, and :func:`install` wrapping ``ZmqEventPublisher.publish`` only when the control is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvalign.live.runs.fuzz.publisher_faults import PublisherFaultControl
from kvalign.model.events import BlockRemoved, BlockStored
from kvalign.model.sglang_keys import engine_block_hashes, page_units
from kvalign.standins.sglang_cpu import PUBLISHER_FAULTS_ENV
from kvalign.standins.sglang_cpu.publisher_faults import FAULTS, PublisherFaults, reshape

B = 16
TOKENS = list(range(500, 550))  # 3 bigram pages


def store() -> BlockStored:
    hashes = engine_block_hashes(TOKENS, B, eagle=True)
    return BlockStored(hashes, None, [u for page in page_units(TOKENS, B, eagle=True) for u in page], B)


def test_each_fault_reshapes_a_batch() -> None:
    ev, removed = store(), BlockRemoved([7])
    assert reshape("drop_store", [ev]) == [] and reshape("drop_store", [removed, ev]) == [[removed]]
    [[bad]] = reshape("wrong_parent", [ev])
    assert bad.parent_block_hash is not None and bad.block_hashes == ev.block_hashes
    [[bad]] = reshape("wrong_hash", [ev])
    assert bad.block_hashes[:-1] == ev.block_hashes[:-1] and bad.block_hashes[-1] != ev.block_hashes[-1]
    split = reshape("split", [ev])
    assert [e.block_hashes for (e,) in split] == [[h] for h in ev.block_hashes]
    assert [e.parent_block_hash for (e,) in split] == [None, *ev.block_hashes[:-1]]
    assert [u for (e,) in split for u in e.token_ids] == ev.token_ids
    assert reshape("split", [removed]) is None and reshape("drop_store", [removed]) is None  # no store: stays armed
    assert reshape("drop_removal", [ev, removed]) == [[ev]] and reshape("drop_removal", [removed]) == []
    assert reshape("drop_removal", [ev]) is None  # no removal: stays armed


def faults_at(tmp_path: Path) -> tuple[PublisherFaultControl, PublisherFaults, list, object]:
    control, faults, sent = PublisherFaultControl(tmp_path), PublisherFaults(str(tmp_path / "worker0.json")), []
    return control, faults, sent, lambda ts, evs: sent.append(evs)


def test_an_armed_fault_fires_once_and_is_acknowledged(tmp_path: Path) -> None:
    control, faults, sent, send = faults_at(tmp_path)
    faults.publish(1.0, [store()], send)
    assert len(sent) == 1 and faults.armed() is None  # unarmed: passes through
    fid = control.arm(["worker0"], "split")
    faults.publish(2.0, [BlockRemoved([1])], send)  # no store: passes, stays armed
    assert control.fired("worker0", fid) is None and len(sent) == 2
    faults.publish(3.0, [store()], send)
    assert len(sent) == 2 + 3
    assert control.fired("worker0", fid) == {"id": fid, "fault": "split", "batches_in": 1, "batches_out": 3, "blocks": 3}
    faults.publish(4.0, [store()], send)
    assert len(sent) == 6 and len(sent[-1]) == 1  # fired once: the next batch passes whole
    control.disarm(["worker0"])
    fid2 = control.arm(["worker0"], "drop_store")
    assert fid2 > fid
    faults.publish(5.0, [store()], send)
    assert len(sent) == 6 and control.fired("worker0", fid2)["batches_out"] == 0
    control.disarm(["worker0"])
    faults.publish(6.0, [store()], send)
    assert len(sent) == 7


def test_merge_holds_batches_until_enough_arrived_or_the_window_ends(tmp_path: Path) -> None:
    control, faults, sent, send = faults_at(tmp_path)
    fid = control.arm(["worker0"], "merge", {"batches": 2, "window_s": 30})
    faults.publish(1.0, [store()], send)
    assert sent == []
    faults.publish(2.0, [BlockRemoved([1])], send)
    assert [len(b) for b in sent] == [2] and control.fired("worker0", fid)["batches_in"] == 2
    fid = control.arm(["worker0"], "merge", {"batches": 3, "window_s": 0.05})
    faults.publish(3.0, [store()], send)
    deadline = time.monotonic() + 5
    while control.fired("worker0", fid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert control.fired("worker0", fid)["batches_in"] == 1 and len(sent) == 2


def test_the_control_refuses_an_unknown_fault_and_a_worker_ignores_a_bad_file(tmp_path: Path) -> None:
    control, faults, sent, send = faults_at(tmp_path)
    with pytest.raises(ValueError, match="unknown publisher fault"):
        control.arm(["worker0"], "reorder")
    (tmp_path / "worker0.json").write_text("{not json")
    faults.publish(1.0, [store()], send)
    assert len(sent) == 1 and set(FAULTS) == {"drop_store", "wrong_parent", "wrong_hash", "drop_removal", "split", "merge"}


_CHILD = r"""
import json, sys, types
for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(name, types.ModuleType(name))  # as the stand-in's hooks do (PyPI torchvision is a CUDA build)
import msgspec
from sglang.srt.disaggregation import kv_events
from kvalign.model.events import decode_payload
from kvalign.model.sglang_keys import engine_block_hashes, page_units
from kvalign.standins.sglang_cpu import publisher_faults
from kvalign.live.runs.fuzz.publisher_faults import PublisherFaultControl

tokens, b = list(range(500, 550)), 16
hashes = engine_block_hashes(tokens, b, eagle=True)
ev = kv_events.BlockStored(block_hashes=hashes, parent_block_hash=None, lora_id=None, block_size=b,
                           token_ids=[list(u) for page in page_units(tokens, b, eagle=True) for u in page])
wire = lambda evs: decode_payload(msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.0, events=evs))).events
out = {"sent": [[e.block_hashes, e.parent_block_hash] for e in wire([ev])]}
for fault in ("drop_store", "wrong_parent", "wrong_hash", "split"):
    out[fault] = [[[e.block_hashes, e.parent_block_hash, len(e.token_ids)] for e in wire(batch)]
                  for batch in publisher_faults.reshape(fault, [ev])]
published = []
def publish(self, events):  # where SGLang's queueing publish is: the same signature
    published.append(events)
kv_events.ZmqEventPublisher.publish = publish
publisher_faults.install()
out["wrapped_without_control"] = kv_events.ZmqEventPublisher.publish is not publish
import os
os.environ[sys.argv[1]] = sys.argv[2] + "/worker0.json"
publisher_faults.install()
fid = PublisherFaultControl(sys.argv[2]).arm(["worker0"], "split")
kv_events.ZmqEventPublisher.publish(None, kv_events.KVEventBatch(ts=5.0, events=[ev], attn_dp_rank=0))
out["installed"] = [[type(p).__name__, p.ts, p.attn_dp_rank, len(p.events)] for p in published]
out["fid"] = fid
print(json.dumps(out))
"""


@pytest.mark.slow  # imports SGLang in a child process (about 15 s)
def test_the_faults_on_sglangs_own_event_types_and_publisher(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != PUBLISHER_FAULTS_ENV}
    proc = subprocess.run([sys.executable, "-c", _CHILD, PUBLISHER_FAULTS_ENV, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    [[hashes, parent]] = out["sent"]
    assert out["drop_store"] == []
    [[[h, p, n]]] = out["wrong_parent"]
    assert h == hashes and p is not None and n == 48
    [[[h, p, _]]] = out["wrong_hash"]
    assert h[:-1] == hashes[:-1] and h[-1] != hashes[-1] and p is None
    assert out["split"] == [[[[x], q, 16]] for x, q in zip(hashes, [None, *hashes[:-1]])]
    assert out["wrapped_without_control"] is False
    assert out["installed"] == [["KVEventBatch", 5.0, 0, 1]] * 3
    assert json.loads((tmp_path / "worker0.json.done").read_text())["id"] == out["fid"]
