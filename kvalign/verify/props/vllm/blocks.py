"""The ``blocks`` rows of ``check --engine vllm``: vLLM's prefix hit = the router's credit at several block sizes.

``dynamo.vllm`` 1.6.1 gives the relay (and the card the router reads) ``kv_block_size`` = vLLM's main-attention
block size, read from the engine (``dynamo/vllm/cache_info.py``: ``configure_kv_event_block_size``), unless
``additional_config={"dynamo_kv_event_block_size": N}`` overrides it. Each row runs vLLM's real
``KVCacheManager`` at one block size behind a relay configured as ``dynamo.vllm`` configures it. vLLM's cache
manager takes any block size; vLLM's CPU attention backend needs a multiple of 32 live (16 is the GPU default).

Negative control: the relay, card and router configured with another block size than vLLM's (the override
set wrong). Dynamo's relay then drops every ``BlockStored`` whose ``block_size`` is not its own
(``convert.rs``: that block and every later one of the event), so the router credits nothing vLLM reuses; the
row names it :attr:`~kvalign.model.causes.Cause.BLOCK_SIZE` from the events' own ``block_size`` against the
relay's.
"""

from __future__ import annotations

from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm.bodies import Body, _hit_cause, _serve, predicted_hit
from kvalign.verify.props.vllm.strategies import Served, fresh_base, sequences

#: vLLM block sizes checked: the GPU default, and the CPU backend's multiples of 32
BLOCK_SIZES = (16, 32, 64)


def misconfigured(block_size: int) -> int:
    """The control's relay block size: another size vLLM's events never carry."""
    return block_size * 2 if block_size == 16 else block_size // 2


def blocks_body(worker: Any) -> Body:
    """Before each prompt, vLLM's prefix hit = the prediction from the router's overlap; a miss is named
    ``BLOCK_SIZE`` where vLLM's events carry another ``block_size`` than the relay's."""

    def body(seq: list[Served]) -> None:
        base, b, relay = fresh_base(), worker.engine.block_size, worker.ingest.block_size
        carried: set[int] = set()
        for i, served in enumerate(seq):
            tokens = served.tokens(base, b)
            hit, predicted = worker.engine.match(tokens), predicted_hit(worker, tokens, served.tenant)
            if hit != predicted:
                other = sorted(carried - {relay})
                cause = Cause.BLOCK_SIZE if other else _hit_cause(hit, predicted)
                raise Mismatch("blocks", f"block size {b}, prompt {i}: vLLM reuses {hit} tokens, the router's overlap "
                                         f"predicts {predicted}" + (f" (vLLM's events carry block_size {other}, the "
                                                                    f"relay's kv_block_size is {relay})" if other else ""),
                               cause, seq)
            carried |= {ev["block_size"] for ev in _serve(worker, tokens, served.tenant) if ev["type"] == "BlockStored"}

    return body


def block_rows(path: Any, sizes: tuple[int, ...], n: int, seed: int | None, num_blocks: int) -> list[RowResult]:
    """One row per block size (:data:`BLOCK_SIZES` unless ``--page-size`` names one), its control beside it, each on
    a vLLM worker of its own (:func:`~kvalign.verify.props.vllm.running.on_engine`: one that cannot start is that row
    with its cause, never an exception)."""
    from hypothesis import strategies as st

    from kvalign.oracles.vllm_router import VllmWorker
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.props.vllm.controls import CONTROL_EXAMPLES
    from kvalign.verify.props.vllm.running import on_engine, search_row

    repeated = [Served((0, 1, 2), 3), Served((0, 1, 2), 3)]

    def rows(worker: Any) -> list[RowResult]:
        b, wrong = worker.engine.block_size, misconfigured(worker.engine.block_size)

        def control() -> Any:
            # a second relay (card, router) at the wrong size on the same vLLM publisher: no second engine
            misread = VllmWorker(worker.engine, path.attach(worker.hop, wrong), worker.hop)
            misread.barrier()
            return run_search(blocks_body(misread), st.just(repeated), CONTROL_EXAMPLES, seed=seed)

        return [search_row("blocks", blocks_body(worker), sequences(b), n, seed,
                           (f"relay_block_size {wrong} (the relay, card and router at {wrong}, vLLM at {b})", control,
                            Cause.BLOCK_SIZE), variant=f"b{b}")]

    return [r for b in sizes for r in on_engine([("blocks", f"b{b}")], path, b, num_blocks, rows)]
