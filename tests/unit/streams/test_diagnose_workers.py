"""``diagnose`` across workers: each worker's overlap as the router computes it, and why it chose.

Every capture comes from SGLang's real radix cache through its real ZmqEventPublisher into
kvalign's capture loop (a real lossy ZMQ hop for the dropped batch). The per-worker overlaps
kvalign predicts are held to Dynamo's real ``RadixTree`` fed the same captures through the relay.
"""

from __future__ import annotations

import json

import pytest
from sglang_publisher import captured, sglang_publisher  # noqa: F401 - fixture

from kvalign.streams.capture import CaptureReader, expand_event
from kvalign.model.causes import Cause
from kvalign.cli import main
from kvalign.streams.diagnose import RouterSettings
from kvalign.streams.diagnose_workers import diagnose_workers
from kvalign.model.hashing import block_hashes
from kvalign.oracles.sglang import SglangRadixCache
from kvalign.model.relay import Relay

B = 4
PROMPT = list(range(100, 121))  # 21 tokens: 5 bigram pages


def worker_capture(tmp_path, publisher, name, steps, *, eagle=True):
    """A real worker's capture: ``steps`` = [(tokens, drop)], one batch per insert."""
    cache = SglangRadixCache(B, eagle=eagle)
    with captured(tmp_path, publisher, name=name, lossy=any(drop for _, drop in steps)) as stream:
        for tokens, drop in steps:
            cache.insert(tokens)
            stream.publish(cache.take_raw_events(), drop=drop)
    return stream.path


def dynamo_overlaps(dynamo_tree, paths, tokens, *, eagle):
    """Dynamo's real RadixTree after the relay ingests each capture as worker 1, 2, ..."""
    tree = dynamo_tree()
    for wid, path in enumerate(paths, start=1):
        relay = Relay(B)
        with CaptureReader(path) as reader:
            for batch in reader.batches():
                for ev in batch.ev:
                    out = relay.convert(expand_event(ev))
                    if out is not None:
                        tree.apply(wid, out)
    got = tree.overlap(block_hashes(tokens, B, eagle=eagle))
    return [got.get(wid, 0) for wid in range(1, len(paths) + 1)]


@pytest.fixture()
def two_workers(tmp_path, sglang_publisher):
    """A holds the whole prompt; B holds its first 2 pages."""
    a = worker_capture(tmp_path, sglang_publisher, "a.jsonl", [(PROMPT, False)])
    b = worker_capture(tmp_path, sglang_publisher, "b.jsonl", [(PROMPT[: 2 * B + 1], False)])
    return a, b


def test_favours_the_worker_with_the_most_cached_blocks(two_workers, dynamo_tree):
    rd = diagnose_workers(list(two_workers), PROMPT, RouterSettings(), names=["A", "B"])
    assert [v.router_overlap for v in rd.workers] == [5, 2] == dynamo_overlaps(dynamo_tree, two_workers, PROMPT, eagle=True)
    assert [v.kv_hit_rate for v in rd.workers] == [round(5 / 6, 6), round(2 / 6, 6)]
    assert rd.favoured == rd.aligned_favoured == ["A"] and not rd.findings and not rd.misaligned
    assert rd.verdict == "a KV-aware router with equal load favours A (5/5 blocks)"


def test_router_eagle_off_names_the_cause_per_worker(two_workers, dynamo_tree):
    rd = diagnose_workers(list(two_workers), PROMPT, RouterSettings(eagle="off"), names=["A", "B"])
    assert [v.router_overlap for v in rd.workers] == [0, 0] == dynamo_overlaps(dynamo_tree, two_workers, PROMPT, eagle=False)
    assert [v.engine_overlap for v in rd.workers] == [5, 2]
    assert rd.favoured == [] and rd.aligned_favoured == ["A"] and rd.misaligned
    assert [v.cause for v in rd.workers] == [Cause.ROUTER_EAGLE_OFF] * 2
    assert rd.findings[0].startswith("A: the router credits 0/5 blocks, the engine holds 5: router eagle off vs engine "
                                     "bigram keys at block 0: ")
    assert "an aligned router would favour A (5/5 blocks)" in rd.verdict


