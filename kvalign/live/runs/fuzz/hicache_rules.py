"""The fuzz's HiCache rules: push pages to host, ask for them again, evict the host tier.

Drawn only with ``--hicache`` (:func:`machine_class` adds them to the base machine, so runs without
HiCache draw exactly what they drew before). Each is one JSON-able step, replayable:

* ``offload``: a prompt of ``base`` pages, then its extension by ``ext`` pages (both pinned to one
  worker), then fresh prompts pinned there until the engine's events show the extension off the
  device (``keep_base``: the base prompt is asked for again before each, so SGLang's LRU keeps it
  on the device and only the extension goes to host), bounded; then the extension plus ``tail``
  tokens. That request meets a host-only stretch of ``ext`` pages, after a device prefix of
  ``base`` pages or none: above or below SGLang's ``load_back_threshold`` depending on
  ``ext * B``, and ``tail`` 0 puts its last page under the scheduler's cap.
* ``evict_host``: a prompt pushed to host, then fresh prompts until the engine's events show it
  evicted from the host tier too (bounded); then the prompt again: nothing of it may be credited.
* ``refill_storage`` (``--storage`` only): a prompt long enough for SGLang's storage prefetch, then
  fresh prompts until the engine's events show it gone from device *and* host while the worker's
  storage directory holds pages (written there on the way down); then the prompt again: SGLang
  refills it from storage, which its split reports and no event named when the router routed it.

The host tier's size is SGLang's (``--hicache-ratio`` x the device pool), so the bounds follow the
pool: pressure prompts of a third of the device pool, at most ``4 * (1 + ratio)`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvalign.live.runs.fuzz.hicache import (
    COUNTS, LOAD_BACK_THRESHOLD, TierObservation, requery_record, storage_pages,
)
from kvalign.live.runs.fuzz.prompts import MAX_PROMPT, new_tokens
from kvalign.live.runs.fuzz.tiers import Residency

PRESSURE_SEEDS = 2**41  # clear of every other rule's seeds


class FuzzDriver(Protocol):
    """What the rules use of :class:`kvalign.live.runs.fuzz.driver.FuzzDriver` (named here, not
    imported: the driver dispatches to these rules)."""

    opts: Any
    labels: list[str]
    counts: dict[str, int]
    engine_views: Any
    host_requeries: list[dict[str, Any]]
    host_evictions_in_example: int
    storage_refills_in_example: int
    storage_refills: list[dict[str, Any]]
    cluster: Any

    def progress(self, msg: str) -> None: ...
    def engine_eagle(self, label: str) -> bool: ...
    def _request(self, tokens: list[int], max_tokens: int, pin: str | None = None) -> Any: ...
    def run_step(self, step: dict[str, Any]) -> None: ...


def pressure_length(driver: FuzzDriver) -> int:
    return max(min(driver.opts.max_total_tokens // 3, MAX_PROMPT), 2 * driver.opts.page_size + 2)


def max_pressure(driver: FuzzDriver) -> int:
    ratio = driver.opts.hicache.ratio if driver.opts.hicache else 2.0
    return int(4 * (1 + ratio))


def _residency(driver: FuzzDriver, label: str, tokens: list[int]) -> Residency:
    views = driver.engine_views
    return views.residency(label, tokens, eagle=driver.engine_eagle(label), lo=views.mark(label))[0]


def record(driver: FuzzDriver, obs: Any) -> None:
    """Counts and the host re-query record of one checked request (called for every request)."""
    if not isinstance(obs, TierObservation) or obs.label is None:
        return
    if obs.storage:
        driver.counts["storage_requeried"] += 1
        driver.counts["storage_refilled_pages"] += storage_pages(obs.storage, obs.block_size)
        d, h = obs.engine_split or (None, None)
        driver.storage_refills.append({"request": obs.request, "prompt_tokens": obs.n, "engine_device_tokens": d,
                                       "engine_host_tokens": h, "engine_storage_tokens": obs.storage,
                                       "engine_tokens": obs.engine_tokens, "router_tokens": obs.router_tokens,
                                       "router_tiers": obs.router_split,
                                       "residency_at_routing": [obs.residency.device, obs.residency.host]})
    if obs.capped()[1] > 0:
        driver.counts["host_requeried"] += 1
        driver.host_requeries.append(requery_record(obs))
        split = obs.router_split
        if obs.loaded and split is not None and split[1] * obs.block_size >= obs.loaded:  # loaded back, and credited
            driver.counts["loaded_back"] += 1


@dataclass(frozen=True)
class OffloadPrompts:
    """The prompts an ``offload`` step sends, from its JSON alone (so a replay, or the servable
    property asked about the same case, rebuilds exactly them): ``head`` (the base prompt; empty
    without one), ``full`` (base + extension), round ``i``'s ``touch`` and ``pressure``, ``query``."""

    step: dict[str, Any]
    page_size: int
    eagle: bool
    pressure_tokens: int

    @property
    def head(self) -> list[int]:
        base = self.step["base"]
        return new_tokens(self.step["seed"], base * self.page_size + int(self.eagle)) if base else []

    @property
    def full(self) -> list[int]:
        first = int(self.eagle) if not self.step["base"] else 0
        return [*self.head, *new_tokens(self.step["seed"] + 1, self.step["ext"] * self.page_size + first)]

    def touch(self, i: int) -> list[int]:
        return [*self.head, *new_tokens(self.step["seed"] + 2 + i, 1)]

    def pressure(self, i: int) -> list[int]:
        return new_tokens(PRESSURE_SEEDS + self.step["seed"] * 64 + i, self.pressure_tokens)

    @property
    def query(self) -> list[int]:
        return [*self.full, *new_tokens(self.step["seed"] + 99, self.step.get("tail", 1))]

    def sequence(self, rounds: int) -> list[list[int]]:
        """Every prompt in the order the rule sends them, when its pressure took ``rounds`` rounds."""
        keep = bool(self.step.get("keep_base")) and bool(self.head)
        out = [p for p in (self.head, self.full) if p]
        for i in range(rounds):
            out += [self.touch(i), self.pressure(i)] if keep else [self.pressure(i)]
        return [*out, self.query]


