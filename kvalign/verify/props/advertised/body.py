"""The ``advertised`` property: the block size Dynamo is told is the one SGLang's events carry.

When a worker's page size is forced after Dynamo reads it (an attention backend that only runs at
64, decode context parallelism paging the tree at ``page_size * dcp_size``), the router hashes
queries at one size while SGLang publishes pages at another, and Dynamo's relay drops every page
whose ``block_size`` is not its own: the router's hit rate is exactly 0 (Dynamo #13216, #12765;
SGLang #35298). For every configuration SGLang accepts among those kvalign builds — each page-size
override of the installed ``overrides.py`` and DCP, for aggregated, prefill and decode workers —
four numbers must be equal, each computed by its side's own code
(:mod:`kvalign.oracles.page_overrides`, :func:`kvalign.oracles.registration.load_block_size_registration`):

* the ``kv_cache_block_size`` ``dynamo.sglang`` registers on the model card (the router's block size);
* the ``kv_block_size`` of the relay ``dynamo.sglang`` builds (it drops pages of any other size);
* the ``kv_events.block_size`` SGLang's ``/server_info`` advertises (what a router that discovers
  workers from ``/server_info``, like SGLang's model gateway, hashes at);
* the ``block_size`` SGLang's ``BlockStored`` events carry.

Card or relay off is ``REGISTERED_BLOCK_SIZE``; ``/server_info`` off is ``ADVERTISED_BLOCK_SIZE``.
The rows are exhaustive over their configurations, like ``card``'s; ``--page-size N`` pins the
launch ``--page-size`` to N (the resolved one is SGLang's to decide).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.page_overrides import (BACKEND_FLAGS, MODELS, PLATFORMS, ROLES, SglangSizes, WorkerConfig, dcp_supported,
                                            StandInFailure, page_overrides, platform, resolve, sglang_sizes)
from kvalign.oracles.registration import LaunchRefused
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.rows import RowResult

#: Launch ``--page-size`` values each configuration is tried with (None: the flag not given).
PAGE_INPUTS: tuple[int | None, ...] = (None, 1, 16, 32, 64, 128)
#: Launch page sizes a DCP row tries (each is multiplied by the DCP width).
DCP_PAGES: tuple[int | None, ...] = (None, 16, 64)
#: DCP widths tried (``--dcp-size N --tp-size N``).
DCP_SIZES = (2, 4)
#: Backends a DCP row tries besides SGLang's default (Dynamo's DCP-capable ones and MLA decode backends).
DCP_BACKENDS: tuple[str | None, ...] = (None, "triton", "flashinfer", "trtllm_mla", "cutedsl_mla", "flashmla", "fa3")
#: The override pass with no backend: SGLang's default page size (its row is "default").
DEFAULT_PASS = "_page_size_default"

Derive = Callable[..., tuple[int, int]]
#: A row names the first of these it saw: a silent misalignment before a worker that cannot start.
SEVERITY = (Cause.REGISTERED_BLOCK_SIZE, Cause.ADVERTISED_BLOCK_SIZE, Cause.CARD_UNAVAILABLE)


def advertised_property(derive: Derive, config: WorkerConfig, sizes: SglangSizes) -> None:
    """Dynamo's card and relay, SGLang's ``/server_info`` and its events agree on the block size."""
    card, relay = derive(sizes.server_args, config.role)
    said = (f"{config.flags()}: SGLang resolves --page-size {sizes.resolved_page} and its events carry "
            f"block_size {sizes.emitted}; /server_info advertises {sizes.advertised}; dynamo.sglang registers "
            f"kv_cache_block_size {card} and builds its relay with kv_block_size {relay}")
    if card != sizes.emitted or relay != sizes.emitted:
        raise Mismatch("advertised", said + " (the relay drops every page whose block_size is not its own: the "
                       "router's hit rate is 0)", Cause.REGISTERED_BLOCK_SIZE, dataclasses.asdict(config))
    if sizes.advertised is not None and sizes.advertised != sizes.emitted:
        raise Mismatch("advertised", said, Cause.ADVERTISED_BLOCK_SIZE, dataclasses.asdict(config))


def _grid(pages: Iterable[int | None], backends: Iterable[str | None], flags: Iterable[str], dcp: Iterable[int],
          platforms: Iterable[str], models: Iterable[str] = tuple(MODELS)) -> Iterator[WorkerConfig]:
    for page, backend, flag, d, plat, role, model in itertools.product(pages, backends, flags, dcp, platforms, ROLES,
                                                                      models):
        if backend is None and flag != BACKEND_FLAGS[0]:
            continue
        yield WorkerConfig(page, backend, flag, role, model, plat, d)


def models_for(backend: str) -> tuple[str, ...]:
    """The model kinds a backend serves: an MLA backend (SGLang names each ``*mla*``) only MLA models."""
    return ("mla",) if "mla" in backend else tuple(MODELS)


#: The GPU a backend is for where it is not Blackwell (SGLang's ``arg_groups/choices.py`` notes: HPC-Ops
#: "Hopper (SM90) only", Intel XPU under "Other platforms"); SGLang's resolution accepts either elsewhere.
PLATFORM_OF = {"hpc_ops": "hopper", "intel_xpu": "xpu"}


def _accepts(config: WorkerConfig) -> bool:
    """SGLang resolves ``config`` on its platform (a failure of kvalign's platform stand-in is no acceptance)."""
    try:
        return resolve(config) is not None
    except StandInFailure:
        return False


def platform_for(backend: str) -> str | None:
    """The backend's platform (:data:`PLATFORM_OF`, else the first of :data:`PLATFORMS`) on which SGLang
    accepts ``backend`` at all (None: none)."""
    preferred = PLATFORM_OF.get(backend)
    for name in ([preferred] if preferred else []) + [p for p in PLATFORMS if p != preferred]:
        if any(_accepts(WorkerConfig(backend=backend, backend_flag=flag, role=role, model=m, platform=name))
               for m in models_for(backend) for flag in BACKEND_FLAGS for role in ROLES):
            return name
    return None


def variants(page_size: int | None = None) -> dict[str, list[WorkerConfig]]:
    """Each row's configurations: one row per backend an ``overrides.py`` page-size pass names (on the
    first GPU platform SGLang accepts it on), one for the passes that name none (SGLang's default
    page, on every platform), and ``dcp`` where the release has it."""
    pages = (page_size,) if page_size else PAGE_INPUTS
    rows: dict[str, list[WorkerConfig]] = {}
    for override in page_overrides():
        if override.backends:
            for backend in override.backends:
                plat = platform_for(backend)
                rows.setdefault(backend, [] if plat is None else list(
                    _grid(pages, (backend,), BACKEND_FLAGS, (1,), (plat,), models_for(backend))))
        elif override.function == DEFAULT_PASS:
            rows["default"] = list(_grid(pages, (None,), BACKEND_FLAGS[:1], (1,), PLATFORMS))
    if dcp_supported():
        rows["dcp"] = list(_grid((page_size,) if page_size else DCP_PAGES, DCP_BACKENDS, BACKEND_FLAGS[:1], DCP_SIZES,
                                 ("blackwell",)))
    return rows


def unrowed_overrides() -> list[str]:
    """Page-size passes of ``overrides.py`` that get no row (no backend named, not the default pass):
    said in the rows' output, so a release's new override is never silently unchecked."""
    return [o.function for o in page_overrides() if not o.backends and o.function != DEFAULT_PASS]


def run_row(derive: Derive, variant: str, configs: list[WorkerConfig]) -> RowResult:
    """One row: every configuration SGLang accepts (and Dynamo starts with) through the property."""
    start = time.perf_counter()
    row = RowResult("advertised", "plain", variant)
    rejected = refused = unchecked = 0
    standin = ""  # why the first configuration kvalign's platform stand-in could not resolve was not checked
    first: dict[Cause, tuple[str, Any]] = {}  # the first configuration each cause was seen on
    for config in configs:
        try:
            sizes = sglang_sizes(config)
        except StandInFailure as exc:  # not SGLang's refusal: this configuration is not checked at all
            unchecked += 1
            standin = standin or f"{exc}; first: {config.flags()}"
            continue
        if sizes is None:
            rejected += 1
            continue
        with platform(config.platform):
            try:
                advertised_property(derive, config, sizes)
            except Mismatch as found:
                row.mismatches += 1
                first.setdefault(found.cause, (found.detail, found.example))
            except LaunchRefused:  # Dynamo's launch checks refuse it (e.g. DCP on a backend without it)
                refused += 1
                continue
            except Exception as exc:  # noqa: BLE001 - the release's registration code fails on the worker's arguments
                row.mismatches += 1
                first.setdefault(Cause.CARD_UNAVAILABLE, (f"{config.flags()}: dynamo.sglang's registration raised "
                                                          f"{type(exc).__name__}: {exc}", dataclasses.asdict(config)))
        row.cases += 1
    cause = next((c for c in SEVERITY if c in first), None)
    if cause is not None:  # the silent misalignment first: a worker that cannot start is seen at once
        row.cause, row.cause_name = cause.value, cause.name
        row.detail, row.counterexample = first[cause]
        others = [c.name for c in SEVERITY if c in first and c is not cause]
        if others:
            row.detail += f" [also {', '.join(others)} in other configurations]"
    if not configs:
        row.skipped = (f"SGLang's resolution rejects --attention-backend {variant} on every platform kvalign presents "
                       f"({', '.join(PLATFORMS)}) with every model kind ({', '.join(MODELS)})")
    elif not row.cases and unchecked:
        row.skipped = (f"{unchecked} of the {len(configs)} configurations kvalign builds for {variant} not checked "
                       f"({standin}); {rejected} rejected by SGLang, {refused} refused by Dynamo")
    elif not row.cases:
        row.skipped = (f"SGLang or dynamo.sglang refuses every one of the {len(configs)} configurations kvalign builds "
                       f"for {variant} ({rejected} by SGLang's resolution, {refused} by Dynamo's launch checks)")
    elif row.ok:
        row.detail = f"{rejected} of {len(configs)} configurations rejected by SGLang, {refused} refused by Dynamo"
    if unchecked and row.cases:
        row.not_checked = f"{unchecked} of {len(configs)} configurations not checked ({standin})"
        row.detail = (f"{row.detail}; " if row.detail else "") + row.not_checked
    row.seconds = time.perf_counter() - start
    return row


def run_advertised_rows(modes: tuple[str, ...], page_size: int | None = None,
                        load: Callable[[], Any] | None = None, *, before_overrides: bool = False) -> list[RowResult]:
    """``check``'s advertised rows (mode ``plain`` only: the page size does not depend on EAGLE's keys).

    ``load``: the registration loader (default: the installed ``dynamo.sglang``'s);
    ``before_overrides``: the negative control, Dynamo reading the raw launch arguments."""
    if "plain" not in modes:
        return []
    from kvalign.oracles.registration import load_block_size_registration  # noqa: PLC0415 - loads dynamo.sglang

    try:
        reg = (load or load_block_size_registration)()
        rows_of = variants(page_size)
    except OracleUnavailable as exc:
        return [RowResult("advertised", "plain", "base", skipped=str(exc))]

    def derive(server_args: Any, role: str) -> tuple[int, int]:
        return reg.derive(server_args, role, before_overrides=before_overrides)

    rows = [run_row(derive, variant, configs) for variant, configs in rows_of.items()]
    unrowed = unrowed_overrides()
    if unrowed:
        rows.append(RowResult("advertised", "plain", "other", skipped=(
            f"overrides.py's {', '.join(unrowed)} set the page size for a configuration kvalign does not build "
            "(no attention backend named: a model or algorithm setting)")))
    return rows
