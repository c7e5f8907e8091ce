"""``diagnose`` names every catalog cause, on misalignments built for real.

Each capture comes from SGLang's real radix cache through its real ZmqEventPublisher over loopback
ZMQ into kvalign's capture loop; the misalignment is made the way it happens in a deployment (a
router flag, a dropped batch, an eviction, a BOS the router's prompt lacks), never by editing
events. Each test asserts the named cause *and* the first divergent block with its windows.
"""

from __future__ import annotations

import json

import pytest
from cause_scenarios import SCENARIOS, diagnose_argv, record
from sglang_publisher import captured, sglang_publisher  # noqa: F401 - fixture

from kvalign.model.causes import Cause
from kvalign.cli import main
from kvalign.streams.diagnose import RouterSettings, diagnose
from kvalign.model.hashing import block_hashes
from kvalign.oracles.sglang import SglangRadixCache

pytestmark = pytest.mark.usefixtures("cli_parser")  # main() runs 21 times in this module

B = 4
PROMPT = list(range(100, 121))  # 21 tokens: 5 plain pages, 5 bigram pages


def capture_of(tmp_path, publisher, *, eagle: bool, inserts, name: str = "w.jsonl", evict: int | None = None):
    """Capture of a real cache after ``inserts`` [(tokens, kwargs)], one batch each."""
    cache = SglangRadixCache(B, eagle=eagle)
    with captured(tmp_path, publisher, name=name) as stream:
        for tokens, kw in inserts:
            cache.insert(tokens, **kw)
            stream.publish(cache.take_raw_events())
        if evict is not None:
            cache.evict(evict)
            stream.publish(cache.take_raw_events())
    return stream.path


@pytest.mark.parametrize("eagle", [False, True])
def test_aligned_router_reports_no_divergence(tmp_path, sglang_publisher, eagle):
    path = capture_of(tmp_path, sglang_publisher, eagle=eagle, inserts=[(PROMPT, {})])
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is None and d.first_divergent is None
    assert d.router["eagle"] is eagle and d.router["overlap"] == d.router["blocks"] == 5
    # the router's arithmetic: overlap / ceil(prompt tokens / B) = 5 / ceil(21 / 4)
    assert d.router["kv_hit_rate"] == round(5 / 6, 6) and d.engine["overlap"] == 5


def test_router_eagle_off_against_bigram_keys(tmp_path, sglang_publisher):
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT, {})])
    d = diagnose(path, PROMPT, RouterSettings(eagle="off"))
    assert d.cause is Cause.ROUTER_EAGLE_OFF and d.first_divergent == 0
    assert d.router["overlap"] == 0 and d.engine["overlap"] == 5
    assert d.router_block.tokens == PROMPT[:B] and d.engine_block.tokens == PROMPT[: B + 1]
    assert d.router_block.hash == block_hashes(PROMPT, B)[0]
    assert d.engine_block.hash == block_hashes(PROMPT, B, eagle=True)[0]
    assert d.engine_block.engine_block_hash is not None


def test_router_eagle_on_against_plain_keys(tmp_path, sglang_publisher):
    path = capture_of(tmp_path, sglang_publisher, eagle=False, inserts=[(PROMPT, {})])
    d = diagnose(path, PROMPT, RouterSettings(eagle="on"))
    assert d.cause is Cause.ROUTER_EAGLE_ON and d.first_divergent == 0
    assert d.router["overlap"] == 0 and d.engine["overlap"] == 5
    assert d.router_block.tokens == PROMPT[: B + 1] and d.engine_block.tokens == PROMPT[:B]


def test_block_size_mismatch(tmp_path, sglang_publisher):
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT, {})])
    d = diagnose(path, PROMPT, RouterSettings(block_size=8))
    assert d.cause is Cause.BLOCK_SIZE and d.first_divergent == 0
    assert (d.router["block_size"], d.engine["block_size"]) == (8, 4)
    assert d.router["overlap"] == 0 and d.engine["overlap"] == 5
    assert d.router_block.end - d.router_block.start == 9 and d.engine_block.end == 5