def test_why_the_router_sent_the_request_to_b_not_a(tmp_path, sglang_publisher, dynamo_tree, capsys):
    """A really holds the whole prompt, but the router missed the batch that stored A's block 2."""
    a = worker_capture(tmp_path, sglang_publisher, "a.jsonl",
                       [(PROMPT[: 2 * B + 1], False), (PROMPT[: 3 * B + 1], True), (PROMPT, False)])
    b = worker_capture(tmp_path, sglang_publisher, "b.jsonl", [(PROMPT[: 3 * B + 1], False)])
    rd = diagnose_workers([a, b], PROMPT, RouterSettings(), names=["A", "B"], reported_worker="B",
                          reported_kv_hit_rate=0.5)
    assert [v.router_overlap for v in rd.workers] == [2, 3] == dynamo_overlaps(dynamo_tree, [a, b], PROMPT, eagle=True)
    assert rd.favoured == ["B"] and rd.aligned_favoured == ["A"]
    assert rd.reported.matches is True and rd.reported.implied_overlap == 3
    assert rd.workers[0].cause is Cause.SEQUENCE_GAP and rd.workers[0].diagnosis.confidence == "confirmed"
    assert rd.workers[1].cause is None and rd.misaligned
    assert "the router chose B as its index says, but A really holds more: the router is blind to it" in rd.verdict
    assert rd.findings[0].startswith("A: the router credits 2/5 blocks, the engine holds 5: sequence gap / dropped "
                                     "batch (confirmed) at block 2: the engine stored block 2")
    # the same through the CLI, text and JSON
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    argv = ["diagnose", "--capture", a, "--capture", b, "--worker", "A", "--worker", "B", "--prompt", str(prompt),
            "--router-worker", "B", "--router-kv-hit-rate", "0.5"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "  B *     3/5" in out and "router reported: B, kv_hit_rate 0.5 (marked *)" in out
    assert main([*argv, "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert j["favoured"] == ["B"] and j["aligned_favoured"] == ["A"] and j["reported"]["matches"] is True
    assert j["workers"][0]["diagnosis"]["cause"]["name"] == "SEQUENCE_GAP"


def test_reported_hit_rate_that_only_a_misconfigured_router_gives(two_workers):
    rd = diagnose_workers(list(two_workers), PROMPT, RouterSettings(), names=["A", "B"], reported_worker="B",
                          reported_kv_hit_rate=0.0)
    assert rd.reported.matches is False and rd.misaligned
    assert rd.reported.explained_by["eagle"] is False
    assert rd.reported.explained_by["cause"]["name"] == "ROUTER_EAGLE_OFF"
    assert rd.findings == ["the router reported kv_hit_rate 0 for B (0 of 6 blocks), but with the settings given "
                           "kvalign predicts 0.333 (2 blocks); block size 4, eagle off, lora -, namespace - reproduces "
                           "it, so the router most likely runs with those settings (router eagle off vs engine bigram "
                           "keys)"]


def test_choice_made_on_load_is_not_a_misalignment(two_workers):
    rd = diagnose_workers(list(two_workers), PROMPT, RouterSettings(), names=["A", "B"], reported_worker="B",
                          reported_kv_hit_rate=2 / 6)
    assert rd.reported.matches is True and not rd.misaligned
    assert "the router chose B although its own index credits A with more blocks, so load" in rd.verdict


@pytest.mark.parametrize(("extra", "message"), [
    (["--router-worker", "Z"], "--router-worker 'Z' is not one of the workers (A, B)"),
    (["--router-kv-hit-rate", "1.5"], "must be in [0, 1], got 1.5"),
    (["--worker", "C"], "3 --worker names for 2 captures"),
])
def test_bad_routing_input_is_one_line(two_workers, tmp_path, capsys, extra, message):
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    argv = ["diagnose", "--capture", two_workers[0], "--capture", two_workers[1], "--worker", "A", "--worker", "B",
            "--prompt", str(prompt), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_an_evicted_worker_is_explained_but_not_a_misalignment(tmp_path, sglang_publisher):
    other = PROMPT[: 2 * B + 1] + [7] * 12  # shares 2 pages, so the prompt's tail is its own leaf
    cache = SglangRadixCache(B, eagle=True)
    with captured(tmp_path, sglang_publisher, name="a.jsonl") as stream:
        for tokens in (PROMPT, other):
            cache.insert(tokens)
            stream.publish(cache.take_raw_events())
        cache.evict(1)
        stream.publish(cache.take_raw_events())
    b = worker_capture(tmp_path, sglang_publisher, "b.jsonl", [(PROMPT[: B + 1], False)])
    rd = diagnose_workers([stream.path, b], PROMPT, RouterSettings(), names=["A", "B"])
    assert [v.router_overlap for v in rd.workers] == [2, 1] and rd.workers[0].cause is Cause.EVICTED
    assert rd.favoured == rd.aligned_favoured == ["A"] and not rd.misaligned
    assert rd.findings[0].startswith("A: the router credits 2/5 blocks, the engine holds 2: blocks evicted")


def test_a_worker_that_stored_nothing_counts_as_overlap_zero(two_workers, tmp_path, sglang_publisher):
    with captured(tmp_path, sglang_publisher, name="idle.jsonl") as stream:
        pass  # only SGLang's AllBlocksCleared (the warm-up) reaches this capture
    rd = diagnose_workers([two_workers[0], stream.path], PROMPT, RouterSettings(), names=["A", "idle"])
    assert [v.router_overlap for v in rd.workers] == [5, 0] and rd.workers[1].cause is None
    assert rd.favoured == ["A"] and not rd.misaligned
