"""Image prompts live: the real CPU engine serving a tiny Qwen2-VL behind the real frontend and router.

One aggregated ``python -m dynamo.sglang`` worker on CPU (SGLang's scheduler, Qwen2-VL vision
tower and language model, ``UnifiedRadixCache``, ZMQ KV events) serves the random-weight model of
:mod:`kvalign.live.engines.vlm_engine_model`; ``dynamo.frontend --router-mode kv`` preprocesses each
chat request's image itself (its multimodal routing sequence) and routes it. The requests:

1. ``cold``   — a prompt with one image (nothing cached);
2. ``repeat`` — the same prompt again: the router's credit must equal the engine's reuse, and
   reach past the image (its pages are reusable);
3. ``pixel``  — the image with one pixel changed: neither side may credit a page of the image;
4. ``text`` / ``text again`` — a text-only prompt twice: the router's credit for text on the same
   cluster, so a failure of (2) is about images.

The router's credit is ``nvext.timing.kv_hit_rate`` times its block count, ``ceil(prompt tokens /
B)`` (the frontend pads its routing sequence to whole blocks); the engine's reuse is
``usage.prompt_tokens_details.cached_tokens`` (SGLang's own ``match_prefix``), in pages. They must
be equal but for SGLang's last-page rule (it always computes a prompt's last token, so a prompt
ending on a page boundary is reused one page short of what the router credits:
:func:`kvalign.live.runs.fuzz.views.last_page_overcredit`); the image prompt is 17 tokens, off the
boundary at the default page size 4. A failed
check names its cause by running :func:`kvalign.streams.diagnose.diagnose` on the worker's live
capture with the prompt's tokens before the image (the text pages every router should credit).

``scalar_pads``: the workers key images with SGLang 0.5.21's pad rule (the shipped pair's, the
frontend's), the aligned control: :mod:`kvalign.standins.sglang_scalar_pads`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvalign.live.cluster.lifecycle import Cluster, make_plan
from kvalign.live.cluster.topology import Topology
from kvalign.live.engines.sglang_cpu import SglangCpuWorkerKind, release_dir
from kvalign.live.engines.vlm_engine_model import write_vlm_model
from kvalign.errors import MissingValue
from kvalign.live.wire.client import stream_chat
from kvalign.model.causes import Cause
from kvalign.oracles import vlm_model as vm
from kvalign.standins import sglang_scalar_pads

#: Three words before the image, the image (56x56 -> 4 placeholder tokens), three after: 17 tokens.
IMAGE = (56, 56, 1)
CHANGED_PIXEL = (3, 3)


@dataclass(frozen=True)
class MmLiveOptions:
    page_size: int = 4
    max_tokens: int = 4
    scalar_pads: bool = False
    startup_timeout_s: float = 600.0
    sglang_version: str | None = None
    keep_logs: bool = False


@dataclass
class Turn:
    """One request: what the engine reused and what the router credited."""

    name: str
    prompt_tokens: int
    cached_tokens: int | None
    kv_hit_rate: float | None
    page_size: int

    @property
    def router_blocks(self) -> int | None:
        if self.kv_hit_rate is None:
            return None
        return round(self.kv_hit_rate * math.ceil(self.prompt_tokens / self.page_size))

    @property
    def engine_pages(self) -> int | None:
        return None if self.cached_tokens is None else self.cached_tokens // self.page_size


@dataclass
class MmLiveResult:
    turns: list[Turn] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    cause: Cause | None = None
    cause_detail: str = ""
    image_start: int = 0
    image_tokens: int = 0
    capture: str | None = None

    @property
    def passed(self) -> bool:
        return not self.failures


def image_parts(changed: bool = False) -> list[dict[str, Any]]:
    from kvalign.verify.props.mm.strategies import Image

    img = Image(*IMAGE, dot=CHANGED_PIXEL if changed else None)
    return [{"type": "text", "text": "describe this image"}, {"type": "image_url", "image_url": {"url": img.url()}},
            {"type": "text", "text": "what is in"}]


TEXT_PROMPT = "the quick brown fox jumps over the lazy dog near the quiet river"


def prefix_before_image() -> list[int]:
    """The prompt's token ids up to and including ``<|vision_start|>``, as the frontend tokenises them."""
    text = f"<|im_start|>user {image_parts()[0]['text']}<|vision_start|>"
    return vm.build_tokenizer().encode(text).ids


