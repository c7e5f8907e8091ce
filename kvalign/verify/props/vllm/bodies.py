"""The per-example checks of ``check --engine vllm``: serve a generated sequence on vLLM's real
``KVCacheManager`` behind the real relay and ``KvRouter``, and raise :class:`Mismatch` naming the cause
where the router and vLLM (or kvalign's model of the relay) disagree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvalign.model.causes import Cause
from kvalign.model.vllm_keys import VllmRelayModel, dynamo_salt
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.vllm import namespace
from kvalign.verify.props.vllm.strategies import TENANTS, Served, Tenant, fresh_base

Body = Callable[[list[Served]], None]


def _salt(tenant: Tenant) -> str | None:
    return dynamo_salt(tenant[1]) if tenant[1] else None


def _serve(worker: Any, tokens: list[int], tenant: Tenant) -> list[dict[str, Any]]:
    worker.engine.prefill(tokens, lora_name=tenant[0], cache_salt=_salt(tenant))
    return worker.sync()


def predicted_hit(worker: Any, tokens: list[int], tenant: Tenant) -> int:
    """vLLM's hit as kvalign predicts it from the router's overlap ``R``: ``B * min(R, (n - 1) // B)``
    (vLLM always computes a prompt's last token)."""
    b = worker.engine.block_size
    return b * min(worker.overlap(tokens, lora_name=tenant[0], cache_namespace=tenant[1]), (len(tokens) - 1) // b)


def _hit_cause(hit: int, predicted: int, *, tenants: bool = False, no_namespace: bool = False) -> Cause:
    """``no_namespace``: the mismatch is one tenant keyed as another of its LoRA in another namespace by a release
    whose hash takes no namespace (:mod:`.namespace`; Dynamo 1.3.1's and older: the SGLang rows' namespace finding),
    whichever way it went (credited another's blocks, or its own store never indexed)."""
    if no_namespace:
        return Cause.NAMESPACE_DROPPED
    if predicted > hit:
        return Cause.TENANTS_SHARE_KEYS if tenants else Cause.INGEST_STALE
    return Cause.EVENTS_DROPPED


def hash_body(worker: Any, hasher: Callable[..., list[int]] | None = None) -> Body:
    """hash: the router's key for each of vLLM's blocks (the relay's re-hash of its ``token_ids``) is the
    key :class:`VllmRelayModel` predicts from vLLM's event (``hasher``: the model's; a control swaps it)."""

    def body(seq: list[Served]) -> None:
        base, model = fresh_base(), VllmRelayModel(worker.engine.block_size, **({"hasher": hasher} if hasher else {}))
        stored: list[int] = []
        for served in seq:
            for ev in _serve(worker, served.tokens(base, worker.engine.block_size), served.tenant):
                model.apply(ev)
                if ev["type"] == "BlockStored":
                    stored += ev["block_hashes"]
        router = {engine: local for _p, engine, local in worker.dump()}
        keys = set(router.values())
        wrong = [h for h in stored if h in model.keys and (router.get(h, model.keys[h]) != model.keys[h]
                                                            or model.keys[h] not in keys)]
        if wrong:
            tenants = {s.tenant for s in seq}
            cause = (Cause.LORA_DROPPED if any(t[0] for t in tenants) and not any(t[1] for t in tenants)
                     else Cause.NAMESPACE_DROPPED if any(t[1] for t in tenants) else Cause.UNKNOWN)
            raise Mismatch("hash", f"{len(wrong)} of vLLM's {len(stored)} stored blocks keyed otherwise than "
                                   "kvalign's model of the relay predicts", cause, seq)

    return body


def pages_body(worker: Any) -> Body:
    """pages / overlap: before each prompt, vLLM's prefix hit = the prediction from the router's overlap."""

    def body(seq: list[Served]) -> None:
        base = fresh_base()
        for i, served in enumerate(seq):
            tokens = served.tokens(base, worker.engine.block_size)
            hit, predicted = worker.engine.match(tokens), predicted_hit(worker, tokens, served.tenant)
            if hit != predicted:
                raise Mismatch("pages", f"prompt {i}: vLLM reuses {hit} tokens, the router's overlap predicts "
                                        f"{predicted}", _hit_cause(hit, predicted), seq)
            _serve(worker, tokens, served.tenant)

    return body


def ingest_body(worker: Any) -> Body:
    """ingest: every block vLLM stores is indexed under vLLM's hash, chained to vLLM's parent, keyed by
    the router binding's own hash of its ``token_ids`` (with the tenant's LoRA and namespace, where the
    release's binding takes them: :func:`~kvalign.oracles.dynamo.adapt_hasher`)."""
    compute_block_hash_for_seq = namespace.release_hasher()

    def body(seq: list[Served]) -> None:
        base, b = fresh_base(), worker.engine.block_size
        live: dict[int, tuple[int | None, int]] = {}  # what vLLM holds: hash -> (parent, the binding's key)
        log = namespace.StoreLog(compute_block_hash_for_seq, b)
        for served in seq:
            lora, ns = served.tenant
            for ev in _serve(worker, served.tokens(base, b), served.tenant):
                log.add(ev, served.tenant)
                if ev["type"] == "BlockStored":
                    parent = ev["parent_block_hash"]
                    keys = compute_block_hash_for_seq(ev["token_ids"], b, None, lora, is_eagle=False,
                                                      cache_namespace=ns)
                    for h, key in zip(ev["block_hashes"], keys):
                        live[h], parent = (parent, key), h
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        live.pop(h, None)
        indexed = {engine: (parent, local) for parent, engine, local in worker.dump()}
        for h, want in live.items():
            if h not in indexed:
                shared = log.collision(h, set(indexed))
                raise Mismatch("ingest", f"vLLM's block {h} was never indexed" + (f": {shared}" if shared else ""),
                               Cause.NAMESPACE_DROPPED if shared else Cause.EVENTS_DROPPED, seq)
            if indexed[h] != want:
                raise Mismatch("ingest", f"vLLM's block {h} indexed as (parent, key) {indexed[h]}, stored as {want}",
                               Cause.UNKNOWN, seq)

    return body


def tenants_body(worker: Any) -> Body:
    """tenants: after each prompt, every tenant asking for it is credited what vLLM reuses for that tenant."""

    hasher = namespace.release_hasher()

    def body(seq: list[Served]) -> None:
        base, b = fresh_base(), worker.engine.block_size
        for i, served in enumerate(seq):
            tokens = served.tokens(base, b)
            _serve(worker, tokens, served.tenant)
            # the tenants that stored this prompt's first block: a tenant keyed as one of them is the namespace
            stored_by = [s.tenant for s in seq[:i + 1] if s.chunks[0] == served.chunks[0]]
            for tenant in TENANTS:
                hit = worker.engine.match(tokens, lora_name=tenant[0], cache_salt=_salt(tenant))
                predicted = predicted_hit(worker, tokens, tenant)
                if hit != predicted:
                    shared = namespace.tenant_sharing(hasher, tokens[:b], tenant, stored_by)
                    raise Mismatch("tenants", f"prompt {i} stored by {served.tenant}: tenant {tenant} — vLLM reuses "
                                              f"{hit} tokens, the router's overlap predicts {predicted}"
                                   + (f"; the router keys it as tenant {shared}: {namespace.why(hasher)}"
                                      if shared else ""),
                                   _hit_cause(hit, predicted, tenants=True, no_namespace=shared is not None), seq)

    return body
