"""Deliberately wrong SGLang event streams: the negative controls of the ``tenants`` property.

Each control changes SGLang's own event objects (``msgspec.structs.replace``) after the real cache
made them and before the real publisher sends them, the way a release that got one field wrong would
publish them; :func:`kvalign.verify.props.tenants.body.tenants_property` takes one as ``mutate``. Paired with an
engine that never loaded its adapters (``load_adapters=False``, so SGLang's default format publishes
the LoRA tenants' pages un-namespaced), :func:`restore_lora_name` is a stream whose names are right
and whose hashes collide across tenants.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvalign.model.hashing import U64_MASK
from kvalign.oracles.sglang import lora_id_for
from kvalign.verify.props.tenants.body import Published


def _stored(ev: Any) -> bool:
    return type(ev).__name__.startswith("BlockStored")


def strip_lora_name(raw: list[Any], published: Published) -> list[Any]:
    """Every page published with no LoRA name (SGLang 0.5.21's events: ``LORA_NOT_IN_EVENTS``)."""
    return [msgspec.structs.replace(ev, lora_name=None) if _stored(ev) else ev for ev in raw]


def lora_id_as_name(raw: list[Any], published: Published) -> list[Any]:
    """A LoRA page published under its adapter id instead of the name the request carries."""
    lora = published.tenant[0]
    return [msgspec.structs.replace(ev, lora_name=lora_id_for(lora)) if _stored(ev) and lora else ev for ev in raw]


def restore_lora_name(raw: list[Any], published: Published) -> list[Any]:
    """Every page published with its tenant's LoRA name, whatever SGLang knew (hashes untouched)."""
    lora = published.tenant[0]
    return [msgspec.structs.replace(ev, lora_name=lora) if _stored(ev) and lora else ev for ev in raw]


def parent_elsewhere(raw: list[Any], published: Published) -> list[Any]:
    """A page's parent replaced by a page another tenant published (a parent outside the namespace)."""
    others = [h for h, owners in published.owners.items() if published.tenant not in owners]
    if not others:
        return raw
    out = []
    for ev in raw:
        if _stored(ev) and ev.parent_block_hash is not None:
            signed = others[0] - (1 << 64) if others[0] > (U64_MASK >> 1) else others[0]
            ev = msgspec.structs.replace(ev, parent_block_hash=signed)
        out.append(ev)
    return out


ALL = {"strip_lora_name": strip_lora_name, "lora_id_as_name": lora_id_as_name, "restore_lora_name": restore_lora_name,
       "parent_elsewhere": parent_elsewhere}
