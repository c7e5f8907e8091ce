"""``kvalign watch --metrics-port``: scraped with Prometheus' own parser while real SGLang events flow.

The stream is SGLang's real publisher fed by its real radix cache, through a real ZMQ hop that
loses one batch. The watcher is the real ``kvalign watch`` process, declared to front a router
with eagle off and without cache_salt, at block size 4. Every counter is checked against what was
published; a scrape before anything arrives is the negative control (all zero, no cause).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from sglang_publisher import LossyForwarder, RealPublisher, sglang_events_module
from test_watch import LineReader

from kvalign.oracles.sglang import SglangRadixCache

B = 4
WORKER = "decode-0"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for every sample of one scrape."""
    text = requests.get(url, timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"worker": WORKER, **labels}.items())))]


def blocks(events: list) -> int:
    return sum(len(e.block_hashes) for e in events if type(e).__name__ == "BlockStored")


def _medium(ev) -> str | None:
    """An SGLang event's ``medium`` as the wire string (SGLang's StorageMedium enum or a plain str)."""
    m = getattr(ev, "medium", None)
    return getattr(m, "value", m)


@pytest.mark.timeout(120)
def test_metrics_count_what_the_router_cannot_see(sglang_available):
    pub = RealPublisher()
    hop = LossyForwarder(pub.endpoint, set())
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvalign", "watch", "--endpoint", hop.endpoint, "--router-eagle", "off",
         "--router-salt", "off", "--block-size", str(B), "--worker", WORKER, "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = LineReader(proc.stdout)
    try:
        url = out.wait_for("metrics on http://127.0.0.1:", 30).split("metrics on ")[1]
        idle = scrape(url)
        assert value(idle, "kvalign_watch_batches_received_total") == 0
        assert all(value(idle, "kvalign_watch_router_blind_blocks_total", reason=r) == 0
                   for r in ("eagle_mismatch", "block_size", "lora_without_name", "salt_stripped"))
        assert not any(name == "kvalign_watch_last_cause_info" for name, _ in idle)

        out.wait_for("watching")
        deadline = time.monotonic() + 15
        while not any(line.startswith("seq ") for line in out.lines):  # slow joiner
            assert time.monotonic() < deadline, out.lines
            pub.publish([pub.warm_up_event()])
            try:
                out.wait_for("seq ", 0.2)
            except AssertionError:
                pass
        warm = scrape(url)
        batches0 = value(warm, "kvalign_watch_batches_received_total")
        events0 = value(warm, "kvalign_watch_events_received_total")

        eagle = SglangRadixCache(B, eagle=True)
        eagle.insert(list(range(1, 22)))
        bigram = eagle.take_raw_events()  # 5 bigram pages: blind to a router with eagle off
        eagle.insert(list(range(1, 30)))
        lost = eagle.take_raw_events()  # dropped on the way
        eagle.insert(list(range(1, 38)))
        orphaned = eagle.take_raw_events()  # its parent was in the lost batch
        plain = SglangRadixCache(B, eagle=False)
        plain.insert(list(range(100, 113)), lora_name="adapter-a")
        # as SGLang 0.5.19 sends an adapter's pages: its integer lora_id, no lora_name
        nameless = [msgspec.structs.replace(e, lora_id=1, lora_name=None) for e in plain.take_raw_events()]
        plain.insert(list(range(200, 209)), cache_salt="tenant-a")
        salted = plain.take_raw_events()
        small = SglangRadixCache(2, eagle=False)
        small.insert(list(range(300, 307)))
        other_size = small.take_raw_events()  # page size 2 against a router at block size 4

        published = [bigram, lost, orphaned, nameless, salted, other_size]
        seqs = []
        for events in published:
            if events is lost:
                hop.drop.add(pub.sent)
            seqs.append(pub.publish(events))
        out.wait_for(f"seq {seqs[-1]}:")
        got = scrape(url)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:  # never leave a watch behind, whatever failed
                proc.kill()
        hop.close()
        pub.close()
    assert rc == 0, proc.stderr.read()

    received = [e for e in published if e is not lost]
    assert value(got, "kvalign_watch_batches_received_total") - batches0 == len(received)
    assert value(got, "kvalign_watch_events_received_total") - events0 == sum(map(len, received))
    assert value(got, "kvalign_watch_blocks_stored_total") == sum(map(blocks, received))
    assert value(got, "kvalign_watch_blocks_removed_total") == 0
    assert value(got, "kvalign_watch_sequence_gaps_total") == 1
    assert value(got, "kvalign_watch_batches_missing_total") == 1
    assert value(got, "kvalign_watch_orphan_stores_total") == 1
    assert value(got, "kvalign_watch_malformed_batches_total") == 0
    blind = {r: value(got, "kvalign_watch_router_blind_blocks_total", reason=r)
             for r in ("eagle_mismatch", "block_size", "lora_without_name", "salt_stripped")}
    assert blind == {"eagle_mismatch": blocks(bigram) + blocks(orphaned), "block_size": blocks(other_size),
                     "lora_without_name": blocks(nameless), "salt_stripped": blocks(salted)}
    # held: the bigram pages, the nameless-LoRA and salted pages; not the orphan, not the other block size
    assert value(got, "kvalign_watch_router_blocks_held") == blocks(bigram) + blocks(nameless) + blocks(salted)
    assert value(got, "kvalign_watch_last_batch_timestamp_seconds") > time.time() - 60
    (cause,) = [dict(labels) for name, labels in got if name == "kvalign_watch_last_cause_info"]
    assert cause == {"worker": WORKER, "cause": "BLOCK_SIZE", "description": "block size mismatch", "seq": str(seqs[-1])}


