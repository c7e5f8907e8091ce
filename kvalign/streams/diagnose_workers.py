"""Explain a routing decision across workers: which worker a KV-aware router should favour, and why not.

The question behind most "the router is cache-blind" reports is "why did my request go to worker
B and not A?". Dynamo's KV router scores each worker by ``overlap_weight × new prefill blocks +
active blocks``; with equal load the worker with the most leading prompt blocks in the router's
index wins. Given one capture per worker, this module predicts, for each worker:

* the overlap (and ``kv_hit_rate``) the router computes with the settings given — the router's
  view, which is what decided the request;
* the overlap a correctly aligned router would see — what the engine really holds;
* the single-worker diagnosis (:func:`kvalign.streams.diagnose.diagnose`) wherever the two differ.

The router's index is per worker (a worker's overlap depends only on its own events), so each
capture is replayed on its own, with the router settings shared by all workers: one
``kv_block_size`` and one EAGLE mode, as one router has. When the user also passes the router's
reported choice (``nvext.worker_id`` mapped to a capture) and its ``kv_hit_rate``, the report
says whether kvalign's prediction reproduces it, and, when it does not, which router setting
would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvalign.streams.capture import CaptureError
from kvalign.model.causes import Cause
from kvalign.streams.diagnose import Diagnosis, RouterSettings, diagnose
from kvalign.errors import UsageError
from kvalign.streams.replay import default_worker_names, resolve_block_size


@dataclass
class WorkerView:
    """One worker as the router sees it and as the engine holds it."""

    name: str
    capture: str
    router_overlap: int
    kv_hit_rate: float | None
    engine_overlap: int  # leading blocks the engine holds (lost batches included, when proven)
    blocks: int
    diagnosis: Diagnosis

    @property
    def cause(self) -> Cause | None:
        return self.diagnosis.cause


@dataclass
class Reported:
    """What the router said it did, and whether kvalign reproduces it."""

    worker: str | None
    kv_hit_rate: float | None
    predicted_kv_hit_rate: float | None = None
    implied_overlap: int | None = None  # overlap blocks the reported kv_hit_rate stands for
    matches: bool | None = None  # reported kv_hit_rate == kvalign's prediction for that worker
    explained_by: dict[str, Any] | None = None  # router settings that reproduce a mismatching report


@dataclass
class RoutingDiagnosis:
    prompt_tokens: int
    router: dict[str, Any]
    workers: list[WorkerView]
    favoured: list[str]  # most router overlap (the router's choice with equal load)
    aligned_favoured: list[str]  # most engine overlap (what an aligned router would favour)
    reported: Reported | None
    verdict: str
    findings: list[str] = field(default_factory=list)
    misaligned: bool = False


def _best(views: list[WorkerView], key: str) -> list[str]:
    top = max(getattr(v, key) for v in views)
    return [] if top == 0 else [v.name for v in views if getattr(v, key) == top]


def _isl_blocks(prompt_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(prompt_tokens / block_size))


def _names(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def diagnose_workers(
    captures: list[str],
    tokens: list[int],
    router: RouterSettings,
    *,
    names: list[str] | None = None,
    reported_worker: str | None = None,
    reported_kv_hit_rate: float | None = None,
) -> RoutingDiagnosis:
    """Predict each worker's overlap as the router computes it and explain the routing decision."""
    if not captures:
        raise UsageError("no --capture given")
    labels = default_worker_names(captures, names)
    if reported_worker is not None and reported_worker not in labels:
        raise UsageError(f"--router-worker {reported_worker!r} is not one of the workers ({', '.join(labels)}); "
                         "name the captures with --worker")
    if reported_kv_hit_rate is not None and not 0.0 <= reported_kv_hit_rate <= 1.0:
        raise UsageError(f"--router-kv-hit-rate must be in [0, 1], got {reported_kv_hit_rate}")
    block_size = resolve_block_size(captures, router.block_size)
    shared = replace(router, block_size=block_size)
    diagnoses: list[Diagnosis] = []
    for path in captures:
        d = diagnose(path, tokens, shared)
        if shared.eagle == "auto":  # one router, one EAGLE mode: the first worker's framing decides
            shared = replace(shared, eagle="on" if d.router["eagle"] else "off")
        diagnoses.append(d)
    eagle_source = labels[0] if router.eagle == "auto" else None
    views = [WorkerView(name, path, d.router["overlap"], d.router["kv_hit_rate"], d.engine["holds"],
                        d.router["blocks"], d) for name, path, d in zip(labels, captures, diagnoses)]
    first = diagnoses[0].router
    rd = RoutingDiagnosis(
        prompt_tokens=len(tokens),
        router={"block_size": block_size, "eagle": first["eagle"], "eagle_from": eagle_source,
                "lora": router.lora, "namespace": router.namespace, "blocks": first["blocks"],
                "isl_blocks": _isl_blocks(len(tokens), block_size)},
        workers=views, favoured=_best(views, "router_overlap"), aligned_favoured=_best(views, "engine_overlap"),
        reported=None, verdict="",
    )
    by_name = {v.name: v for v in views}
    if reported_worker is not None or reported_kv_hit_rate is not None:
        rd.reported = _check_report(rd, by_name, tokens, shared, reported_worker, reported_kv_hit_rate)
    _explain(rd, by_name)
    return rd


