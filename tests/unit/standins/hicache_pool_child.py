"""For ``test_hicache_cpu_standin.py``: SGLang's real host pool on the CPU, with the stand-in.

Run (:func:`collect`) in the release's shared child (``standin_child.py``), which has the CPU engine
stand-in's environment (``kvalign.standins.sglang_cpu.worker_env()``), so the stand-in is loaded
exactly as in a real worker (``sitecustomize`` -> import hooks -> patches).
Builds SGLang's own device pool (``MHATokenToKVPool``) and host pool (``MHATokenToKVPoolHost``,
``pin_memory=True``) for each (io backend, layout) the stand-in covers, backs device pages up
through ``backup_from_device_all_layer``, reads them back through the host pool's own
``get_data_page``, loads them into other device slots through ``load_to_device_per_layer``, and
returns what it saw (as a script, under the same environment: prints it as one JSON line).
``--mutants NAME ...`` then swaps in each broken op in turn (the negative controls), under the key ``mutants``.
"""

from __future__ import annotations

import json
import sys

import torch

LAYERS, HEADS, DIM, PAGE, DEVICE_TOKENS = 3, 2, 8, 4, 64
#: every pool built stays alive: on a CPU engine SGLang's ``destroy`` skips ``cudaHostUnregister``
#: (``if self.pin_memory and (_is_cuda or _is_hip)``), so a freed buffer's range stays registered and
#: a new buffer at the same address would be refused, as the CUDA runtime would refuse it
KEEP: list = []


def mutate(name: str) -> None:
    """Break one op where ``mha.py`` looks it up: the round trip must then fail."""
    from sglang.srt.mem_cache.pool_host import mha

    from kvalign.standins.hicache_cpu import kvcacheio as io

    def pf_without_layer(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                         dst_layout_dim, num_layers, **_):  # every layer written at layer 0's offset
        io._launch(item_size, src_indices, dst_indices, range(num_layers),
                   [(io._tbl(src_k_layers, item_size), io._pf(dst_k, dst_layout_dim, 0)),
                    (io._tbl(src_v_layers, item_size), io._pf(dst_v, dst_layout_dim, 0))])

    def k_for_v(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_):
        io.transfer_kv_per_layer_pf_lf(src_k, dst_k, src_k, dst_v, src_indices, dst_indices, layer_id, item_size,
                                       src_layout_dim)

    table = {"pf_without_layer": ("transfer_kv_all_layer_lf_pf", pf_without_layer),
             "k_for_v": ("transfer_kv_per_layer_pf_lf", k_for_v)}
    op, fn = table[name]
    setattr(mha, op, fn)


def round_trip(io_backend: str, layout: str) -> dict:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    torch.manual_seed(0)
    device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    for buf in (*device.k_buffer, *device.v_buffer):
        buf.copy_(torch.randn_like(buf))
    if hasattr(device, "get_device_pool_infos"):  # 0.5.23: the host pool is built from the device pool's buffer info
        info = device.get_device_pool_infos()[0].buffer_info
        host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu",
                                    device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS)
    else:  # 0.5.19, 0.5.21: from the device pool itself
        host = MHATokenToKVPoolHost(device, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    KEEP.append((device, host))
    pages = [3, 7, 2]  # device pages to back up, in this order
    dev = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
    hst = host.alloc(len(dev))
    host.backup_from_device_all_layer(device, hst, dev, io_backend)
    backed = []
    for i in range(len(pages)):
        got = host.get_data_page(int(hst[i * PAGE]), flat=False)  # SGLang's own view of one host page
        want_k = torch.stack([device.k_buffer[l][dev[i * PAGE:(i + 1) * PAGE]] for l in range(LAYERS)])
        want_v = torch.stack([device.v_buffer[l][dev[i * PAGE:(i + 1) * PAGE]] for l in range(LAYERS)])
        if layout == "layer_first":  # [2, layer, page_size, head, dim]
            ok = torch.equal(got[0], want_k) and torch.equal(got[1], want_v)
        elif layout == "page_first":  # [2, page_size, layer, head, dim]
            ok = torch.equal(got[0], want_k.transpose(0, 1)) and torch.equal(got[1], want_v.transpose(0, 1))
        else:  # page_first_direct: [2, 1, layer, page_size, head, dim]
            ok = torch.equal(got[0, 0], want_k) and torch.equal(got[1, 0], want_v)
        backed.append(ok)
    back = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (10, 12, 11)])  # fresh device slots
    others = torch.ones(device.k_buffer[0].shape[0], dtype=torch.bool)
    others[back] = False
    before = [b[others].clone() for b in (*device.k_buffer, *device.v_buffer)]
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, hst, back, layer, io_backend)
    loaded = all(torch.equal(device.k_buffer[l][back], device.k_buffer[l][dev]) and
                 torch.equal(device.v_buffer[l][back], device.v_buffer[l][dev]) for l in range(LAYERS))
    untouched = all(torch.equal(b[others], was) for b, was in zip((*device.k_buffer, *device.v_buffer), before))
    return {"backed_up": backed, "loaded_back": loaded, "other_slots_untouched": untouched}


def registration() -> dict:
    """SGLang's own register/unregister code against the stand-in's registry."""
    from sglang.srt.mem_cache.pool_host import common

    from kvalign.standins.hicache_cpu.pinned import REGISTRY

    buf = torch.empty(1024, dtype=torch.uint8)
    before = len(REGISTRY.registered())
    common._cuda_host_register(buf)
    registered = REGISTRY.registered().get(buf.data_ptr()) == buf.numel()
    try:
        common._cuda_host_register(buf)
        twice = "accepted"
    except RuntimeError as exc:
        twice = str(exc).split(")")[0]
    common._cuda_host_unregister(buf)
    return {"registered": registered, "second_register": twice, "released": len(REGISTRY.registered()) == before,
            "cuda_elsewhere": __import__("torch").cuda.is_available()}


def no_host_reserve() -> None:
    """Size the pools against the machine's available memory without SGLang's 10 GiB reserve.

    SGLang refuses a host pool larger than the available memory less ``HICACHE_HOST_MEMORY_RESERVE_BYTES``
    (``pool_host/base.py``, read when a pool is built, in 0.5.19, 0.5.21 and 0.5.23): a server's sizing rule
    for the OS and other processes. The pools here are about 24 KiB, but in the full suite a real-engine
    cluster on the other worker can hold the reserve for minutes, and every release refused then
    (``-0.19 GB free``, 2026-12-07); waiting it out cost up to 60 s a release. SGLang's own check still runs,
    against what is available."""
    from sglang.srt.mem_cache.pool_host import base

    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 10 * 1024**3, "SGLang's host-memory reserve moved"
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0


def collect(argv: list[str]) -> dict:
    """Every covered (io backend, layout)'s round trip and the registration, then (``--mutants``) each broken op."""
    pairs = (("kernel", "page_first"), ("kernel", "layer_first"), ("direct", "layer_first"),
             ("direct", "page_first_direct"))
    no_host_reserve()
    out: dict = {f"{b}/{l}": round_trip(b, l) for b, l in pairs}
    out["registration"] = registration()
    if "--mutants" in argv:  # then each broken op in turn, on SGLang's default pair only
        from sglang.srt.mem_cache.pool_host import mha

        out["mutants"] = {}
        for name in argv[argv.index("--mutants") + 1:]:
            saved = dict(vars(mha))
            mutate(name)
            out["mutants"][name] = round_trip("kernel", "page_first")
            for op in ("transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf"):
                setattr(mha, op, saved[op])
    return out


if __name__ == "__main__":
    print(json.dumps(collect(sys.argv[1:])))
