"""The rows of ``check --engine vllm``: hash, pages, ingest and tenants on vLLM's real ``KVCacheManager``
behind Dynamo's real relay and ``KvRouter``, each a Hypothesis search with its negative control beside it;
then the block sizes and encodings (:func:`shape_rows`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.property import Options, unavailable
from kvalign.verify.props.vllm import bodies, controls, hybrid, mm, namespace, tiers
from kvalign.verify.props.vllm.controls import CONTROL_EXAMPLES
from kvalign.verify.props.vllm.running import BLOCK_SIZE, NUM_BLOCKS, _row
from kvalign.verify.props.vllm.strategies import TENANTS, sequences
from kvalign.verify.engine.rows import VARIANTS, RowResult

ROWS = ("hash", "pages", "ingest", "tenants")
#: rows of their own modules: mm on the shared engine, tiers and hybrid each on an engine of its own (hybrid twice:
#: sliding window ``base``, then ``mamba``)
GROUP_ROWS = ("mm", "tiers", "hybrid")


def _tenants(variant: str) -> list[tuple[str | None, str | None]]:
    lora, namespace = VARIANTS[variant]
    return [t for t in TENANTS if bool(t[0]) == lora and bool(t[1]) == namespace]


def vllm_rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    """Every vLLM row (plain mode: vLLM keys no bigrams), one vLLM engine and router for all; tenants in each
    tenant variant asked. A path that cannot start is every row with its cause, never an exception."""
    from hypothesis import strategies as st

    from kvalign.oracles.vllm_router import vllm_worker
    from kvalign.verify.misaligned import drop_lora
    from kvalign.verify.props.vllm import BUDGET
    from kvalign.verify.props.vllm.strategies import Served
    from kvalign.verify.engine.search import run_search

    tenant_variants = [v for v in opts.variants if v != "base"]
    names = ([(p, "base") for p in ROWS[:3]] + [("tenants", v) for v in tenant_variants]
             + [(p, "base") for p in GROUP_ROWS] + [("hybrid", "mamba")])
    b, n, seed = opts.page_size or BLOCK_SIZE, opts.examples_for(BUDGET), opts.seed
    start = time.perf_counter()
    try:
        worker = vllm_worker(systems.router_path(), b, NUM_BLOCKS)
    except OracleUnavailable as exc:
        return [r for p, v in names for r in unavailable(p, ("plain",), (v,), str(exc), seconds=time.perf_counter() - start)]

    def control(body: Any, seq: list[Served], hop: Any = None) -> Callable[[], Any]:
        def run() -> Any:
            if hop is None:
                return run_search(body, st.just(seq), CONTROL_EXAMPLES, seed=seed)
            with controls.on_hop(worker, hop):
                return run_search(body, st.just(seq), CONTROL_EXAMPLES, seed=seed)
        return run

    #: the first prompt's blocks are evicted by the next three (NUM_BLOCKS - 1 usable), then it comes again
    evicting = [Served((0, 1, 2), 3), Served((0, 0, 0, 0, 0), 1), Served((1, 1, 1, 1, 1), 1), Served((2, 2, 2, 2), 1),
                Served((0, 1, 2), 3)]
    try:
        rows = [
            _row("hash", "base", bodies.hash_body(worker), sequences(b, TENANTS), n, seed,
                 ("drop_lora (kvalign's model keys LoRA blocks without the adapter)",
                  control(bodies.hash_body(worker, drop_lora), [Served((0, 1), 3, ("adapterA", None))]),
                  Cause.LORA_DROPPED)),
            _row("pages", "base", bodies.pages_body(worker), sequences(b), n, seed,
                 ("drop_removed (vLLM's BlockRemoved never reaches the relay)",
                  control(bodies.pages_body(worker), evicting, controls.drop_removed), Cause.INGEST_STALE)),
            _row("ingest", "base", bodies.ingest_body(worker), sequences(b, TENANTS), n, seed,
                 ("drop_stored (vLLM's BlockStored never reaches the relay)",
                  control(bodies.ingest_body(worker), [Served((0, 1, 2), 3)], controls.drop_stored),
                  Cause.EVENTS_DROPPED)),
        ]
        for v in tenant_variants:
            tenants = _tenants(v)
            rows.append(_row("tenants", v, bodies.tenants_body(worker), sequences(b, tenants), n, seed,
                             ("tenant_blind (the relay reads neither extra_keys nor lora_name)",
                              control(bodies.tenants_body(worker), [Served((0, 1, 2), 3, tenants[0])],
                                      controls.tenant_blind), namespace.blind_cause(tenants[0], b))))
        rows.append(mm.row(worker, n, seed))
    finally:
        worker.close()
    return (rows + [tiers.row(systems.router_path(), b, n, seed), hybrid.row(systems.router_path(), b, n, seed),
                    hybrid.row(systems.router_path(), b, n, seed, "mamba")]
            + shape_rows(systems.router_path(), b, n, seed, only_size=opts.page_size is not None))


def shape_rows(path: Any, b: int, n: int, seed: int | None, *, only_size: bool = False) -> list[RowResult]:
    """The block-size and encoding rows, each on vLLM workers of its own (:mod:`.blocks`, :mod:`.encodings`);
    ``only_size``: the block-size rows at ``b`` alone (``--page-size``)."""
    from kvalign.verify.props.vllm.blocks import BLOCK_SIZES, block_rows
    from kvalign.verify.props.vllm.encodings import encoding_rows

    sizes = (b,) if only_size else BLOCK_SIZES
    return block_rows(path, sizes, n, seed, NUM_BLOCKS, _row) + encoding_rows(path, n, seed, b, NUM_BLOCKS, _row)