@pytest.mark.parametrize(
    ("engine_kw", "router", "cause"),
    [
        ({"lora_name": "loraA"}, RouterSettings(), Cause.LORA_DROPPED),
        ({"cache_salt": "tenant-1"}, RouterSettings(), Cause.NAMESPACE_DROPPED),
        ({"cache_salt": "tenant-1"}, RouterSettings(namespace="tenant-2"), Cause.SEED_DRIFT),
        ({}, RouterSettings(lora="loraA"), Cause.SEED_DRIFT),
    ],
    ids=["lora-dropped", "namespace-dropped", "namespace-drift", "lora-added"],
)
def test_seed_drift(tmp_path, sglang_publisher, engine_kw, router, cause):
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT, engine_kw)])
    d = diagnose(path, PROMPT, router)
    assert d.cause is cause and d.first_divergent == 0
    assert d.router["overlap"] == 0 and d.engine["overlap"] == 5
    assert d.engine["lora"] == engine_kw.get("lora_name") and d.engine["namespace"] == engine_kw.get("cache_salt")
    assert d.router_block.tokens == d.engine_block.tokens and d.router_block.hash != d.engine_block.hash
    aligned = diagnose(path, PROMPT, RouterSettings(lora=engine_kw.get("lora_name"), namespace=engine_kw.get("cache_salt")))
    assert aligned.cause is None and aligned.router["overlap"] == 5


def test_prompt_shifted_by_a_bos_the_router_lacks(tmp_path, sglang_publisher):
    bos = 1
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[([bos, *PROMPT], {})])
    d = diagnose(path, PROMPT, RouterSettings())
    # k counts the prompt's extra leading tokens: the prompt lacks the engine's BOS, so k = -1
    assert d.cause is Cause.PROMPT_SHIFT and d.shift == -1 and d.first_divergent == 0
    assert d.router["overlap"] == 0
    assert d.engine_block.tokens == [bos, *PROMPT[:B]]  # the engine's real first page
    assert d.engine_block.engine_block_hash is not None
    assert d.detail.startswith("this prompt lacks 1 leading token that the engine's sequence has") and "k = -1" in d.detail


def test_prompt_with_extra_leading_tokens(tmp_path, sglang_publisher, capsys):
    path = capture_of(tmp_path, sglang_publisher, eagle=False, inserts=[(PROMPT[2:], {})])
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is Cause.PROMPT_SHIFT and d.shift == 2 and d.first_divergent == 0
    assert d.engine_block.tokens == PROMPT[2 : 2 + B]
    assert d.detail.startswith("this prompt has 2 extra leading tokens that the engine's sequence lacks, so k = +2")
    # the same k, with the same sign, in the text and the JSON
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt)]) == 1
    assert "cause: prompt shifted by k tokens (template or BOS drift) (k = +2) [cache-blind]" in capsys.readouterr().out
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["shift"] == 2 and report["cause"]["class"] == "cache-blind"


def test_evicted_blocks(tmp_path, sglang_publisher):
    other = PROMPT[: 2 * B] + [7] * 12  # shares 2 pages, so the prompt's tail is its own leaf
    path = capture_of(tmp_path, sglang_publisher, eagle=False, inserts=[(PROMPT, {}), (other, {})], evict=1)
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is Cause.EVICTED and d.first_divergent == 2
    assert d.router["overlap"] == d.engine["overlap"] == 2 and d.engine["ever_stored"] == 5
    assert d.engine_block.tokens == PROMPT[2 * B : 3 * B] and d.engine_block.removed_seq is not None


def lossy_capture(tmp_path, publisher, steps, *, eagle=True, name="w.jsonl"):
    """Capture of a real cache through a lossy ZMQ hop; ``steps`` = [(action, drop)], action = tokens or "clear"."""
    cache = SglangRadixCache(B, eagle=eagle)
    with captured(tmp_path, publisher, lossy=True, name=name) as stream:
        for action, drop in steps:
            if action == "clear":
                events = [publisher.warm_up_event()]  # SGLang's own AllBlocksCleared
                cache = SglangRadixCache(B, eagle=eagle)
            else:
                cache.insert(action)
                events = cache.take_raw_events()
            stream.publish(events, drop=drop)
    return stream.path


def test_sequence_gap(tmp_path, sglang_publisher):
    path = lossy_capture(tmp_path, sglang_publisher,
                         [(PROMPT[: 2 * B + 1], False), (PROMPT[: 3 * B + 1], True), (PROMPT, False)])
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is Cause.SEQUENCE_GAP and d.first_divergent == 2 and d.confidence == "confirmed"
    assert d.router["overlap"] == d.engine["overlap"] == 2 and d.capture_stats["gaps"] == 1
    assert d.engine_block.tokens == PROMPT[2 * B : 3 * B + 1] and d.engine_block.engine_block_hash is not None
    assert d.engine_block.stored_seq is None  # never received
    assert d.engine["holds"] == 5  # blocks 2 (lost) and 3..4 (orphaned) count too
    assert d.detail.startswith("the engine stored block 2 of this prompt in a batch the router never received "
                               "(the stream skips seq ")