def plan_mm(run_dir: str | Path, opts: MmLiveOptions) -> tuple[Any, SglangCpuWorkerKind]:
    version, sglang_dir = release_dir(opts.sglang_version)
    run = Path(run_dir).resolve()
    model = write_vlm_model(run / "models" / vm.MODEL_NAME)
    plan = make_plan(Topology.aggregated(1, eagle=False, page_size=opts.page_size), run, str(model),
                     model_name=vm.MODEL_NAME)
    env = {sglang_scalar_pads.ENABLE_ENV: "1"} if opts.scalar_pads else {}
    return plan, SglangCpuWorkerKind(None, sglang_version=version, sglang_dir=sglang_dir, extra_env=env)


def _ask(cluster: Cluster, name: str, content: Any, opts: MmLiveOptions, label: str, *, stores: bool = True) -> Turn:
    """One turn. ``stores``: whether the engine stores pages for it, whose events must reach the router's
    index before the next turn. A turn that repeats the one before it word for word (greedy decoding:
    the same output too) finds its prompt and output already cached and publishes nothing, so waiting for
    its batch sat out the whole 10 s bound (twice a run, seen in the frontend's log)."""
    before = cluster.capture.count(label) if cluster.capture else 0
    res = stream_chat(cluster.frontend_url, cluster.model, content, max_tokens=opts.max_tokens, timeout_s=120.0)
    turn = turn_from_usage(name, res.usage, res.kv_hit_rate, opts.page_size)
    if cluster.capture is not None and stores:  # the request's pages reach the router's index before the next request
        cluster.capture.wait_for(lambda snap: sum(c.label == label for c in snap) > before, 10.0)
        time.sleep(0.5)
    return turn


def turn_from_usage(name: str, usage: dict[str, Any], kv_hit_rate: float | None, page_size: int) -> Turn:
    """A turn from the response's ``usage``. A response without ``prompt_tokens`` is an error naming it: read
    as 0, it would look exactly like the MM_PAD_WIDTH symptom (an image prompt credited nothing)."""
    if usage.get("prompt_tokens") is None:
        raise MissingValue("usage.prompt_tokens", f"the {name!r} turn's response")
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    return Turn(name, int(usage["prompt_tokens"]), details.get("cached_tokens"), kv_hit_rate, page_size)


def run_mm(run_dir: str | Path, opts: MmLiveOptions, *, progress: Callable[[str], None] = lambda _m: None) -> MmLiveResult:
    """Start the cluster, send the five requests, check them; the cluster is always stopped."""
    plan, kind = plan_mm(run_dir, opts)
    result = MmLiveResult()
    with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s, keep_logs=opts.keep_logs) as cluster:
        progress(f"cluster ready in {cluster.ready_s:.1f}s (1 worker serving {plan.model_name}, page size "
                 f"{opts.page_size}{', scalar pads' if opts.scalar_pads else ''})")
        label = next(iter(cluster.workers))
        result.capture = cluster.capture.capture_path(label) if cluster.capture else None
        previous = None
        for name, content in (("cold", image_parts()), ("repeat", image_parts()), ("pixel", image_parts(changed=True)),
                              ("text", TEXT_PROMPT), ("text again", TEXT_PROMPT)):
            turn = _ask(cluster, name, content, opts, label, stores=content != previous)
            previous = content
            progress(f"{name}: {turn.prompt_tokens} prompt tokens, engine reused {turn.cached_tokens} tokens "
                     f"({turn.engine_pages} pages), router kv_hit_rate {turn.kv_hit_rate} ({turn.router_blocks} blocks)")
            result.turns.append(turn)
        check(result, opts)
        if result.failures and result.capture:
            name_cause(result, opts)
    return result


def check(result: MmLiveResult, opts: MmLiveOptions) -> None:
    """The live assertions (each failure one line)."""
    b = opts.page_size
    turns = {t.name: t for t in result.turns}
    result.image_start = len(prefix_before_image())
    result.image_tokens = turns["cold"].prompt_tokens - len(prefix_before_image()) - len(_suffix_tokens())
    image_end_pages = (result.image_start + result.image_tokens) // b
    repeat, pixel, text = turns["repeat"], turns["pixel"], turns["text again"]
    for t in result.turns:
        if t.cached_tokens is None or t.kv_hit_rate is None:
            result.failures.append(f"{t.name}: the response has no engine reuse or router kv_hit_rate "
                                   f"(cached_tokens {t.cached_tokens}, kv_hit_rate {t.kv_hit_rate})")
            return
    if not _agree(text, b):
        result.failures.append(f"text prompt again: the router credits {text.router_blocks} blocks, the engine reuses "
                               f"{text.engine_pages} pages")
    if repeat.engine_pages < image_end_pages:
        result.failures.append(f"same image prompt again: the engine reuses {repeat.engine_pages} pages, not past the "
                               f"image (which ends in page {image_end_pages})")
    if not _agree(repeat, b):
        result.failures.append(f"same image prompt again: the router credits {repeat.router_blocks} blocks, the engine "
                               f"reuses {repeat.engine_pages} pages")
    before_image = result.image_start // b
    if pixel.engine_pages > before_image or pixel.router_blocks > before_image:
        result.failures.append(f"one pixel changed: the engine reuses {pixel.engine_pages} pages and the router credits "
                               f"{pixel.router_blocks} blocks; only {before_image} precede the image")


