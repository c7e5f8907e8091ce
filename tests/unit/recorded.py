"""Recorded references: the real packages' outputs on derandomized inputs, for the fast tier.

CI draws the same Hypothesis inputs on every run (derandomized), so re-running an expensive
reference on them (SGLang's Triton kernels under Triton's interpreter) only recomputes what is
already known. A recording holds the inputs and the real reference's outputs, and a *key*: the
release, the Triton version and a SHA-256 of the kernel sources the outputs came from. The fast
tier holds kvalign's stand-ins to the recorded outputs while the key still matches what is
installed; when it does not, it says which part changed and runs the real reference instead. The
slow tier records afresh from the real packages and requires the committed recording to match.

The stand-in kernels' recordings are the exception to "the slow tier re-records": CI runs the whole
suite, slow tier included, and interpreting SGLang's Triton kernels there cost minutes for inputs CI
draws identically every time. So their real comparison runs in the nightly (``is_nightly``) and
whenever the key is stale; the rest of the time the stand-ins are held to the recording.

Recordings are written only by ``scripts/record_references.py``; nothing here is hand-written.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

DIR = Path(__file__).resolve().parent / "references"

#: The release files the allocator references depend on: the Triton kernels (the reference) and the
#: module holding ``alloc_extend_naive`` (the extend stand-in runs the release's own function).
ALLOCATOR_SOURCES = ("sglang/kernels/ops/memory/allocator.py", "sglang/srt/mem_cache/allocator/paged.py")


class StaleReference(UserWarning):
    """A recording whose key no longer matches the installed packages."""


def source_hash(root: Path, files: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def allocator_key(release: str, root: Path) -> dict[str, str]:
    """(release, Triton version, kernel-source hash) of the allocator references of ``root``'s SGLang."""
    return {"release": release, "triton": metadata.version("triton"),
            "kernel_source_sha256": source_hash(root, ALLOCATOR_SOURCES)}


def dumps(doc: dict[str, Any]) -> str:
    """A recording as JSON, one case per line (readable diffs when a key changes)."""
    cases = doc.get("cases")
    if cases is None:
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"
    head = {k: v for k, v in doc.items() if k != "cases"}
    lines = ",\n".join(json.dumps(c, sort_keys=True) for c in cases)
    return json.dumps(head, sort_keys=True)[:-1] + ', "cases": [\n' + lines + "\n]}\n"


#: Kinds whose recordings are gzipped (``zcat`` shows them, one case per line): the stand-in kernels'
#: inputs and outputs are 1-2 MB of JSON per release, and compress about fifteenfold.
COMPRESSED = frozenset({"kernels"})


def path_for(kind: str, release: str) -> Path:
    return DIR / f"{kind}-{release}.json{'.gz' if kind in COMPRESSED else ''}"


def load(kind: str, release: str) -> dict[str, Any] | None:
    path = path_for(kind, release)
    if not path.exists():
        return None
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


def write(path: Path, doc: dict[str, Any]) -> None:
    """Write a recording as :func:`dumps` does; gzipped with no timestamp when ``path`` ends in .gz,
    so that recording the same outputs again gives the same bytes."""
    text = dumps(doc).encode()
    path.write_bytes(gzip.compress(text, 9, mtime=0) if path.suffix == ".gz" else text)


def stale_reason(recorded: dict[str, Any] | None, current: dict[str, str], where: str = "") -> str | None:
    """Why a recording cannot stand for the installed packages (None: it can)."""
    if recorded is None:
        return f"no recording{where}: run scripts/record_references.py"
    changed = [f"{k} {recorded['key'].get(k)!r} -> {v!r}" for k, v in current.items() if recorded["key"].get(k) != v]
    if changed:
        return f"recording{where} is stale ({'; '.join(changed)}): run scripts/record_references.py"
    return None


def is_nightly(markexpr: str = "") -> bool:
    """The nightly tier, as the repository spells it: ``KVALIGN_NIGHTLY=1``, the ``nightly``
    Hypothesis profile, or ``-m nightly`` (``markexpr``, pytest's ``-m`` expression)."""
    return bool(os.environ.get("KVALIGN_NIGHTLY")) or os.environ.get("HYPOTHESIS_PROFILE") == "nightly" \
        or "nightly" in markexpr


def kernels_key(release: str, root: Path, files: list[str], strategies_sha256: str) -> dict[str, str]:
    """(release, Triton version, kernel-source hash) of the stand-in kernel references of ``root``'s
    SGLang, and the hash of the test's input strategies.

    ``files`` are the call sites' modules and the files of the Triton kernels (and the jit helpers
    they call) as the reference process found them. The strategies' hash is part of the key because
    the recording holds the inputs: a changed strategy is drawn only once the recording is redone.
    """
    return {"release": release, "triton": metadata.version("triton"),
            "kernel_source_sha256": source_hash(root, tuple(files)), "strategies_sha256": strategies_sha256}


def encode(value: Any) -> Any:
    """Tensors (nested in lists and tuples) as JSON: dtype, shape and the values, exactly (every
    dtype the kernels take, bfloat16 and float16 included, is exact as a JSON number)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "values": value.flatten().tolist()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """:func:`encode`'s inverse (tuples come back as lists; tensors contiguous)."""
    import torch

    if isinstance(value, dict):
        return torch.tensor(value["values"], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def load_function(path: Path, name: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Compile one top-level function from a release's source file, with only ``namespace`` as its
    globals (so the rest of that module, and SGLang's import chain, is never imported)."""
    tree = ast.parse(path.read_text(), str(path))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"{path} defines no top-level {name}()")
    node.decorator_list = []
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    scope = dict(namespace)
    exec(code, scope)  # noqa: S102 - the release's own function, from its own file
    return scope[name]


#: The sources the card table depends on: dynamo.sglang's registration code and its config
#: defaults, and SGLang's speculative-algorithm definitions (which algorithms exist, is_eagle()).
CARD_SOURCES = (("dynamo", "dynamo/sglang/register.py"), ("dynamo", "dynamo/sglang/args.py"),
                ("sglang", "sglang/srt/speculative/spec_info.py"))


def _package_root(package: str, rel: str) -> Path:
    """The site directory holding ``rel`` of ``package`` (found without importing the package)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location).parent
        if (root / rel).exists():
            return root
    raise LookupError(f"{rel} is not installed")


def card_key() -> dict[str, str]:
    """(Dynamo release, SGLang release, Triton version, registration-source hash) of the installed pair."""
    digest = hashlib.sha256()
    for package, rel in CARD_SOURCES:
        digest.update(rel.encode() + b"\0" + (_package_root(package, rel) / rel).read_bytes() + b"\0")
    return {"dynamo": metadata.version("ai-dynamo"), "sglang": metadata.version("sglang"),
            "triton": metadata.version("triton"), "registration_source_sha256": digest.hexdigest()}


def card_table(registration: Any) -> dict[str, dict[str, bool | None]]:
    """algorithm -> the card's ``enable_eagle`` and whether SGLang keys by bigrams, from the real code."""
    from kvalign.oracles.registration import sglang_keys_bigrams, speculative_algorithms

    return {str(alg): {"enable_eagle": registration.derive(alg), "sglang_keys_bigrams": sglang_keys_bigrams(alg)}
            for alg in speculative_algorithms()}