def offload(driver: FuzzDriver, step: dict[str, Any]) -> None:
    b, label = driver.opts.page_size, driver.labels[step.get("worker", 0) % len(driver.labels)]
    p = OffloadPrompts(step, b, driver.engine_eagle(label), pressure_length(driver))
    base, ext = step["base"], step["ext"]
    driver.progress(f"offload: {base} + {ext} page(s) on {label}, then pressure until the {ext} are off the device"
                    + (" (the first kept hot)" if step.get("keep_base") else ""))
    if p.head:
        driver._request(p.head, 1, pin=label)
    driver._request(p.full, 1, pin=label)
    want_device = base if step.get("keep_base") else 0
    for i in range(max_pressure(driver)):
        if _residency(driver, label, p.full).device <= want_device:
            break
        if step.get("keep_base") and p.head:
            driver._request(p.touch(i), 1, pin=label)
        driver._request(p.pressure(i), 1, pin=label)
    now = _residency(driver, label, p.full)
    driver.progress(f"offload: the engine holds {now.device} device + {now.host} host-only page(s) of the "
                    f"{base + ext}-page prompt ({now.host * b} host tokens; load_back_threshold {LOAD_BACK_THRESHOLD})")
    driver._request(p.query, 1, pin=label)


def evict_host(driver: FuzzDriver, step: dict[str, Any]) -> None:
    b, label = driver.opts.page_size, driver.labels[step.get("worker", 0) % len(driver.labels)]
    eagle = int(driver.engine_eagle(label))
    seed = step["seed"]
    tokens = new_tokens(seed, step["pages"] * b + eagle)
    driver.progress(f"evict_host: {step['pages']} page(s) on {label}, then pressure until they leave the host tier")
    first = driver._request(tokens, 1, pin=label)
    for i in range(2 * max_pressure(driver)):
        if _residency(driver, label, tokens).held == 0:
            break
        driver._request(new_tokens(PRESSURE_SEEDS + 2**20 + seed * 64 + i, pressure_length(driver)), 1, pin=label)
    left = _residency(driver, label, tokens)
    again = driver._request(tokens, 1, pin=label)
    if left.held < first.stored_pages:
        driver.counts["host_evicted_requeried"] += 1
        driver.progress(f"evict_host: request {again.request} re-queried {label} with {left.held} of the prompt's "
                        f"{first.stored_pages} pages left in any tier")