def _check_report(rd: RoutingDiagnosis, by_name: dict[str, WorkerView], tokens: list[int], shared: RouterSettings,
                  worker: str | None, rate: float | None) -> Reported:
    rep = Reported(worker, rate)
    target = by_name[worker] if worker is not None else (by_name[rd.favoured[0]] if len(rd.favoured) == 1 else None)
    if rate is None or target is None:
        return rep
    isl = rd.router["isl_blocks"]
    rep.predicted_kv_hit_rate = target.kv_hit_rate
    rep.implied_overlap = round(rate * isl)
    rep.matches = rep.implied_overlap == target.router_overlap and abs(rate - rep.implied_overlap / isl) < 0.5 / isl
    if not rep.matches:
        for alt in _alternatives(shared, target.diagnosis):
            d = diagnose(target.capture, tokens, alt)
            if d.router["overlap"] == rep.implied_overlap:
                cause = target.diagnosis.cause if d.cause is None else d.cause
                rep.explained_by = {"block_size": alt.block_size, "eagle": alt.eagle == "on", "lora": alt.lora,
                                    "namespace": alt.namespace,
                                    "cause": None if cause is None else {"name": cause.name, "text": cause.value}}
                break
    return rep


def _alternatives(s: RouterSettings, d: Diagnosis) -> list[RouterSettings]:
    """Router settings a misconfigured router plausibly runs with, nearest first."""
    e = d.engine
    out = [replace(s, eagle="off" if s.eagle == "on" else "on")]
    if (s.lora, s.namespace) != (e["lora"], e["namespace"]):
        out.append(replace(s, lora=e["lora"], namespace=e["namespace"]))
    if s.lora or s.namespace:
        out.append(replace(s, lora=None, namespace=None))
    if s.block_size != e["block_size"]:
        out.append(replace(s, block_size=e["block_size"]))
    return out


def _explain(rd: RoutingDiagnosis, by_name: dict[str, WorkerView]) -> None:
    """The verdict line and one finding per worker that explains a disagreement."""
    fav, aligned = rd.favoured, rd.aligned_favoured
    blocks = rd.router["blocks"]

    def who(names: list[str], key: str) -> str:
        if not names:
            return ("no worker (it credits none with a leading block of this prompt, so load alone decides)"
                    if key == "router_overlap" else "no worker (none holds a leading block of this prompt)")
        n = getattr(by_name[names[0]], key)
        tie = " (a tie, broken by load)" if len(names) > 1 else ""
        return f"{_names(names)} ({n}/{blocks} blocks){tie}"

    findings = rd.findings
    under = [v for v in rd.workers if v.cause is not None]
    for v in under:
        d = v.diagnosis
        findings.append(f"{v.name}: the router credits {v.router_overlap}/{blocks} blocks, the engine holds "
                        f"{v.engine_overlap}: {d.cause.value}{f' (k = {d.shift:+d})' if d.shift is not None else ''}"
                        f"{f' ({d.confidence})' if d.confidence else ''} at block {d.first_divergent}: {d.detail}")
    rep = rd.reported
    chosen = rep.worker if rep is not None else None
    parts = [f"a KV-aware router with equal load favours {who(fav, 'router_overlap')}"]
    if set(fav) != set(aligned):
        parts.append(f"an aligned router would favour {who(aligned, 'engine_overlap')}")
    if rep is not None and rep.kv_hit_rate is not None and rep.matches is False:
        target = chosen or (fav[0] if fav else "?")
        fix = ""
        if rep.explained_by:
            x = rep.explained_by
            named = f" ({x['cause']['text']})" if x["cause"] else ""
            fix = (f"; block size {x['block_size']}, eagle {'on' if x['eagle'] else 'off'}, lora {x['lora'] or '-'}, "
                   f"namespace {x['namespace'] or '-'} reproduces it, so the router most likely runs with those "
                   f"settings{named}")
        predicted = "n/a" if rep.predicted_kv_hit_rate is None else f"{rep.predicted_kv_hit_rate:.3g}"
        findings.append(f"the router reported kv_hit_rate {rep.kv_hit_rate:.3g} for {target} ({rep.implied_overlap} "
                        f"of {rd.router['isl_blocks']} blocks), but with the settings given kvalign predicts "
                        f"{predicted} ({by_name[target].router_overlap} blocks){fix}")
    if chosen is not None:
        if chosen in aligned or not aligned:
            settings = f" (with the settings given kvalign would favour {_names(fav)}: check them)" if fav and chosen not in fav else ""
            parts.append(f"the router chose {chosen}, as an aligned router would{settings}")
        elif chosen in fav:
            parts.append(f"the router chose {chosen} as its index says, but {_names(aligned)} really holds more: "
                         "the router is blind to it (cause below)")
        elif rep is not None and rep.matches is False:
            parts.append(f"the router chose {chosen}, which kvalign's prediction does not explain (see its kv_hit_rate)")
        else:
            parts.append(f"the router chose {chosen} although its own index credits {_names(fav or aligned)} with "
                         "more blocks, so load (active blocks) or --router-temperature decided, not the cache")
    # an eviction is the router being right (the engine no longer holds the block): not a finding to fail on
    rd.misaligned = any(v.cause is not Cause.EVICTED for v in under) or (rep is not None and rep.matches is False)
    rd.verdict = "; ".join(parts)


def check_worker_names(paths: list[str], names: list[str] | None) -> None:
    """One-line errors for ``--worker`` lists that cannot label the captures."""
    if names and len(names) != len(paths):
        raise CaptureError(f"{len(names)} --worker names for {len(paths)} captures; give one per --capture")
    if names and len(set(names)) != len(names):
        raise CaptureError("--worker names must be distinct")
