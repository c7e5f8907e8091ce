"""The rows of ``check --engine vllm``: hash, pages, ingest and tenants on vLLM's real ``KVCacheManager``
behind Dynamo's real relay and ``KvRouter``, each a Hypothesis search with its negative control beside it; mm on
the same engine; tiers and hybrid (sliding window, then Mamba) each on an engine of its own; then the block sizes
and the default encodings (:func:`shape_rows`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.property import Options
from kvalign.verify.props.vllm import bodies, controls, hybrid, mm, namespace, tiers
from kvalign.verify.props.vllm.running import BLOCK_SIZE, NUM_BLOCKS, _row, control_run, on_engine
from kvalign.verify.props.vllm.strategies import TENANTS, sequences
from kvalign.verify.engine.rows import VARIANTS, RowResult

ROWS = ("hash", "pages", "ingest", "tenants")


def _tenants(variant: str) -> list[tuple[str | None, str | None]]:
    lora, namespace = VARIANTS[variant]
    return [t for t in TENANTS if bool(t[0]) == lora and bool(t[1]) == namespace]


def vllm_rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    """Every vLLM row of the default property (plain mode: vLLM keys no bigrams): hash, pages, ingest, tenants (each
    tenant variant asked) and mm on one vLLM engine and router, then the row groups on engines of their own. A path
    that cannot start or answer is its rows with their cause, never an exception
    (:func:`~kvalign.verify.props.vllm.running.on_engine`)."""
    from kvalign.verify.misaligned import drop_lora
    from kvalign.verify.props.vllm import BUDGET
    from kvalign.verify.props.vllm.strategies import Served

    tenant_variants = [v for v in opts.variants if v != "base"]
    names = [(p, "base") for p in ROWS[:3]] + [("tenants", v) for v in tenant_variants] + [("mm", "base")]
    b, n, seed = opts.page_size or BLOCK_SIZE, opts.examples_for(BUDGET), opts.seed
    path = systems.router_path()

    #: the first prompt's blocks are evicted by the next three (NUM_BLOCKS - 1 usable), then it comes again
    evicting = [Served((0, 1, 2), 3), Served((0, 0, 0, 0, 0), 1), Served((1, 1, 1, 1, 1), 1), Served((2, 2, 2, 2), 1),
                Served((0, 1, 2), 3)]

    def shared(worker: Any) -> list[RowResult]:
        def control(body: Any, seq: list[Served], hop: Any = None) -> Callable[[], Any]:
            return control_run(worker, body, seq, seed, hop)

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
        return rows + [mm.row(worker, n, seed)]

    return (on_engine(names, path, b, NUM_BLOCKS, shared)
            + [tiers.row(path, b, n, seed), hybrid.row(path, b, n, seed), hybrid.row(path, b, n, seed, "mamba")]
            + shape_rows(path, b, n, seed, only_size=opts.page_size is not None))


def shape_rows(path: Any, b: int, n: int, seed: int | None, *, only_size: bool = False) -> list[RowResult]:
    """The block-size and (default, int-hash) encoding rows, each on vLLM workers of its own (:mod:`.blocks`,
    :mod:`.encodings`); ``only_size``: the block-size rows at ``b`` alone (``--page-size``)."""
    from kvalign.verify.props.vllm.blocks import BLOCK_SIZES, block_rows
    from kvalign.verify.props.vllm.encodings import encoding_rows

    sizes = (b,) if only_size else BLOCK_SIZES
    return block_rows(path, sizes, n, seed, NUM_BLOCKS) + encoding_rows(path, n, seed, b, NUM_BLOCKS)