def storage_files(driver: FuzzDriver, label: str) -> int:
    """Files SGLang's ``file`` backend holds for ``label`` (its pages written to storage)."""
    from kvalign.live.engines.sglang_cpu import storage_dir

    plan = driver.cluster.plan
    worker = next(w for w in plan.topology.workers if w.name == label)
    where = storage_dir(plan, worker)
    return sum(1 for p in where.iterdir() if p.is_file()) if where.is_dir() else 0


def refill_storage(driver: FuzzDriver, step: dict[str, Any]) -> None:
    b, label = driver.opts.page_size, driver.labels[step.get("worker", 0) % len(driver.labels)]
    tokens = new_tokens(2**40 + step["seed"], step["pages"] * b + int(driver.engine_eagle(label)))
    driver.progress(f"refill_storage: {step['pages']} page(s) on {label}, then pressure until they leave device and "
                    "host (their copies in the storage tier)")
    first = driver._request(tokens, 1, pin=label)
    for i in range(2 * max_pressure(driver)):
        if _residency(driver, label, tokens).held == 0:
            break
        driver._request(new_tokens(PRESSURE_SEEDS + 2**21 + step["seed"] * 64 + i, pressure_length(driver)), 1, pin=label)
    left, files = _residency(driver, label, tokens), storage_files(driver, label)
    if left.held == 0 and first.stored_pages:  # counted before the re-query, which may fail the run
        driver.counts["storage_evicted_requeried"] += 1
    driver.progress(f"refill_storage: {label} holds {left.held} of the prompt's {first.stored_pages} pages in device or "
                    f"host, {files} file(s) in its storage tier; the prompt again")
    driver._request(tokens, 1, pin=label)


def machine_class(base: type[RuleBasedStateMachine], driver: FuzzDriver) -> type[RuleBasedStateMachine]:
    """``base`` plus the HiCache rules (``--hicache`` only)."""
    n = len(driver.labels)

    class HiCacheFuzz(base):  # type: ignore[misc, valid-type]
        @rule(seed=st.integers(0, 2**16), base=st.integers(0, 4), ext=st.integers(1, 4), keep_base=st.booleans(),
              tail=st.sampled_from((0, 1, 2)), w=st.integers(0, n - 1))
        def offload(self, seed: int, base: int, ext: int, keep_base: bool, tail: int, w: int) -> None:
            driver.run_step({"rule": "offload", "seed": seed, "base": base, "ext": ext, "keep_base": keep_base and base > 0,
                             "tail": tail, "worker": w})

        @precondition(lambda self: driver.host_evictions_in_example == 0)  # the longest rule: once per example
        @rule(seed=st.integers(0, 2**16), pages=st.integers(1, 4), w=st.integers(0, n - 1))
        def evict_host(self, seed: int, pages: int, w: int) -> None:
            driver.host_evictions_in_example += 1
            driver.run_step({"rule": "evict_host", "seed": seed, "pages": pages, "worker": w})

    if not (driver.opts.hicache and driver.opts.hicache.storage):
        return HiCacheFuzz

    class StorageFuzz(HiCacheFuzz):  # type: ignore[misc, valid-type]
        @precondition(lambda self: driver.storage_refills_in_example == 0)  # as long as evict_host: once per example
        @rule(seed=st.integers(0, 2**16), pages=st.integers(2, 6), w=st.integers(0, n - 1))
        def refill_storage(self, seed: int, pages: int, w: int) -> None:
            driver.storage_refills_in_example += 1
            driver.run_step({"rule": "refill_storage", "seed": seed, "pages": pages, "worker": w})

    return StorageFuzz


RULES = {"offload": offload, "evict_host": evict_host, "refill_storage": refill_storage}
__all__ = ["COUNTS", "RULES", "machine_class", "record"]
