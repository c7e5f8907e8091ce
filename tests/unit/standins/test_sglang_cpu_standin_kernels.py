"""The CPU kernel stand-ins against SGLang's own Triton kernels, run by Triton's interpreter.

Once per supported release (``kvalign.standins.sglang_cpu.SUPPORTED``): the environment's SGLang,
and each other release from ``kvalign matrix``'s wheel cache (installed by the fixture; skipped
with the reason when it cannot be). Call sites moved between releases: in 0.5.19 and 0.5.21 the
tree kernels' wrappers live in ``srt/speculative/eagle_utils.py`` (``build_tree_kernel_efficient``
dispatches to its Triton / CPU branch functions directly, called here the same way), the
draft-cache-locs launch is inline in ``eagle_worker_common.prepare_for_draft`` (reproduced here
with its arguments), and ``fill_front_out_cache_loc_func`` does not exist (skipped there).

For every ``*_cpu`` name in :mod:`kvalign.standins.sglang_cpu.kernels`, Hypothesis draws inputs
shaped as SGLang 0.5.23 builds them (int32/int64 index tensors, small batches, topk=1 chains and
topk>1 trees), and SGLang's ``*_func`` wrapper runs twice on identical copies: once down its
Triton branch (the reference: SGLang's Triton kernel under ``TRITON_INTERPRET=1`` on CPU tensors)
and once down its CPU branch with the stand-in bound where SGLang imports it from ``sgl_kernel``.
Every output and every mutated buffer must be equal, dtype included. Going through SGLang's own
call sites also checks argument order, keyword names and out-parameter conventions.

Triton decides interpreted-or-compiled when a ``@triton.jit`` function is *created*, including
its standard library (``tl.sum`` is one), so the reference cannot run in a pytest process that
may already have imported triton/SGLang normally. It runs in one child process (this file run
as a script) started with ``TRITON_INTERPRET=1`` and without ``SGLANG_USE_CPU_ENGINE`` (so
SGLang's modules take their GPU imports and never need ``sgl_kernel``).

Negative controls: each kernel has an off-by-one (or write-before-read) mutant of the stand-in,
and the same comparison must catch it.

Recorded references (``tests/unit/recorded.py``): CI draws the same inputs every run, and
interpreting the Triton kernels on them cost over two minutes per release on the shared 2-core
machine. So
``scripts/record_references.py`` records, per release, SGLang's Triton outputs on
:data:`RECORDED_EXAMPLES` derandomized inputs per call site, keyed by (release, Triton version,
SHA-256 of the kernel and call-site sources, SHA-256 of the strategies below). While the key
matches, the stand-ins and every mutant go through the same CPU call sites in the same child and
are held to the recorded outputs; no Triton kernel runs. A stale or missing key is warned
(``StaleReference``) and the interpreted comparison runs instead. The nightly (``KVALIGN_NIGHTLY=1``,
the ``nightly`` profile or ``-m nightly``) runs the interpreted comparison on freshly drawn inputs
and checks that the kernels still give the recorded outputs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import pickle
import select
import struct
import subprocess
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit's recorded references, also when run as a script
import recorded  # noqa: E402
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvalign.standins.sglang_cpu import SUPPORTED
from kvalign.standins.sglang_cpu import kernels as standin

#: One reference child per release, each importing that release's kernel modules and their SGLang
#: import chain (30-55 s here), and the interpreted kernels on a stale key: not in the fast tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
REQUEST_TIMEOUT_S = 120.0
#: The child's start-up: a release from the wheel cache is compiled from source on every import (the
#: cache holds no bytecode), which took over 120 s for 0.5.19 on the shared 2-core machine.
START_TIMEOUT_S = 300.0
#: Derandomized cases recorded per call site: the ``ci`` profile's ``max_examples``.
RECORDED_EXAMPLES = 100

# --------------------------------------------------------------------------------------------
# Mutants: the negative controls. Each wraps the stand-in with one classic off-by-one.


def _mutant_fill_bonus(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """Takes the token before the bonus (accept_len - 2 instead of - 1)."""
    standin.fill_bonus_tokens_cpu(accept_tokens, (accept_lens - 1).clamp(min=1), bonus_tokens, accept_stride)


def _mutant_fill_accept(accept_index, out_cache_loc, accept_out_cache_loc):
    """Reads the slot one to the right of each accepted node."""
    standin.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc.roll(-1), accept_out_cache_loc)


def _mutant_assign_req_to_token_pool(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len):
    """Writes one slot fewer per request (exclusive end treated as inclusive-minus-one)."""
    standin.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end - 1, out_cache_loc, pool_len)


def _mutant_assign_extend(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len):
    """Reads each request's row one column to the right."""
    standin.assign_extend_cache_locs_cpu(req_pool_indices, req_to_token.roll(-1, 1), start, end, out_cache_loc, pool_len)


def _mutant_assign_draft(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols):
    """Starts the draft slots one column after seq_len."""
    standin.assign_draft_cache_locs_contiguous_cpu(
        req_pool_indices, req_to_token.roll(-1, 1), seq_lens, out_cache_loc, pool_len, topk, num_cols)


def _mutant_copy_kv(data_ptrs, strides, tgt_loc, src_loc):
    """Moves rows one by one, so a row moved earlier is read back as the source of a later move."""
    for j in range(tgt_loc.numel()):
        standin.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc[j : j + 1], src_loc[j : j + 1])