def unmet(result: MmLiveResult, wide_pads: bool, page_size: int = 4) -> list[str]:
    """What the live run must show on this release, unmet (each one line; [] when it holds).

    On every release: text credit = engine reuse, the repeated image prompt is reused past the image, and
    after a one-pixel change neither side credits a page past where the image starts (the pages before it
    may be credited: they do not hold the image). Where the release keys images by pad values wider than the
    router's u32 token ids (``wide_pads``: SGLang 0.5.23's ``_compute_pad_values``), the run must show that
    finding, MM_PAD_WIDTH: the repeated image prompt credited 0 by the router; otherwise it passes."""
    out: list[str] = []
    turns = {t.name: t for t in result.turns}
    text, pixel, repeat = turns["text again"], turns["pixel"], turns["repeat"]
    before_image = result.image_start // page_size
    if not (text.router_blocks == text.engine_pages and (text.engine_pages or 0) > 0):
        out.append(f"text again: router {text.router_blocks} blocks, engine {text.engine_pages} pages")
    if not ((pixel.engine_pages or 0) <= before_image and (pixel.router_blocks or 0) <= before_image):
        out.append(f"pixel: engine {pixel.engine_pages} pages, router {pixel.router_blocks} blocks; only "
                   f"{before_image} precede the image")
    if (repeat.engine_pages or 0) * page_size < result.image_start + result.image_tokens:
        out.append(f"repeat: the engine reuses {repeat.engine_pages} pages, not past the image")
    if wide_pads:
        if [f.split(":")[0] for f in result.failures] != ["same image prompt again"] or repeat.router_blocks != 0:
            out.append(f"the release's wide pad values: expected only the repeated image prompt credited 0, got "
                       f"router {repeat.router_blocks} blocks and failures {result.failures}")
        if result.cause is not Cause.MM_PAD_WIDTH or "above u32" not in result.cause_detail:
            out.append(f"the release's wide pad values: diagnose named {result.cause}, not MM_PAD_WIDTH")
    elif not result.passed:
        out.append(f"an aligned release failed: {result.failures}")
    return out


def _agree(turn: Turn, b: int) -> bool:
    """Router credit = engine reuse, but for SGLang's last-page rule."""
    from kvalign.live.runs.fuzz.views import last_page_overcredit

    assert turn.router_blocks is not None and turn.engine_pages is not None
    return turn.router_blocks == turn.engine_pages or last_page_overcredit(
        turn.router_blocks * b, turn.engine_pages * b, turn.prompt_tokens, b, eagle=False)


def _suffix_tokens() -> list[int]:
    """The prompt's tokens after ``<|vision_end|>``: the text after the image and the template's tail."""
    text = f"<|vision_end|> {image_parts()[2]['text']}<|im_end|><|im_start|>assistant"
    return vm.build_tokenizer().encode(text).ids


def name_cause(result: MmLiveResult, opts: MmLiveOptions) -> None:
    """``diagnose`` on the live capture with the prompt's text before the image."""
    from kvalign.streams.diagnose import RouterSettings, diagnose

    assert result.capture is not None
    d = diagnose(result.capture, prefix_before_image(), RouterSettings(block_size=opts.page_size))
    result.cause, result.cause_detail = d.cause, d.detail or "; ".join(d.notes)


def render(result: MmLiveResult) -> str:
    """The per-request table and the verdict."""
    rows = [("request", "prompt", "engine reused", "engine pages", "kv_hit_rate", "router blocks")]
    rows += [(t.name, str(t.prompt_tokens), str(t.cached_tokens), str(t.engine_pages),
              "-" if t.kv_hit_rate is None else f"{t.kv_hit_rate:.4f}", str(t.router_blocks)) for t in result.turns]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.append(f"image: tokens {result.image_start}-{result.image_start + result.image_tokens - 1} of the prompt")
    if result.passed:
        lines.append("PASS: router credit = engine reuse for the repeated image prompt; after a one-pixel change "
                     "neither credits the image's pages")
    else:
        lines += [f"FAIL: {f}" for f in result.failures]
        if result.cause is not None:
            lines.append(f"cause: {result.cause.name} - {result.cause.value}")
        if result.cause_detail:
            lines.append(f"diagnose ({result.capture}): {result.cause_detail}")
    return "\n".join(lines)
