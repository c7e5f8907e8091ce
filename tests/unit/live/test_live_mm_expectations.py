"""The live image-prompt run's expectations and its reading of a response (issue 36).

The e2e test once asserted that the one-pixel-changed prompt is credited 0 blocks "on any release":
that is SGLang 0.5.23's pad-width bug (the relay drops every batch holding an image, so the text before
the image is lost too), so on an aligned release, which credits the pages before the image, it failed.
"""

from __future__ import annotations

import pytest

from kvalign.errors import MissingValue
from kvalign.live.runs.mm import MmLiveResult, Turn, turn_from_usage, unmet
from kvalign.model.causes import Cause

B, IMAGE_START, IMAGE_TOKENS = 4, 9, 16  # 2 pages precede the image


def _result(pixel_router_blocks: int, repeat_router_blocks: int, failures: list[str]) -> MmLiveResult:
    def turn(name: str, prompt: int, cached: int, blocks: int) -> Turn:
        return Turn(name, prompt, cached, blocks / -(-prompt // B), B)

    return MmLiveResult(turns=[turn("cold", 32, 0, 0), turn("repeat", 32, 28, repeat_router_blocks),
                               turn("pixel", 32, 8, pixel_router_blocks), turn("text", 20, 0, 0),
                               turn("text again", 20, 16, 4)],
                        failures=failures, image_start=IMAGE_START, image_tokens=IMAGE_TOKENS)


def test_an_aligned_release_that_credits_the_pages_before_a_changed_image_passes():
    aligned = _result(pixel_router_blocks=2, repeat_router_blocks=7, failures=[])
    assert unmet(aligned, wide_pads=False, page_size=B) == []
    # the old assertion (pixel.router_blocks == 0 on any release) failed this run
    assert {t.name: t for t in aligned.turns}["pixel"].router_blocks == 2


def test_the_wide_pad_release_must_show_its_finding_and_a_changed_image_is_never_credited_past_its_start():
    found = _result(0, 0, ["same image prompt again: the router credits 0 blocks, the engine reuses 7 pages"])
    found.cause, found.cause_detail = Cause.MM_PAD_WIDTH, "pad values above u32"
    assert unmet(found, wide_pads=True, page_size=B) == []
    assert unmet(found, wide_pads=False, page_size=B) != []  # a finding on a release that should pass
    assert unmet(_result(0, 7, []), wide_pads=True, page_size=B) != []  # the finding absent where it holds
    assert unmet(_result(3, 7, []), wide_pads=False, page_size=B) != []  # a changed image credited


def test_a_response_without_prompt_tokens_is_an_error_naming_it_not_zero():
    with pytest.raises(MissingValue, match="usage.prompt_tokens"):
        turn_from_usage("repeat", {"prompt_tokens_details": {"cached_tokens": 28}}, 0.5, B)
    assert turn_from_usage("repeat", {"prompt_tokens": 32}, 0.5, B).prompt_tokens == 32