def _mutant_build_tree(parent_list, selected_index, seq_lens, *buffers_and_sizes):
    """Walks one level less of each token's ancestry (depth - 1)."""
    *buffers, topk, depth, draft_token_num, mode = buffers_and_sizes
    standin.build_tree_kernel_efficient_cpu(parent_list, selected_index, seq_lens, *buffers, topk, depth - 1,
                                            draft_token_num, mode)


def _mutant_verify(*, target_predict, **kwargs):
    """Checks each draft against the target's prediction at the neighbouring node."""
    standin.verify_tree_greedy_cpu(target_predict=target_predict.roll(1, 1), **kwargs)


MUTANTS: dict[str, Callable[..., None]] = {
    "fill_bonus_tokens_cpu": _mutant_fill_bonus,
    "fill_accept_out_cache_loc_cpu": _mutant_fill_accept,
    "assign_req_to_token_pool_cpu": _mutant_assign_req_to_token_pool,
    "assign_extend_cache_locs_cpu": _mutant_assign_extend,
    "assign_draft_cache_locs_contiguous_cpu": _mutant_assign_draft,
    "copy_all_layer_kv_cache_cpu": _mutant_copy_kv,
    "build_tree_kernel_efficient_cpu": _mutant_build_tree,
    "verify_tree_greedy_cpu": _mutant_verify,
}

# --------------------------------------------------------------------------------------------
# Child side: SGLang's call sites, each run down its Triton branch or its CPU branch.

#: PyPI torchvision is a CUDA build whose op-registration modules fail beside torch+cpu; SGLang
#: only needs its Python parts (same shim as kvalign.oracles.sglang and the stand-in's hooks).
_TORCHVISION_SHIM = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
_SGLANG_MODULES = {
    "eagle": "sglang.kernels.ops.speculative.eagle",
    "spec_tree": "sglang.kernels.ops.speculative.spec_tree",
    "cache_locs": "sglang.kernels.ops.speculative.cache_locs",
    "cache_move": "sglang.kernels.ops.kvcache.cache_move",
    "allocation": "sglang.srt.mem_cache.allocation",
}
#: Where a release keeps a call site elsewhere: "spec_tree" is the module holding the tree
#: wrappers (and their platform flags), "spec_tree_kernels" the one holding the Triton kernels.
_BEFORE_0_5_23 = {"spec_tree": "sglang.srt.speculative.eagle_utils",
                  "spec_tree_kernels": "sglang.kernels.ops.speculative.spec_tree"}
_RELEASE_MODULES = {"0.5.19": _BEFORE_0_5_23, "0.5.21": _BEFORE_0_5_23}
#: The Triton kernels the references launch (module key, attribute).
_REFERENCE_KERNELS = (
    ("eagle", "fill_bonus_tokens"), ("eagle", "fill_accept_out_cache_loc"),
    ("allocation", "assign_req_to_token_pool"), ("cache_locs", "assign_extend_cache_locs"),
    ("cache_locs", "assign_draft_cache_locs_contiguous"), ("cache_move", "copy_all_layer_kv_cache_tiled"),
    ("spec_tree", "sgl_build_tree_kernel_efficient_triton"), ("spec_tree", "verify_tree_greedy_kernel_triton"),
)
_PLATFORM_FLAGS = ("_is_cpu", "_is_cuda", "_is_hip", "_is_musa", "_is_npu", "_is_xpu")
_M: dict[str, types.ModuleType] = {}


@contextmanager
def _branch(module: str, impl: str, bound_as: str, kernel: str, triton_flag: str | None = None) -> Iterator[None]:
    """Route ``module``'s dispatch to its Triton branch (``impl == "triton"``) or to its CPU branch
    with ``kernel`` (stand-in or mutant) bound under the name SGLang imported it as."""
    mod = _M[module]
    saved = {name: getattr(mod, name) for name in (*_PLATFORM_FLAGS, bound_as) if hasattr(mod, name)}
    for name in _PLATFORM_FLAGS:
        if hasattr(mod, name):
            setattr(mod, name, False)
    if impl == "triton":
        if triton_flag:  # the platform whose branch launches the Triton kernel
            setattr(mod, triton_flag, True)
    else:
        mod._is_cpu = True
        setattr(mod, bound_as, MUTANTS[kernel] if impl == "mutant" else getattr(standin, kernel))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mod, name, value)
        if bound_as not in saved and hasattr(mod, bound_as):
            delattr(mod, bound_as)


def _call_fill_bonus(impl, accept_tokens, accept_lens, bonus_tokens, accept_stride):
    with _branch("eagle", impl, "fill_bonus_tokens_cpu", "fill_bonus_tokens_cpu"):
        _M["eagle"].fill_bonus_tokens_func(accept_tokens, accept_lens, bonus_tokens, accept_stride, accept_lens.numel())
    return bonus_tokens


def _call_fill_accept(impl, accept_index, out_cache_loc, accept_out_cache_loc):
    with _branch("eagle", impl, "fill_accept_out_cache_loc_cpu", "fill_accept_out_cache_loc_cpu"):
        _M["eagle"].fill_accept_out_cache_loc_func(accept_index, out_cache_loc, accept_out_cache_loc, accept_index.numel())
    return accept_out_cache_loc


def _call_assign_req_to_token_pool(impl, req_pool_indices, req_to_token, start, end, out_cache_loc):
    with _branch("allocation", impl, "assign_req_to_token_pool_cpu", "assign_req_to_token_pool_cpu"):
        _M["allocation"].assign_req_to_token_pool_func(req_pool_indices, req_to_token, start, end, out_cache_loc,
                                                       req_pool_indices.numel())
    return req_to_token


