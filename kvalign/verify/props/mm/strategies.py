"""Hypothesis strategies for image prompts: sizes, counts, positions, repeats and one-pixel changes.

A multimodal scenario is two chat requests to one worker: the first is cached, the second is
routed against it. The second is drawn from the first by a *relation*, because where image
traffic lost its cache credit upstream was exactly these cases:

* ``same``   — the identical request again (the image's pages must be credited);
* ``pixel``  — one image changed by one pixel (nothing from that image on may be credited);
* ``prefix`` — the first k parts kept, the rest new (credit up to the first new part);
* ``fresh``  — an unrelated request (only the chat template's framing is shared).

Images are drawn by size (28 to 120 px a side, so 4 to 64 placeholder tokens each after the
model's resize), by seed (pixel content), and repeated within a request; text parts are 0 to 5
words of the tiny model's vocabulary.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, replace
from functools import lru_cache

from hypothesis import strategies as st

from kvalign.oracles.vlm_model import WORDS

#: Page sizes of the multimodal rows: 3 never divides an image's run of 4k tokens, 16 swallows small images.
MM_PAGE_SIZES = (2, 3, 4, 16)
RELATIONS = ("same", "pixel", "prefix", "fresh")
MIN_SIDE, MAX_SIDE = 28, 120


@dataclass(frozen=True)
class Image:
    """One generated image: size, content seed, and an optional one-pixel change at ``dot``."""

    width: int
    height: int
    seed: int
    dot: tuple[int, int] | None = None

    def url(self) -> str:
        """The image as a PNG ``data:`` URL (what a client sends; both sides decode it)."""
        return _png_url(self.width, self.height, self.seed, self.dot)

    def changed(self, x: int, y: int) -> Image:
        """The same image with the pixel at (x, y) (clamped into the image) inverted."""
        return replace(self, dot=(min(x, self.width - 1), min(y, self.height - 1)))


@lru_cache(maxsize=256)
def _png_url(width: int, height: int, seed: int, dot: tuple[int, int] | None) -> str:
    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    if dot is not None:
        x, y = dot
        pixels[y, x] = 255 - pixels[y, x]
    buf = io.BytesIO()
    PILImage.fromarray(pixels, "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


#: One prompt part: ("text", words) or ("image", Image).
MmPart = tuple[str, "str | Image"]


@dataclass(frozen=True)
class MmScenario:
    """Two chat requests to one worker: ``first`` is cached, ``second`` is routed against it."""

    page_size: int
    eagle: bool
    relation: str
    first: tuple[MmPart, ...]
    second: tuple[MmPart, ...]

    def images(self, which: str) -> list[Image]:
        parts = self.first if which == "first" else self.second
        return [v for k, v in parts if k == "image"]  # type: ignore[misc]


def wire_parts(parts: tuple[MmPart, ...]) -> list[tuple[str, str]]:
    """Parts as the frontend oracle sends them (images as data URLs)."""
    return [(k, v.url() if isinstance(v, Image) else v) for k, v in parts]


def images() -> st.SearchStrategy[Image]:
    side = st.integers(MIN_SIDE, MAX_SIDE)
    return st.builds(Image, side, side, st.integers(0, 7))


def _text() -> st.SearchStrategy[MmPart]:
    return st.builds(lambda ws: ("text", " ".join(ws)), st.lists(st.sampled_from(WORDS[1:]), min_size=1, max_size=5))


@st.composite
def request_parts(draw: st.DrawFn, *, min_images: int = 1, max_images: int = 3) -> tuple[MmPart, ...]:
    """Text and images in any order, 1-3 images (an image may repeat), text between them or not."""
    n = draw(st.integers(min_images, max_images))
    pool = draw(st.lists(images(), min_size=min(n, 1), max_size=n))
    parts: list[MmPart] = []
    for i in range(n):
        if draw(st.booleans()):
            parts.append(draw(_text()))
        parts.append(("image", pool[draw(st.integers(0, len(pool) - 1))] if i else pool[0]))
    if draw(st.booleans()):
        parts.append(draw(_text()))
    return tuple(parts)


@st.composite
def mm_scenarios(draw: st.DrawFn, *, eagle: bool, page_sizes: tuple[int, ...] = MM_PAGE_SIZES) -> MmScenario:
    """A cached request and a routed one, related by one of :data:`RELATIONS`."""
    first = draw(request_parts())
    relation = draw(st.sampled_from(RELATIONS))
    if relation == "same":
        second = first
    elif relation == "pixel":
        at = draw(st.sampled_from([i for i, (k, _v) in enumerate(first) if k == "image"]))
        img = first[at][1]
        assert isinstance(img, Image)
        changed = img.changed(draw(st.integers(0, MAX_SIDE)), draw(st.integers(0, MAX_SIDE)))
        second = first[:at] + (("image", changed),) + first[at + 1:]
    elif relation == "prefix":
        keep = draw(st.integers(0, len(first)))
        second = first[:keep] + draw(request_parts(min_images=0 if keep else 1, max_images=2))
    else:
        second = draw(request_parts())
    return MmScenario(page_size=draw(st.sampled_from(page_sizes)), eagle=eagle, relation=relation,
                      first=first, second=second or first)