def test_blocks_held_per_tier_and_unmapped_media_from_real_hicache_events(sglang_available):
    """SGLang's real HiCache tier (stand-in transfers) backs pages up to host and evicts them from device;
    the same events with the host medium renamed (what a renamed ``StorageMedium`` would send) are the
    negative control: no host blocks, all of them counted as indexed nowhere."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from kvalign.standins.hicache import version_problem
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.streams.watch import Watcher
    from kvalign.streams.watch_metrics import WatchCollector

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    kv = sglang_events_module()
    engine = HiCacheEngine(B, eagle=False, core="unified", policy="write_through", host_tokens=1 << 20)
    engine.take_raw_events()
    engine.serve(list(range(1, 13)))  # 3 pages on device
    engine.transfers_done()  # backed up: the same 3 pages on host
    engine.serve(list(range(50, 58)))  # 2 more pages, device only (not polled)
    stored = engine.take_raw_events()
    engine.evict(3 * B)  # the least recent 3 device pages go; their host copies stay
    evicted = engine.take_raw_events()
    assert {_medium(e) for e in stored} == {"GPU", "CPU_PINNED"}

    def scrape_after(batches: list[list]) -> dict:
        watcher = Watcher(block_size=B)
        for seq, events in enumerate(batches):
            payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=time.time(), events=list(events)))
            watcher.on_frames([b"", seq.to_bytes(8, "big"), payload])
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WatchCollector({WORKER: watcher}))
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    got = scrape_after([stored, evicted])
    host = blocks([e for e in stored if _medium(e) == "CPU_PINNED"])
    device = blocks([e for e in stored if _medium(e) == "GPU"]) - sum(
        len(e.block_hashes) for e in evicted if type(e).__name__ == "BlockRemoved")
    assert (host, device) == (3, 2)
    assert {t: value(got, "kvalign_watch_blocks_held", tier=t) for t in ("device", "host_pinned", "disk", "external")} == {
        "device": device, "host_pinned": host, "disk": 0, "external": 0}
    assert not [k for k in got if k[0] == "kvalign_watch_unmapped_medium_blocks_total"]

    renamed = [[msgspec.structs.replace(e, medium="HOST_PINNED") if _medium(e) == "CPU_PINNED" else e for e in batch]
               for batch in (stored, evicted)]
    bad = scrape_after(renamed)
    assert value(bad, "kvalign_watch_blocks_held", tier="host_pinned") == 0
    assert value(bad, "kvalign_watch_blocks_held", tier="device") == device
    assert value(bad, "kvalign_watch_unmapped_medium_blocks_total", medium="HOST_PINNED") == host
    (cause,) = [dict(labels) for name, labels in bad if name == "kvalign_watch_last_cause_info"]
    assert cause["cause"] == "MEDIUM_NOT_INDEXED"