def _call_assign_extend(impl, req_pool_indices, req_to_token, start, end, draft_token_num):
    # The GPU branch is taken on CUDA; here it only allocates the output and launches the kernel.
    with _branch("cache_locs", impl, "assign_extend_cache_locs_cpu", "assign_extend_cache_locs_cpu", "_is_cuda"):
        return _M["cache_locs"].assign_extend_cache_locs_func(
            req_pool_indices=req_pool_indices, req_to_token=req_to_token, start_offset=start, end_offset=end,
            batch_size=req_pool_indices.numel(), draft_token_num=draft_token_num, device="cpu")


def _call_fill_front(impl, num_front, out_cache_loc, front_out_cache_loc):
    with _branch("cache_locs", impl, "assign_extend_cache_locs_cpu", "assign_extend_cache_locs_cpu"):
        _M["cache_locs"].fill_front_out_cache_loc_func(num_front, out_cache_loc, front_out_cache_loc)
    return front_out_cache_loc


def _call_assign_draft(impl, req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk, num_cols):
    cache_locs = _M["cache_locs"]
    with _branch("cache_locs", impl, "assign_draft_cache_locs_contiguous_cpu", "assign_draft_cache_locs_contiguous_cpu"):
        if hasattr(cache_locs, "assign_draft_cache_locs_contiguous_func"):
            cache_locs.assign_draft_cache_locs_contiguous_func(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                                               topk, num_cols)
        else:  # 0.5.21: eagle_worker_common.prepare_for_draft's two branches, inline, same arguments
            args = (req_pool_indices, req_to_token, seq_lens, out_cache_loc, req_to_token.shape[1], topk, num_cols)
            if cache_locs._is_cpu:
                cache_locs.assign_draft_cache_locs_contiguous_cpu(*args)
            else:
                cache_locs.assign_draft_cache_locs_contiguous[(seq_lens.shape[0],)](*args)
    return out_cache_loc


