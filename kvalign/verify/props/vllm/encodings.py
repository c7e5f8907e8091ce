"""The encoding rows of ``check --engine vllm``: vLLM's two block-hash encodings and its event encoding.

**hashes**: vLLM publishes a block's hash as a 64-bit int by default and as the hash's 32 bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (``vllm/envs.py``; ``kv_cache_utils.maybe_convert_block_hash``).
Each row serves generated prompts on vLLM's real ``KVCacheManager`` in one encoding and requires every block
vLLM holds indexed by the router under vLLM's hash. ``int`` is aligned; ``bytes`` is a finding,
:attr:`~kvalign.model.causes.Cause.VLLM_BYTES_HASHES_DROPPED`: Dynamo 1.6.1's relay indexes none of them and
says nothing at its default log level. The ``int`` row's negative control re-encodes vLLM's int hashes as
32-byte strings on the hop (what the ``bytes`` setting puts on the wire): the router then indexes none.
The ``bytes`` row is a finding, with no control of its own: the ``int`` row's is its mechanism. ``bytes`` is a
setting a user opts into, so its row is a property of its own (:mod:`kvalign.verify.props.vllm_bytes`, surface
"vLLM workers with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"): ``check --engine vllm`` is a verdict on workers with
int hashes and names it as not run; ``--all`` runs it.

**events**: vLLM 0.32's ``KVCacheEvent`` structs are tagged msgpack *maps* (``tag=True`` without
``array_like``; the batch is a positional ``[ts, events, data_parallel_rank]``), with no option for the
positional arrays vLLM published before vllm-project/vllm#42892 (vLLM 0.26 already sends maps; 0.23 still
sends arrays). So one row, named after the encoding the release's publisher sends (``map`` or ``positional``,
seen on the hop): every tenant (LoRA by name, salt by Dynamo's prefix) credited what vLLM reuses for it, which
needs the relay to read ``lora_name`` and ``extra_keys`` by name. (Dynamo 1.6.1's relay also decodes the
positional form, salt and LoRA included: tests/unit/oracles/test_vllm_encodings.py.) Negative control: a
hop renaming those two fields (a map consumer reading other names than vLLM writes, the break llm-d-kv-cache#661
saw): the router then credits the tenants' blocks to the base model.
"""

from __future__ import annotations

from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm import bodies, controls, namespace
from kvalign.verify.props.vllm.bodies import Body, _serve
from kvalign.verify.props.vllm.strategies import TAIL, TENANTS, Served, fresh_base, sequences

#: the environment each hash encoding runs vLLM with (its default: int)
HASH_ENCODINGS: dict[str, dict[str, str] | None] = {"int": None, "bytes": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}}


def hashes_body(worker: Any) -> Body:
    """Every block vLLM holds after the sequence is indexed by the router under vLLM's own hash; one that is
    not is ``VLLM_BYTES_HASHES_DROPPED`` where vLLM's hash is bytes, ``NAMESPACE_DROPPED`` where another tenant's
    block holds its keys on a release whose hash takes no namespace (:mod:`.namespace`), else ``EVENTS_DROPPED``."""

    hasher = namespace.release_hasher()

    def body(seq: list[Served]) -> None:
        base, b = fresh_base(), worker.engine.block_size
        live: dict[Any, int] = {}  # vLLM's hash of each block it holds -> the prompt that stored it
        log = namespace.StoreLog(hasher, b)
        for i, served in enumerate(seq):
            for ev in _serve(worker, served.tokens(base, b), served.tenant):
                log.add(ev, served.tenant)
                if ev["type"] == "BlockStored":
                    live.update(dict.fromkeys(ev["block_hashes"], i))
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        live.pop(h, None)
                elif ev["type"] == "AllBlocksCleared":
                    live.clear()
        indexed = {engine for _p, engine, _l in worker.dump()}
        missing = [h for h in live if h not in indexed]
        if missing:
            h, i = missing[0], live[missing[0]]
            # the prompt that stored it, one token longer: vLLM reuses each of its full blocks it holds
            tokens, tenant = seq[i].tokens(base, b) + [base + TAIL + 1], seq[i].tenant
            hit = worker.engine.match(tokens, lora_name=tenant[0], cache_salt=bodies._salt(tenant))
            kind = f"{len(h)}-byte" if isinstance(h, bytes) else "int"
            shared = None if isinstance(h, bytes) else log.collision(h, indexed)
            raise Mismatch("hashes", f"{len(missing)} of the {len(live)} blocks vLLM holds never indexed (vLLM's {kind} "
                                     f"hashes); prompt {i} and one token more: vLLM reuses {hit} tokens, the router "
                                     f"credits {worker.overlap(tokens, lora_name=tenant[0], cache_namespace=tenant[1])} "
                                     "blocks" + (f"; {shared}" if shared else ""),
                           Cause.VLLM_BYTES_HASHES_DROPPED if isinstance(h, bytes) else
                           Cause.NAMESPACE_DROPPED if shared else Cause.EVENTS_DROPPED, seq)

    return body