def test_gap_that_stored_the_prompts_last_block(tmp_path, sglang_publisher, capsys):
    """The issue's stream: the lost batch stored the prompt's last block; a later batch extended it.

    Nothing stored later is a block of this prompt, yet the later event's parent is SGLang's own
    hash of block 2, so the engine holds it and the router (which drops the orphan) does not.
    """
    prompt = PROMPT[: 3 * B + 1]  # 3 bigram pages
    path = lossy_capture(tmp_path, sglang_publisher,
                         [(PROMPT[: 2 * B + 1], False), (prompt, True), (PROMPT, False)])
    d = diagnose(path, prompt, RouterSettings())
    assert d.cause is Cause.SEQUENCE_GAP and d.first_divergent == 2 and d.confidence == "confirmed"
    assert d.router["overlap"] == 2 and d.router["blocks"] == 3
    assert "the event at seq" in d.detail and "which is SGLang's own hash of this prompt's block 2" in d.detail
    assert d.engine_block.engine_block_hash is not None and f"parent {d.engine_block.engine_block_hash}," in d.detail
    prompt_file = tmp_path / "prompt.json"
    prompt_file.write_text(json.dumps(prompt))
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt_file)]) == 1
    out = capsys.readouterr().out
    assert "cause: sequence gap / dropped batch (confirmed)" in out and "no divergence" not in out
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt_file), "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert j["cause"]["name"] == "SEQUENCE_GAP" and j["confidence"] == "confirmed"


def test_gap_with_orphans_that_cannot_be_tied_to_the_prompt(tmp_path, sglang_publisher):
    """The lost batch stored block 2 *and* another sequence's pages; only the other one is extended later."""
    other = [9] * (2 * B + 1)
    cache = SglangRadixCache(B, eagle=True)
    with captured(tmp_path, sglang_publisher, lossy=True) as stream:
        cache.insert(PROMPT[: 2 * B + 1])
        stream.publish(cache.take_raw_events())
        cache.insert(PROMPT[: 3 * B + 1])
        cache.insert(other)
        stream.publish(cache.take_raw_events(), drop=True)
        cache.insert([*other, *([8] * 2 * B)])
        stream.publish(cache.take_raw_events())
    d = diagnose(stream.path, PROMPT, RouterSettings())
    assert d.cause is Cause.SEQUENCE_GAP and d.first_divergent == 2 and d.confidence == "possible"
    assert d.detail.startswith("the engine may have stored block 2 in a batch the router never received")


def test_gap_without_later_stores_is_not_blamed(tmp_path, sglang_publisher):
    """A lost batch after block 1 but no orphan: agreement, with the gap named as a caveat."""
    path = lossy_capture(tmp_path, sglang_publisher, [(PROMPT[: 2 * B + 1], False), (PROMPT[: 3 * B + 1], True),
                                                      ([5] * 9, False)])
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is None and d.confidence is None and d.router["overlap"] == 2
    assert "never stored block 2" in d.detail and "a lost store of block 2 cannot be ruled out" in d.detail


def test_gap_before_a_clear_is_irrelevant(tmp_path, sglang_publisher):
    """A batch lost before the engine cleared its cache cannot hold what the prompt misses now."""
    path = lossy_capture(tmp_path, sglang_publisher, [(PROMPT, True), ("clear", False), (PROMPT[: 2 * B + 1], False)])
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is None and d.capture_stats["gaps"] == 1
    assert d.detail == "router and engine agree: the engine never stored block 2 of this prompt (2/5 blocks cached)"


def test_prompt_shorter_than_one_eagle_block(tmp_path, sglang_publisher):
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT, {})])
    d = diagnose(path, PROMPT[:B], RouterSettings())
    assert d.cause is Cause.PROMPT_TOO_SHORT and d.first_divergent == 0
    assert d.router["blocks"] == 0 and d.router["kv_hit_rate"] == 0.0  # the router still counts 1 block
    assert d.router_block.tokens == PROMPT[:B] and d.router_block.hash is None


def test_uncached_prompt_is_agreement_not_divergence(tmp_path, sglang_publisher):
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT[: 2 * B + 1], {})])
    d = diagnose(path, PROMPT, RouterSettings())
    assert d.cause is None and d.router["overlap"] == 2 and "never stored block 2" in d.detail


def test_cli_exit_codes_and_json(tmp_path, sglang_publisher, capsys):
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT, {})])
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(PROMPT))
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt)]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt), "--router-eagle", "off", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["cause"]["name"] == "ROUTER_EAGLE_OFF" and out["first_divergent"] == 0
    assert out["router"]["kv_hit_rate"] == 0 and out["engine"]["kv_hit_rate"] == round(5 / 6, 6)


