"""``diagnose`` on image prompts: SGLang 0.5.23's wide pad values, named from a real capture.

The engine's pages are SGLang's real radix cache keyed by SGLang's real pad values (its own
``MultimodalDataItem.set_hash``), published by its real ZmqEventPublisher and captured; the
router's prompt is the frontend's routing sequence, whose pad value for an image hash ``h`` is
``1_000_000 + h % 2**30`` (what Dynamo 1.6.1's frontend sends, checked against the real frontend by
tests/unit/oracles/test_frontend_mm.py; the stand-in computes it).
"""

from __future__ import annotations

from sglang_publisher import captured, sglang_publisher  # noqa: F401 - fixture

from kvalign.model.causes import Cause
from kvalign.oracles.sglang import SglangRadixCache
from kvalign.standins.sglang_scalar_pads import scalar_pad_value
from kvalign.streams.diagnose import RouterSettings, diagnose

B = 4
TEXT = [40, 41, 42, 43, 44, 45]  # 6 text tokens: one whole page before the image, then 2 more
AFTER = [46, 47, 48]
N_PAD = 8
IMAGE_HASH = 0x6D603C1D523F6BED


def engine_pads(item_hash: int, n: int, *, scalar: bool = False) -> list[int]:
    """SGLang's own padding of an image run of ``n`` tokens for ``item_hash``."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    if scalar:
        from kvalign.standins.sglang_scalar_pads import scalar_pads

        with scalar_pads():
            item = MultimodalDataItem(modality=Modality.IMAGE)
            item.set_hash(item_hash)
    else:
        item = MultimodalDataItem(modality=Modality.IMAGE)
        item.set_hash(item_hash)
    return list(item.padding_sequence(n))


def router_prompt(item_hash: int) -> list[int]:
    return TEXT + [scalar_pad_value(item_hash)] * N_PAD + AFTER


def capture(tmp_path, publisher, requests, name="w.jsonl"):
    cache = SglangRadixCache(B, eagle=False)
    with captured(tmp_path, publisher, name=name) as stream:
        for batch in requests:
            for tokens in batch:
                cache.insert(tokens)
            stream.publish(cache.take_raw_events())
    return stream.path


def test_wide_pad_values_are_named(tmp_path, sglang_publisher):
    pads = engine_pads(IMAGE_HASH, N_PAD)
    assert max(pads) > 0xFFFFFFFF  # SGLang 0.5.23's sentinels: the premise of the cause
    path = capture(tmp_path, sglang_publisher, [[TEXT + pads + AFTER]])
    d = diagnose(path, router_prompt(IMAGE_HASH), RouterSettings())
    assert d.cause is Cause.MM_PAD_WIDTH and d.first_divergent == 0  # not even the text page was indexed
    assert d.router["overlap"] == 0 and d.engine["overlap"] == len(TEXT) // B  # the engine holds its text page
    assert str(pads[0]) in d.detail and "drops every batch" in d.detail
    assert any("malformed" in n and "u32" in n for n in d.notes)


def test_a_text_prompt_dropped_with_an_image_requests_batch_is_named(tmp_path, sglang_publisher):
    """One scheduler step finishing a text request and an image request publishes one batch: the
    relay drops it whole, so the text request loses its credit too."""
    text_only = [50 + i for i in range(9)]
    path = capture(tmp_path, sglang_publisher, [[text_only, TEXT + engine_pads(IMAGE_HASH, N_PAD) + AFTER]])
    d = diagnose(path, text_only, RouterSettings())
    assert d.cause is Cause.MM_PAD_WIDTH and d.first_divergent == 0
    assert d.router["overlap"] == 0 and d.engine["overlap"] == len(text_only) // B
    assert "another request's image pages" in d.detail


def test_scalar_pads_of_the_same_image_align(tmp_path, sglang_publisher):
    """With SGLang 0.5.21's pad rule (the stand-in), the frontend's pads are the engine's: full credit."""
    path = capture(tmp_path, sglang_publisher, [[TEXT + engine_pads(IMAGE_HASH, N_PAD, scalar=True) + AFTER]])
    d = diagnose(path, router_prompt(IMAGE_HASH), RouterSettings())
    assert d.cause is None and d.router["overlap"] == d.engine["overlap"] == (len(TEXT) + N_PAD + len(AFTER)) // B


def test_other_u32_pad_values_are_a_note_not_a_finding(tmp_path, sglang_publisher):
    """Other u32 pads at the image are what another image looks like: no cause, a note that says so."""
    path = capture(tmp_path, sglang_publisher, [[TEXT + engine_pads(IMAGE_HASH + 1, N_PAD, scalar=True) + AFTER]])
    d = diagnose(path, router_prompt(IMAGE_HASH), RouterSettings())
    assert d.cause is None and d.router["overlap"] == d.engine["overlap"] == len(TEXT) // B
    assert any("another image" in n for n in d.notes)


def test_cli_names_the_cause(tmp_path, sglang_publisher, capsys):
    import json

    from kvalign.cli import main

    path = capture(tmp_path, sglang_publisher, [[TEXT + engine_pads(IMAGE_HASH, N_PAD) + AFTER]])
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(router_prompt(IMAGE_HASH)))
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt)]) == 1
    assert f"cause: {Cause.MM_PAD_WIDTH.value}" in capsys.readouterr().out
    assert main(["diagnose", "--capture", path, "--prompt", str(prompt), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["cause"]["name"] == "MM_PAD_WIDTH"