def int_as_bytes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's int block hashes (and parents) as 32-byte big-endian strings, as the bytes setting would send a hash."""
    def as_bytes(h: Any) -> Any:
        return h.to_bytes(32, "big") if isinstance(h, int) else h

    for e in events:
        if "block_hashes" in e:
            e["block_hashes"] = [as_bytes(h) for h in e["block_hashes"]]
        if e.get("parent_block_hash") is not None:
            e["parent_block_hash"] = as_bytes(e["parent_block_hash"])
    return events


#: the fields the relay keys a tenant's block by, and the names the control's hop gives them instead
RENAMED = {"lora_name": "lora", "extra_keys": "extra"}


def renamed_fields(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's named maps with ``lora_name`` and ``extra_keys`` under other names."""
    return [{RENAMED.get(k, k): v for k, v in e.items()} for e in events]


def encoding_rows(path: Any, n: int, seed: int | None, block_size: int, num_blocks: int) -> list[RowResult]:
    """``hashes int`` and ``events`` (``map`` or ``positional``) on a vLLM worker of their own, as vLLM runs by default
    (int hashes), each with its control; a worker that cannot start is its rows with their cause, never an exception."""
    from kvalign.verify.props.vllm.running import control_run, on_engine, search_row

    def rows(worker: Any) -> list[RowResult]:
        body = hashes_body(worker)
        out = [search_row("hashes", body, sequences(block_size, TENANTS), n, seed,
                          ("int_as_bytes (the hop re-encodes vLLM's int block hashes as 32 bytes)",
                           control_run(worker, body, [Served((0, 1, 2), 3)], seed, int_as_bytes), Cause.EVENTS_DROPPED),
                          variant="int")]
        tenants, wire = bodies.tenants_body(worker), controls.wire_encoding(worker)
        out.append(search_row("events", tenants, sequences(block_size, TENANTS), n, seed,
                              ("renamed_fields (the hop names lora_name and extra_keys otherwise)" if wire == "map" else
                               "renamed_fields (the hop empties lora_name's and extra_keys' positions)",
                               control_run(worker, tenants, [Served((0, 1, 2), 3, ("adapterA", "t1"))], seed,
                                           renamed_fields), Cause.TENANTS_SHARE_KEYS), variant=wire))
        return out

    # where the worker cannot run, the events row is named after the encoding vLLM 0.26 and later send
    return on_engine([("hashes", "int"), ("events", "map")], path, block_size, num_blocks, rows,
                     env=HASH_ENCODINGS["int"])


def bytes_rows(path: Any, n: int, seed: int | None, block_size: int, num_blocks: int) -> list[RowResult]:
    """``hashes bytes``: the opt-in encoding (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) on a vLLM worker of its own,
    the ``vllm_bytes`` property's one row. No control of its own: the ``int`` row's ``int_as_bytes`` is its
    mechanism (the same bytes on the wire, from an int worker, indexed by none)."""
    from kvalign.verify.props.vllm.running import on_engine, search_row

    def rows(worker: Any) -> list[RowResult]:
        return [search_row("hashes", hashes_body(worker), sequences(block_size, TENANTS), n, seed, None,
                           variant="bytes")]

    return on_engine([("hashes", "bytes")], path, block_size, num_blocks, rows, env=HASH_ENCODINGS["bytes"])
