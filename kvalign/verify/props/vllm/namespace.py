"""Which vLLM mismatches a router without cache namespaces explains: the name such a mismatch is published under.

Dynamo 1.3.1's (and older) block hash takes no ``cache_namespace`` (its ``compute_block_hash_for_seq`` has no such
argument) and its relay reads no salt from vLLM's ``extra_keys``: it keys a salted tenant's blocks exactly as the
unsalted tenant's (the same LoRA) of the same tokens. Measured on 1.3.1 x vLLM 0.23.0, with the relay in kvalign's
process and in its own alike (docs/vllm.md): a salted prompt's blocks are credited to the unsalted tenant, which vLLM
does not let reuse them; where both tenants store the same tokens, the router keeps the first tenant's store and
indexes nothing of the second's event (its blocks share the first's keys), so once vLLM evicts the first tenant's
copy the router credits the second tenant nothing of what vLLM still holds for it.

The ``ingest`` and ``hashes`` rows see that as "vLLM's block never indexed" and the ``tenants`` rows as one tenant
credited another's blocks; both are :attr:`~kvalign.model.causes.Cause.NAMESPACE_DROPPED`, the cause the hash row
and the SGLang rows of such a release give, and are named so only on evidence from the release itself: its own hash
keys the two tenants' blocks alike (:func:`shared_key`), and, for a block never indexed, the router holds that key
(the same chain of keys) under another tenant's vLLM hash (:class:`StoreLog`). A release whose hash keeps the
namespace never meets either, so there the rows keep their cause (``EVENTS_DROPPED``, ``TENANTS_SHARE_KEYS``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.base import RouterHasher

#: (LoRA name, cache namespace)
Tenant = tuple[str | None, str | None]


def release_hasher() -> RouterHasher:
    """The running Dynamo release's own block hash, adapted as the router drops what its binding lacks."""
    from dynamo._core import compute_block_hash_for_seq as binding

    from kvalign.oracles.dynamo import adapt_hasher

    return adapt_hasher(binding)


def why(hasher: RouterHasher) -> str:
    """What the release lacks, for a finding's detail."""
    if "cache_namespace" in getattr(hasher, "missing", ()):
        return "this Dynamo's compute_block_hash_for_seq takes no cache_namespace and its relay reads no salt"
    return "this Dynamo's hash keys the two namespaces alike"


def shared_key(hasher: RouterHasher, block: Sequence[int], a: Tenant, b: Tenant) -> bool:
    """Whether tenants ``a`` and ``b``, of one LoRA and two namespaces, get the same router key for ``block``
    from this release's hash (a release that keeps the namespace keys them apart)."""
    if a[0] != b[0] or a[1] == b[1]:
        return False
    size = len(block)
    return (list(hasher(list(block), size, None, a[0], is_eagle=False, cache_namespace=a[1]))
            == list(hasher(list(block), size, None, b[0], is_eagle=False, cache_namespace=b[1])))


def tenant_sharing(hasher: RouterHasher, block: Sequence[int], tenant: Tenant, stored_by: Iterable[Tenant]) -> Tenant | None:
    """The first tenant of ``stored_by`` whose blocks of ``block`` the router keys as ``tenant``'s only because
    this release drops the namespace; None where no such tenant stored it."""
    return next((t for t in stored_by if shared_key(hasher, block, tenant, t)), None)


@dataclass(frozen=True)
class Stored:
    """One block vLLM stored: its vLLM parent, the release's key for it, the tenant that stored it."""

    parent: Any
    key: int
    tenant: Tenant


class StoreLog:
    """vLLM's stored blocks of one example with the keys this release's hash gives them, so that a block the
    router never indexed can be traced to another tenant's block holding its chain of keys."""

    def __init__(self, hasher: RouterHasher, block_size: int) -> None:
        self.hasher, self.block_size = hasher, block_size
        self.blocks: dict[Any, Stored] = {}

    def add(self, event: Mapping[str, Any], tenant: Tenant) -> None:
        """Record a ``BlockStored`` event of ``tenant`` (other events are ignored)."""
        if event.get("type") != "BlockStored":
            return
        keys = self.hasher(list(event["token_ids"]), self.block_size, None, tenant[0], is_eagle=False,
                           cache_namespace=tenant[1])
        parent = event.get("parent_block_hash")
        for h, key in zip(event["block_hashes"], keys):
            self.blocks[h] = Stored(parent, int(key), tenant)
            parent = h

    def _chain(self, h: Any) -> tuple[int, ...]:
        keys: list[int] = []
        while h in self.blocks and len(keys) <= len(self.blocks):
            keys.append(self.blocks[h].key)
            h = self.blocks[h].parent
        return tuple(reversed(keys))

    def collision(self, missing: Any, indexed: set[Any]) -> str | None:
        """Why the router never indexed vLLM's block ``missing``, where a namespace explains it: it, or the first
        block of its chain the router lacks, has the chain of keys of a block the router indexed under another
        vLLM hash, stored by a tenant of the same LoRA in another namespace. None otherwise."""
        h = missing
        while h in self.blocks and h not in indexed:
            chain, mine = self._chain(h), self.blocks[h].tenant
            for other, s in self.blocks.items():
                if (other != h and other in indexed and s.tenant[0] == mine[0] and s.tenant[1] != mine[1]
                        and self._chain(other) == chain):
                    at = "" if h == missing else f" (its ancestor {h}'s event)"
                    return (f"the router holds the keys of vLLM's block {missing} of tenant {mine}{at} under block "
                            f"{other} of tenant {s.tenant}: {why(self.hasher)}, so one tenant's store of them was "
                            "not indexed")
            h = self.blocks[h].parent
        return None


def blind_cause(tenant: Tenant, block_size: int, hasher: RouterHasher | None = None) -> Cause:
    """What the tenants row names a tenant-blind relay (a hop stripping ``lora_name`` and ``extra_keys``) that
    credits the base tenant with ``tenant``'s blocks: ``TENANTS_SHARE_KEYS``, or ``NAMESPACE_DROPPED`` where this
    release's own hash keys ``tenant`` (a namespace, no LoRA) as the base tenant, so that stripping its salt changes
    nothing the release does not already do (``hasher``: the release's, by default)."""
    shared = shared_key(hasher or release_hasher(), range(block_size), (None, None), tenant)
    return Cause.NAMESPACE_DROPPED if shared else Cause.TENANTS_SHARE_KEYS
