"""The HiCache rules (kvalign/live/runs/fuzz/hicache_rules.py) on a driver that records requests and
answers residency from a script: what each rule sends, pinned where, and when its pressure stops."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvalign.live.engines.hicache import HiCache
from kvalign.live.runs.fuzz import hicache_rules
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.tiers import Residency


@dataclass
class Sent:
    tokens: list[int]
    pin: str
    stored_pages: int = 0
    request: int = 0


@dataclass
class FakeViews:
    """Residency of the prompt under pressure: ``device`` drops by one page per pressure request."""

    driver: "FakeDriver"

    def mark(self, label: str) -> int:
        return len(self.driver.sent)

    def residency(self, label: str, tokens: list[int], *, eagle: bool, lo: int) -> list[Residency]:
        return [self.driver.residency(tokens)]


@dataclass
class FakeDriver:
    opts: FuzzOptions = field(default_factory=lambda: FuzzOptions(page_size=4, hicache=HiCache(ratio=1.0)))
    labels: list[str] = field(default_factory=lambda: ["worker0", "worker1"])
    sent: list[Sent] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(hicache_rules.COUNTS, 0))
    pressure_per_page: int = 1  # pressure requests it takes to push one page off the device
    host_forgets: bool = False  # evict_host: the host tier loses the prompt under pressure

    def __post_init__(self) -> None:
        self.engine_views = FakeViews(self)

    def progress(self, _msg: str) -> None:
        pass

    def engine_eagle(self, _label: str) -> bool:
        return True

    def _request(self, tokens: list[int], max_tokens: int, pin: str) -> Sent:
        s = Sent(list(tokens), pin, stored_pages=(len(tokens) - 1) // 4, request=len(self.sent) + 1)
        self.sent.append(s)
        return s

    def pressure(self) -> int:
        return sum(len(s.tokens) == hicache_rules.pressure_length(self) for s in self.sent)

    def residency(self, tokens: list[int]) -> Residency:
        pages = (len(tokens) - 1) // 4
        off = min(self.pressure() // self.pressure_per_page, pages)
        if self.host_forgets and off == pages:
            return Residency(0, 0)
        return Residency(pages - off, off)


def test_offload_sends_base_extension_pressure_then_the_requery_all_pinned():
    d = FakeDriver()
    hicache_rules.offload(d, {"seed": 3, "base": 2, "ext": 2, "keep_base": False, "tail": 1, "worker": 1})
    lengths = [len(s.tokens) for s in d.sent]
    assert lengths[:2] == [9, 17] and lengths[-1] == 18  # base (2 pages + 1), extension (4 pages + 1), re-query
    assert lengths[2:-1] == [hicache_rules.pressure_length(d)] * 4  # until all 4 pages are off the device
    assert {s.pin for s in d.sent} == {"worker1"}
    assert d.sent[-1].tokens[:17] == d.sent[1].tokens and d.sent[1].tokens[:9] == d.sent[0].tokens


def test_keep_base_touches_the_base_before_each_pressure_and_stops_at_the_extension():
    d = FakeDriver()
    hicache_rules.offload(d, {"seed": 3, "base": 2, "ext": 2, "keep_base": True, "tail": 0, "worker": 0})
    lengths = [len(s.tokens) for s in d.sent]
    p = hicache_rules.pressure_length(d)
    assert lengths == [9, 17, 10, p, 10, p, 17]  # two pages off (the extension), then the re-query with no tail
    assert all(s.tokens[:9] == d.sent[0].tokens for s in d.sent if len(s.tokens) == 10)


def test_the_pressure_is_bounded_when_the_device_never_lets_go():
    d = FakeDriver(pressure_per_page=1000)
    hicache_rules.offload(d, {"seed": 3, "base": 0, "ext": 2, "keep_base": False, "tail": 1, "worker": 0})
    assert d.pressure() == hicache_rules.max_pressure(d) == 8  # 4 * (1 + ratio 1.0)


def test_evict_host_counts_a_requery_only_when_the_host_tier_let_go():
    kept = FakeDriver()
    hicache_rules.evict_host(kept, {"seed": 5, "pages": 2, "worker": 0})
    assert kept.counts["host_evicted_requeried"] == 0 and kept.pressure() == 2 * hicache_rules.max_pressure(kept)
    gone = FakeDriver(host_forgets=True)
    hicache_rules.evict_host(gone, {"seed": 5, "pages": 2, "worker": 0})
    assert gone.counts["host_evicted_requeried"] == 1 and gone.pressure() == 2
    assert gone.sent[0].tokens == gone.sent[-1].tokens