def test_text_prompt_through_a_local_tokenizer(tmp_path, sglang_publisher):
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(len(PROMPT))]
    vocab = {w: t for w, t in zip(words, PROMPT)} | {"[UNK]": 0}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    text = tmp_path / "prompt.txt"
    text.write_text(" ".join(words))
    path = capture_of(tmp_path, sglang_publisher, eagle=True, inserts=[(PROMPT, {})])
    assert main(["diagnose", "--capture", path, "--prompt", str(text), "--tokenizer", str(tok_dir),
                 "--router-eagle", "off"]) == 1


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_every_cause_scenario_through_the_cli(tmp_path, sglang_publisher, capsys, scenario):
    capture, prompt = record(scenario, str(tmp_path), sglang_publisher)
    rc = main([*diagnose_argv(scenario, capture, prompt), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == (0 if scenario.cause is None else 1)
    assert (out["cause"] or {}).get("name") == scenario.cause
    assert out["first_divergent"] == scenario.first_block
    if scenario.cause == "PROMPT_SHIFT":  # k = the prompt's extra leading tokens, same sign everywhere
        assert out["shift"] == {"prompt-shift": -1, "prompt-extra-token": 1}[scenario.name]
    if scenario.cause == "SEQUENCE_GAP":
        assert out["confidence"] == "confirmed"


def _hicache_capture(tmp_path, publisher, prompt: list[int], name: str) -> str:
    """SGLang's real HiCache tier (write-through; stand-in transfers): ``prompt`` cached, backed up to
    host, then every device page evicted. Its host copies stay."""
    from kvalign.standins.hicache import version_problem
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.oracles.sglang import sglang_version

    if version_problem(sglang_version()):
        pytest.skip(version_problem(sglang_version()))
    engine = HiCacheEngine(B, eagle=False, core="unified", policy="write_through", host_tokens=1 << 20)
    engine.take_raw_events()
    with captured(tmp_path, publisher, name=name) as stream:
        engine.serve(prompt)  # a request served by SGLang's scheduler code: its whole pages are cached
        engine.transfers_done()
        stream.publish(engine.take_raw_events())
        engine.evict(len(prompt))
        stream.publish(engine.take_raw_events())
    assert engine.residency(prompt).device == 0 and engine.residency(prompt).host == len(prompt) // B
    return stream.path


def test_host_credit_below_sglangs_load_back_threshold_is_named(tmp_path, sglang_publisher, capsys):
    """Two host-only pages of 4 = 8 tokens < 10, asked for by a 9-token prompt (SGLang's scheduler matches
    8): SGLang declines the load-back; diagnose names the finding and exits 1. Three pages = 12 tokens:
    SGLang loads them back, no finding (the control)."""
    short = _hicache_capture(tmp_path, sglang_publisher, PROMPT[:8], "short.jsonl")
    d = diagnose(short, PROMPT[:9], RouterSettings())
    assert len(d.findings) == 1 and d.findings[0].startswith("HOST_CREDIT_NOT_SERVABLE: the engine holds blocks 0..1")
    assert "8 tokens, below SGLang's load_back_threshold (10)" in d.findings[0]
    assert main(["diagnose", "--capture", short, "--prompt", _prompt_file(tmp_path, PROMPT[:9])]) == 1
    assert "finding: HOST_CREDIT_NOT_SERVABLE: " in capsys.readouterr().out
    long = _hicache_capture(tmp_path, sglang_publisher, PROMPT[:12], "long.jsonl")
    assert diagnose(long, PROMPT[:13], RouterSettings()).findings == []


def test_host_credit_stops_at_sglangs_prompt_cap(tmp_path, sglang_publisher):
    """The 8-token prompt itself: SGLang's scheduler matches at most 7 tokens, so only block 0 (4 tokens) is
    inside the cap; block 1 is computed again whatever its tier and is not part of the finding."""
    short = _hicache_capture(tmp_path, sglang_publisher, PROMPT[:8], "short.jsonl")
    (finding,) = diagnose(short, PROMPT[:8], RouterSettings()).findings
    assert finding.startswith("HOST_CREDIT_NOT_SERVABLE: the engine holds block 0 of") and "4 tokens" in finding


def _prompt_file(tmp_path, tokens: list[int]) -> str:
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(tokens))
    return str(path)


def test_load_back_threshold_is_sglangs_own():
    """The threshold diagnose names is the constant the installed SGLang's init_hicache assigns."""
    import ast
    import inspect

    from kvalign.streams.diagnose import LOAD_BACK_THRESHOLD

    try:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except ImportError as exc:
        pytest.skip(f"SGLang's unified cache unavailable: {exc}")
    tree = ast.parse(inspect.getsource(UnifiedRadixCache.init_hicache).lstrip().replace("\n    ", "\n"))
    assigned = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                and any(isinstance(t, ast.Attribute) and t.attr == "load_back_threshold" for t in n.targets)]
    assert assigned == [LOAD_BACK_THRESHOLD]