def _call_copy_kv(impl, buffers, tgt_loc, src_loc):
    # The pool's pointer and stride tensors (memory_pool._init_data_ptrs_and_strides), and its
    # tiling for rows under 4 KiB (_KV_COPY_TILE_SIZE_SMALL, _KV_COPY_NUM_WARPS_SMALL_TILE).
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    stride_bytes = int(strides[0])
    config = {"bytes_per_tile": 128, "byte_tiles": (stride_bytes + 127) // 128, "num_warps": 4}
    n = tgt_loc.numel()
    with _branch("cache_move", impl, "copy_all_layer_kv_cache_cpu", "copy_all_layer_kv_cache_cpu"):
        _M["cache_move"].copy_all_layer_kv_cache_func(data_ptrs, strides, tgt_loc, src_loc, n,
                                                      1 << (n - 1).bit_length(), config)
    return buffers


def _call_build_tree(impl, parent_list, selected_index, seq_lens, tree_mask, positions, retrieve_buf, topk, steps,
                     draft_token_num, mode):
    spec_tree = _M["spec_tree"]
    args = (parent_list, selected_index, seq_lens, tree_mask, positions, *retrieve_buf, topk, steps, draft_token_num,
            spec_tree.TreeMaskMode(mode))
    with _branch("spec_tree", impl, "sgl_build_tree_kernel_efficient_cpu", "build_tree_kernel_efficient_cpu", "_is_xpu"):
        if hasattr(spec_tree, "build_tree_kernel_efficient_func"):
            spec_tree.build_tree_kernel_efficient_func(*args)
        elif spec_tree._is_cpu:  # 0.5.21: build_tree_kernel_efficient's CPU and XPU branches, same arguments
            spec_tree.sgl_build_tree_kernel_efficient_cpu(*args)
        else:
            spec_tree.sgl_build_tree_kernel_triton(*args)
    return tree_mask, positions, retrieve_buf


def _call_verify(impl, predicts, accept_index, accept_token_num, candidates, retrieve_buf, target_predict, topk):
    with _branch("spec_tree", impl, "sgl_verify_tree_greedy_cpu", "verify_tree_greedy_cpu", "_is_xpu"):
        return _M["spec_tree"].verify_tree_greedy_func(
            predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num, candidates=candidates,
            retrieve_index=retrieve_buf[0], retrieve_next_token=retrieve_buf[1],
            retrieve_next_sibling=retrieve_buf[2], target_predict=target_predict, topk=topk)


#: call site -> (stand-in name, runner). fill_front is a second call site of assign_extend.
CALLS: dict[str, tuple[str, Callable[..., Any]]] = {
    "fill_bonus_tokens_func": ("fill_bonus_tokens_cpu", _call_fill_bonus),
    "fill_accept_out_cache_loc_func": ("fill_accept_out_cache_loc_cpu", _call_fill_accept),
    "assign_req_to_token_pool_func": ("assign_req_to_token_pool_cpu", _call_assign_req_to_token_pool),
    "assign_extend_cache_locs_func": ("assign_extend_cache_locs_cpu", _call_assign_extend),
    "fill_front_out_cache_loc_func": ("assign_extend_cache_locs_cpu", _call_fill_front),
    "assign_draft_cache_locs_contiguous_func": ("assign_draft_cache_locs_contiguous_cpu", _call_assign_draft),
    "copy_all_layer_kv_cache_func": ("copy_all_layer_kv_cache_cpu", _call_copy_kv),
    "build_tree_kernel_efficient_func": ("build_tree_kernel_efficient_cpu", _call_build_tree),
    "verify_tree_greedy_func": ("verify_tree_greedy_cpu", _call_verify),
}


def _send(stream, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("reference process closed its pipe")
    return data


def _recv(stream) -> Any:
    (n,) = struct.unpack("<Q", _read_exact(stream, 8))
    return pickle.loads(_read_exact(stream, n))


def _kernel_sources(root: Path, kernels: list[Any]) -> list[str]:
    """The files the references run, relative to SGLang's root (the recording's key hashes them):
    the call sites' modules, and each Triton kernel's file and those of the jit helpers it calls."""
    from triton.runtime.interpreter import InterpretedFunction

    files = {Path(module.__file__).resolve() for module in _M.values()}
    todo, seen = list(kernels), set()
    while todo:
        fn = getattr(todo.pop(), "fn", None)  # the Python function an InterpretedFunction wraps
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        files.add(Path(inspect.getsourcefile(fn)).resolve())
        todo += [g for name in fn.__code__.co_names if isinstance(g := fn.__globals__.get(name), InterpretedFunction)]
    return sorted(str(f.relative_to(root)) for f in files)


def _serve() -> None:
    """Child main: import SGLang's kernel modules interpreted, then answer requests on stdin."""
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything SGLang prints goes to stderr, not into the protocol
    for name in _TORCHVISION_SHIM:
        sys.modules.setdefault(name, types.ModuleType(name))
    from importlib import metadata

    from triton.runtime.interpreter import InterpretedFunction

    release = metadata.version("sglang")
    _M.update({key: importlib.import_module(path)
               for key, path in {**_SGLANG_MODULES, **_RELEASE_MODULES.get(release, {})}.items()})
    kernels_of = lambda m: _M.get(f"{m}_kernels", _M[m])  # noqa: E731
    root = Path(importlib.import_module("sglang").__file__).resolve().parents[1]
    _send(protocol_out, {
        "release": release,
        "sglang_root": str(root),
        "sources": _kernel_sources(root, [getattr(kernels_of(m), k) for m, k in _REFERENCE_KERNELS]),
        "sgl_kernel_imported": "sgl_kernel" in sys.modules,
        "not_interpreted": [f"{m}.{k}" for m, k in _REFERENCE_KERNELS
                            if not isinstance(getattr(kernels_of(m), k), InterpretedFunction)],
        "is_cpu": [key for key, mod in _M.items() if getattr(mod, "_is_cpu", False)],
        "calls": [c for c in CALLS if c != "fill_front_out_cache_loc_func"
                  or hasattr(_M["cache_locs"], "fill_front_out_cache_loc_func")],
    })
    while True:
        try:
            call, impl, args = _recv(sys.stdin.buffer)
        except EOFError:
            return
        try:
            reply = ("ok", CALLS[call][1](impl, *args))
        except Exception as exc:  # reported to the parent, which fails the test with it
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _send(protocol_out, reply)


# --------------------------------------------------------------------------------------------
# Parent side.


class KernelMismatch(AssertionError):
    """A stand-in's outputs differ from SGLang's Triton kernel's."""


class ReferenceProcess:
    """The child that runs SGLang's call sites; one per test module."""

    def __init__(self, stderr_path: Path, release_dir: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "KVALIGN_SGLANG_STANDIN")}
        env["TRITON_INTERPRET"] = "1"
        if release_dir is not None:  # that release first, then this checkout's kvalign
            env["PYTHONPATH"] = os.pathsep.join([str(release_dir), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.stderr_path = stderr_path
        self._stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        self.hello = self._reply(START_TIMEOUT_S)
        self.triton_runs = 0  # Triton kernels launched (interpreted) so far: none while replaying a recording

    def _reply(self, timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise RuntimeError(f"reference process silent for {timeout_s:.0f} s{self._tail()}")
        try:
            return _recv(self.proc.stdout)
        except EOFError:
            raise RuntimeError(f"reference process exited (rc {self.proc.wait()}){self._tail()}") from None

    def key(self) -> dict[str, str]:
        """The recording key of this release: what the child runs, and this file's strategies."""
        return recorded.kernels_key(self.hello["release"], Path(self.hello["sglang_root"]), self.hello["sources"],
                                    strategies_sha256())

    def _tail(self) -> str:
        self._stderr.flush()
        return "; its stderr ends:\n" + self.stderr_path.read_text(errors="replace")[-3000:]

    def run(self, call: str, impl: str, args: tuple) -> Any:
        self.triton_runs += impl == "triton"
        _send(self.proc.stdin, (call, impl, args))
        status, value = self._reply()
        if status != "ok":
            raise RuntimeError(f"{call} ({impl}) raised in the reference process: {value}")
        return value

    def close(self) -> None:
        self.proc.stdin.close()  # the child returns on EOF; SGLang's interpreter teardown is slow,
        try:  # and the child holds nothing worth a clean exit
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module", params=list(SUPPORTED))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceProcess]:
    """SGLang's call sites in one supported release (the environment's, or one from the wheel cache)."""
    from kvalign.verify.report.matrix import MatrixError, ensure_release

    for package in ("sglang", "triton"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed: run scripts/setup.sh (SGLang's Triton kernels are the reference)")
    try:
        release_dir = ensure_release("sglang", request.param)
    except MatrixError as exc:
        pytest.skip(f"sglang {request.param} cannot be installed into the wheel cache here: {exc}")
    ref = ReferenceProcess(tmp_path_factory.mktemp("triton-reference") / "stderr.log", release_dir)
    assert ref.hello["release"] == request.param
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def recording(reference: ReferenceProcess) -> dict[str, Any] | None:
    """The release's recorded Triton outputs while their key matches what the child runs; None
    (warned) when it does not."""
    return usable_recording(reference, recorded.load("kernels", reference.hello["release"]))


def _needs(reference: ReferenceProcess, call: str) -> None:
    if call not in reference.hello["calls"]:
        pytest.skip(f"sglang {reference.hello['release']} has no {call} call site")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _compare(call: str, got: str, expected: list[torch.Tensor], actual: list[torch.Tensor],
             want: str = "SGLang's Triton kernel") -> None:
    """Every output equal, dtype and shape included (KernelMismatch naming the first that is not)."""
    assert len(expected) == len(actual) > 0
    for i, (w, g) in enumerate(zip(expected, actual, strict=True)):
        if w.dtype != g.dtype or w.shape != g.shape or not torch.equal(w, g):
            raise KernelMismatch(f"{call} output {i}: {got} gave {g.dtype} {g.tolist()}, {want} {w.dtype} {w.tolist()}")


def check(reference: ReferenceProcess, call: str, args: tuple, impl: str = "standin") -> None:
    """Run ``call`` down its Triton branch and with ``impl`` on copies of ``args``; all equal."""
    expected = _tensors(reference.run(call, "triton", args))
    _compare(call, f"{CALLS[call][0]} ({impl})", expected, _tensors(reference.run(call, impl, args)))


def check_recorded(reference: ReferenceProcess, call: str, case: dict[str, Any], impl: str = "standin") -> None:
    """Run ``impl`` through ``call``'s CPU call site on a recorded case's inputs; equal to the Triton
    outputs recorded on them (no Triton kernel runs)."""
    actual = _tensors(reference.run(call, impl, tuple(recorded.decode(case["args"]))))
    _compare(call, f"{CALLS[call][0]} ({impl})", recorded.decode(case["triton"]), actual,
             "SGLang's Triton kernel (recorded)")


#: The lines that open and close this file's strategies section.
_STRATEGIES_HEADING, _TESTS_HEADING = "\n# Strategies: inputs as SGLang builds them.", "\n# Tests.\n"


def strategies_sha256() -> str:
    """SHA-256 of this file's strategies section: the recorded inputs were drawn from it."""
    text = Path(__file__).read_text()
    return hashlib.sha256(text[text.index(_STRATEGIES_HEADING):text.index(_TESTS_HEADING)].encode()).hexdigest()


def usable_recording(reference: ReferenceProcess, doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """``doc`` if its key is the one of what ``reference`` runs; else None, with a StaleReference
    warning that names what changed and the script that records afresh."""
    release = reference.hello["release"]
    why = recorded.stale_reason(doc, reference.key(), f" for sglang {release}'s stand-in kernels")
    if why:
        warnings.warn(recorded.StaleReference(why + "; running the interpreted Triton kernels instead"), stacklevel=2)
        return None
    return doc


def record(release: str, release_dir: Path | None, out: Path, stderr_path: Path) -> dict[str, Any]:
    """Draw :data:`RECORDED_EXAMPLES` derandomized inputs per call site of ``release``, run SGLang's
    Triton branch (interpreted) on each and write inputs, outputs and key to ``out`` (called by
    ``scripts/record_references.py``); returns the recording."""
    ref = ReferenceProcess(stderr_path, release_dir)
    try:
        hello = ref.hello
        assert hello["release"] == release, hello["release"]
        assert not hello["not_interpreted"] and not hello["is_cpu"] and not hello["sgl_kernel_imported"], hello
        cases: list[dict[str, Any]] = []
        for call in hello["calls"]:
            @settings(max_examples=RECORDED_EXAMPLES, derandomize=True, database=None, deadline=None,
                      phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
            @given(args=STRATEGIES[call])
            def draw(args: tuple) -> None:
                inputs = recorded.encode(args)  # the outputs are recorded for the inputs as the replay decodes them
                outputs = _tensors(ref.run(call, "triton", tuple(recorded.decode(inputs))))
                cases.append({"call": call, "args": inputs, "triton": recorded.encode(outputs)})

            draw()
        key = ref.key()
        doc = {"key": key, "examples": RECORDED_EXAMPLES, "cases": cases,
               "recorded_from": f"sglang {release}'s Triton kernels (triton {key['triton']}, TRITON_INTERPRET=1) "
                                f"through its own call sites, by scripts/record_references.py"}
        recorded.write(out, doc)
        return doc
    finally:
        ref.close()


# --------------------------------------------------------------------------------------------
# Strategies: inputs as SGLang builds them. (This section's text is hashed into the recording's key.)

VOCAB = 512  # the tiny test models' vocabulary


def _ints(shape: tuple[int, ...], lo: int, hi: int, dtype: torch.dtype) -> st.SearchStrategy[torch.Tensor]:
    n = 1
    for d in shape:
        n *= d
    return st.lists(st.integers(lo, hi), min_size=n, max_size=n).map(
        lambda v: torch.tensor(v, dtype=dtype).reshape(shape))


index_dtypes = st.sampled_from([torch.int64, torch.int32])


@st.composite
def fill_bonus_args(draw):
    # eagle_worker_common: accept_tokens = predict[accept_index] (int32, bs x (steps + 1)),
    # accept_lens int32 in [1, steps + 1], bonus_tokens = empty_like(accept_lens, int32).
    bs, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    tokens = draw(_ints((bs, width), 0, VOCAB - 1, torch.int32))
    lens = draw(_ints((bs,), 1, width, torch.int32))
    return tokens, lens, torch.full((bs,), -7, dtype=torch.int32), width


@st.composite
def fill_accept_args(draw):
    # spec_utils.move_accept_tokens: accept_index int32 (bs, steps + 1), each row the root node
    # then increasing accepted nodes of that request's tree, -1 padded; out_cache_loc int64 with
    # one slot per verify token; accept_out_cache_loc = zeros(accept_index.numel()).
    bs, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    num_draft = draw(st.integers(width, width + 3))
    rows = []
    for b in range(bs):
        accepted = draw(st.integers(0, min(width, num_draft) - 1))
        nodes = sorted(draw(st.lists(st.integers(1, num_draft - 1), unique=True, min_size=accepted,
                                     max_size=accepted))) if num_draft > 1 else []
        row = [b * num_draft] + [b * num_draft + n for n in nodes]
        rows.append(row + [-1] * (width - len(row)))
    slots = draw(st.lists(st.integers(0, 1 << 20), unique=True, min_size=bs * num_draft, max_size=bs * num_draft))
    return (torch.tensor(rows, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64),
            torch.zeros(bs * width, dtype=torch.int64))


@st.composite
def req_to_token_pool(draw, min_len: int = 1):
    """(req_to_token int32 pool prefilled with slot ids, distinct request rows int64)."""
    rows, pool_len = draw(st.integers(1, 6)), draw(st.integers(min_len, 48))
    table = draw(_ints((rows, pool_len), 0, 1 << 20, torch.int32))
    order = draw(st.permutations(range(rows)))
    bs = draw(st.integers(1, rows))
    return table, torch.tensor(order[:bs], dtype=torch.int64)


@st.composite
def assign_req_to_token_pool_args(draw):
    # allocation.alloc_for_decode/extend: row i gets columns [cur_kv_len, nxt_kv_len) from
    # the freshly allocated out_cache_loc (int64), packed in request order.
    table, req = draw(req_to_token_pool())
    pool_len, bs = table.shape[1], req.numel()
    start = [draw(st.integers(0, pool_len)) for _ in range(bs)]
    end = [draw(st.integers(s, pool_len)) for s in start]
    dtype = draw(index_dtypes)
    total = sum(e - s for s, e in zip(start, end))
    out = draw(_ints((total + draw(st.integers(0, 2)),), 0, 1 << 20, torch.int64))
    return req, table, torch.tensor(start, dtype=dtype), torch.tensor(end, dtype=dtype), out


@st.composite
def assign_extend_args(draw):
    # eagle_utils/ngram_worker: every request extends by draft_token_num slots from seq_len on.
    table, req = draw(req_to_token_pool())
    pool_len, bs = table.shape[1], req.numel()
    num = draw(st.integers(1, min(pool_len, 8)))
    start = torch.tensor([draw(st.integers(0, pool_len - num)) for _ in range(bs)], dtype=draw(index_dtypes))
    return req, table, start, start + num, num


@st.composite
def fill_front_args(draw):
    # spec_utils.move_accept_tokens: num_front = num_correct_drafts + 1 (int32), the verify window
    # out_cache_loc (int64, bs x num_draft_tokens), tgt_cache_loc = zeros int64.
    bs, width = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    window = draw(st.lists(st.integers(0, 1 << 20), unique=True, min_size=bs * width, max_size=bs * width))
    num_front = draw(_ints((bs,), 1, width, torch.int32))
    return num_front, torch.tensor(window, dtype=torch.int64), torch.zeros(bs * width, dtype=torch.int64)


@st.composite
def assign_draft_args(draw):
    # eagle_worker_common (page_size == 1 or topk == 1): topk * num_cols slots per request from
    # seq_len on, into out_cache_loc int64.
    topk, num_cols = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 4))
    table, req = draw(req_to_token_pool(min_len=topk * num_cols))
    pool_len, bs = table.shape[1], req.numel()
    seq_lens = torch.tensor([draw(st.integers(0, pool_len - topk * num_cols)) for _ in range(bs)], dtype=torch.int64)
    return req, table, seq_lens, torch.full((bs * topk * num_cols,), -7, dtype=torch.int64), topk, num_cols


@st.composite
def copy_kv_args(draw):
    # MHATokenToKVPool: one k and one v buffer per layer, (rows, heads, head_dim), all one dtype;
    # move_kv_cache(tgt, src) with distinct targets (sources may be targets: overlapping moves).
    # spec_utils.move_accept_tokens pads both with zeros (slot 0 -> slot 0: SGLang's padding slot).
    layers, rows = draw(st.integers(1, 3)), draw(st.integers(2, 10))
    heads, head_dim = draw(st.integers(1, 2)), draw(st.sampled_from([2, 4, 8]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    buffers = [torch.randn(rows, heads, head_dim, generator=gen).to(dtype) for _ in range(2 * layers)]
    pad = draw(st.integers(0, 2))
    first = 1 if pad else 0
    n = draw(st.integers(1, rows - first))
    tgt = draw(st.permutations(range(first, rows)))[:n] + [0] * pad
    src = draw(st.lists(st.integers(first, rows - 1), min_size=n, max_size=n)) + [0] * pad
    return buffers, torch.tensor(tgt, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)


def _draft_tree(gen: torch.Generator, bs: int, topk: int, steps: int, num_verify: int):
    """parent_list and top_scores_index as EAGLE's draft loop builds them from random scores:
    spec_utils._select_top_k_tokens_first/_later, then eagle_utils.organize_draft_results."""
    scores = torch.rand(bs, topk, generator=gen).sort(dim=-1, descending=True).values
    score_list = [scores.unsqueeze(1)]
    parents = [torch.arange(-1, topk, dtype=torch.long).expand(bs, -1)]
    for i in range(1, steps):
        topk_p = torch.rand(bs, topk, topk, generator=gen).sort(dim=-1, descending=True).values
        expand = scores.unsqueeze(2) * topk_p
        scores, cs_index = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        parents.append(cs_index + (topk * topk * (i - 1) + topk))
    flat = torch.cat(score_list, dim=1).flatten(1)
    top = torch.sort(torch.topk(flat, num_verify - 1, dim=-1).indices).values
    parent_list = torch.cat(parents[:-1], dim=1) if steps > 1 else torch.empty(bs, 0, dtype=torch.long)
    return parent_list, top


@st.composite
def build_tree_args(draw):
    # eagle_utils.build_tree_kernel_efficient: seq_lens int64, retrieve_buf full of -1 (3, bs, n),
    # positions int64; QLEN_ONLY (SGLang's CPU default) or FULL_MASK. Trees: topk=1 chains and
    # topk>1 trees from EAGLE's own selection, plus arbitrary sorted selections (which also reach
    # the kernel's "parent not selected" path).
    bs, topk, steps = draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2, 3])), draw(st.integers(1, 4))
    candidates = topk + (steps - 1) * topk * topk
    num_verify = draw(st.integers(2, min(candidates + 1, 8)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    parent_list, top = _draft_tree(gen, bs, topk, steps, num_verify)
    if draw(st.booleans()):
        top = torch.tensor([sorted(draw(st.lists(st.integers(0, candidates - 1), unique=True, min_size=num_verify - 1,
                                                  max_size=num_verify - 1))) for _ in range(bs)], dtype=torch.long)
    seq_lens = draw(_ints((bs,), 1, 24, draw(index_dtypes)))
    mode = draw(st.sampled_from([0, 1]))  # TreeMaskMode.FULL_MASK, QLEN_ONLY
    cells = (int(seq_lens.sum()) * num_verify if mode == 0 else 0) + num_verify * num_verify * bs
    tree_mask = torch.rand(cells, generator=gen) < 0.5  # untouched cells must stay as they were
    positions = torch.full((bs * num_verify,), -3, dtype=torch.int64)
    retrieve_buf = torch.full((3, bs, num_verify), -1, dtype=torch.long)
    return parent_list, top, seq_lens, tree_mask, positions, retrieve_buf, topk, steps, num_verify, mode


@st.composite
def verify_args(draw):
    # eagle_utils.verify: a draft tree per request as build_tree links it (next_token = first child,
    # siblings in index order), candidates = draft tokens, target_predict = argmax (int64),
    # predict int32 zeros, accept_index int32 (bs, steps + 1) of -1, accept_token_num int32.
    bs, topk, steps = draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2, 4])), draw(st.integers(1, 4))
    num_verify = steps + 1 if topk == 1 else draw(st.integers(2, 8))
    retrieve = torch.full((3, bs, num_verify), -1, dtype=torch.long)
    retrieve[0] = torch.arange(bs * num_verify).view(bs, num_verify)
    for b in range(bs):
        depth = [0]
        for i in range(1, num_verify):
            if topk == 1:
                parent = i - 1
            else:
                parent = draw(st.sampled_from([j for j in range(i) if depth[j] < steps]))
            depth.append(depth[parent] + 1)
            if retrieve[1, b, parent] == -1:
                retrieve[1, b, parent] = i
            else:
                last = int(retrieve[1, b, parent])
                while retrieve[2, b, last] != -1:
                    last = int(retrieve[2, b, last])
                retrieve[2, b, last] = i
    small_vocab = draw(st.integers(1, 3))  # few distinct tokens: drafts are often accepted
    candidates = draw(_ints((bs, num_verify), 0, small_vocab, torch.int64))
    target = draw(_ints((bs, num_verify), 0, small_vocab, torch.int64))
    return (torch.zeros(bs * num_verify, dtype=torch.int32), torch.full((bs, steps + 1), -1, dtype=torch.int32),
            torch.full((bs,), -9, dtype=torch.int32), candidates, retrieve, target, topk)


STRATEGIES: dict[str, st.SearchStrategy[tuple]] = {
    "fill_bonus_tokens_func": fill_bonus_args(),
    "fill_accept_out_cache_loc_func": fill_accept_args(),
    "assign_req_to_token_pool_func": assign_req_to_token_pool_args(),
    "assign_extend_cache_locs_func": assign_extend_args(),
    "fill_front_out_cache_loc_func": fill_front_args(),
    "assign_draft_cache_locs_contiguous_func": assign_draft_args(),
    "copy_all_layer_kv_cache_func": copy_kv_args(),
    "build_tree_kernel_efficient_func": build_tree_args(),
    "verify_tree_greedy_func": verify_args(),
}

# --------------------------------------------------------------------------------------------
# Tests.


def test_every_stand_in_is_checked_against_a_call_site():
    assert {name for name, _ in CALLS.values()} == set(standin.__all__) == set(MUTANTS)
    assert set(STRATEGIES) == set(CALLS)


def test_reference_is_sglangs_triton_kernels_interpreted_without_sgl_kernel(reference):
    hello = reference.hello
    assert hello["not_interpreted"] == [], "these references would not run SGLang's Triton kernels interpreted"
    assert hello["is_cpu"] == [], "SGLang's modules took their CPU branch at import (SGLANG_USE_CPU_ENGINE leaked)"
    assert hello["sgl_kernel_imported"] is False


def _interpreted_property(reference: ReferenceProcess, call: str, count_case: Callable[[], None],
                          max_examples: int | None = None) -> None:
    """The stand-in against the interpreted Triton kernel on inputs Hypothesis draws now (the profile's count)."""

    @settings(settings.default, max_examples=max_examples or settings.default.max_examples)
    @given(args=STRATEGIES[call])
    def prop(args):
        count_case()
        check(reference, call, args)

    prop()


def _interpreted_control(reference: ReferenceProcess, call: str) -> None:
    """The mutant against the interpreted Triton kernel: Hypothesis must find a mismatch."""

    @settings(settings.default, max_examples=50, derandomize=True, database=None, report_multiple_bugs=False,
              phases=(Phase.generate,))  # detection is the point here: skip shrinking
    @given(args=STRATEGIES[call])
    def prop(args):
        check(reference, call, args, impl="mutant")

    with pytest.raises(KernelMismatch):
        prop()


def _recorded_cases(recording: dict[str, Any], call: str) -> list[dict[str, Any]]:
    cases = [case for case in recording["cases"] if case["call"] == call]
    assert len(cases) == recording["examples"], f"the recording holds {len(cases)} cases of {call}"
    return cases


def _nightly_only(request: pytest.FixtureRequest) -> None:
    if not recorded.is_nightly(request.config.getoption("markexpr") or ""):
        pytest.skip("interpreted Triton kernels on fresh inputs: nightly only (KVALIGN_NIGHTLY=1, "
                    "HYPOTHESIS_PROFILE=nightly or -m nightly); CI holds the stand-ins to the recorded outputs")


def _stand_in_against(reference: ReferenceProcess, recording: dict[str, Any] | None, call: str,
                      count_case: Callable[[], None], max_examples: int | None = None) -> None:
    """Every recorded case of ``call``, or (``recording`` None: stale) the interpreted comparison."""
    if recording is None:
        _interpreted_property(reference, call, count_case, max_examples)
        return
    for case in _recorded_cases(recording, call):
        count_case()
        check_recorded(reference, call, case)


@pytest.mark.parametrize("call", CALLS)
def test_stand_in_equals_recorded_triton_outputs(reference, recording, count_case, call):
    """Every recorded case: the stand-in through SGLang's CPU call site gives the Triton kernel's
    recorded outputs. With a stale recording, the interpreted comparison runs instead."""
    _needs(reference, call)
    _stand_in_against(reference, recording, call, count_case)


@pytest.mark.parametrize("call", CALLS)
def test_negative_control_off_by_one_stand_in_is_caught_by_the_recording(reference, recording, call):
    """The mutant through the same call site must differ from the recorded outputs on some case.
    With a stale recording, the interpreted control runs instead."""
    _needs(reference, call)
    if recording is None:
        _interpreted_control(reference, call)
        return
    with pytest.raises(KernelMismatch):
        for case in _recorded_cases(recording, call):
            check_recorded(reference, call, case, impl="mutant")


def test_a_stale_recording_is_said_and_the_interpreted_kernels_run(reference, count_case):
    """A recording whose key is not the installed one never stands in for the kernels: it is
    warned, naming what changed and the script, and the comparison interprets the Triton kernels.
    And the committed recording must be current (as the allocator's): else this fails, naming the
    script, while the comparisons above fall back to the interpreted kernels."""
    release, key = reference.hello["release"], reference.key()
    doc = recorded.load("kernels", release)
    why = recorded.stale_reason(doc, key, f" for sglang {release}'s stand-in kernels")
    assert why is None, why
    assert usable_recording(reference, doc) is doc
    for part, value in (("triton", "0.0"), ("kernel_source_sha256", "0" * 64), ("strategies_sha256", "0" * 64)):
        with pytest.warns(recorded.StaleReference, match=rf"stale \({part} '{value}' -> '[^']*'\): run "
                                                         r"scripts/record_references.py; running the interpreted"):
            assert usable_recording(reference, {**doc, "key": {**key, part: value}}) is None
    with pytest.warns(recorded.StaleReference, match=r"^no recording for sglang .*: run scripts/record_references.py"):
        assert usable_recording(reference, None) is None
    call, before = "fill_bonus_tokens_func", reference.triton_runs
    _stand_in_against(reference, doc, call, count_case)
    assert reference.triton_runs == before, "replaying the recording launched a Triton kernel"
    _stand_in_against(reference, None, call, count_case, max_examples=5)
    assert reference.triton_runs > before, "a stale recording did not run the interpreted Triton kernels"


@pytest.mark.nightly
@pytest.mark.parametrize("call", CALLS)
def test_stand_in_equals_sglang_triton_kernel(request, reference, count_case, call):
    _nightly_only(request)
    _needs(reference, call)
    _interpreted_property(reference, call, count_case)


@pytest.mark.nightly
@pytest.mark.parametrize("call", CALLS)
def test_negative_control_off_by_one_stand_in_is_caught(request, reference, call):
    _nightly_only(request)
    _needs(reference, call)
    _interpreted_control(reference, call)


@pytest.mark.nightly
def test_recorded_outputs_are_the_interpreted_kernels_outputs(request, reference):
    """The recording is still the real thing: its key is the installed one and the interpreted
    Triton kernels give the recorded outputs on every recorded input."""
    _nightly_only(request)
    release = reference.hello["release"]
    doc = recorded.load("kernels", release)
    assert doc is not None, f"no recording for sglang {release}: run scripts/record_references.py"
    assert doc["key"] == reference.key(), "the key changed: run scripts/record_references.py"
    assert {case["call"] for case in doc["cases"]} == set(reference.hello["calls"])
    for case in doc["cases"]:
        got = _tensors(reference.run(case["call"], "triton", tuple(recorded.decode(case["args"]))))
        _compare(case["call"], "SGLang's Triton kernel now", recorded.decode(case["triton"]), got, "the recording")


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
