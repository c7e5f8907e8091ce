"""Recorded references: the real packages' outputs on derandomized inputs, for the fast tier.

CI draws the same Hypothesis inputs on every run (derandomized), so re-running an expensive
reference on them (SGLang's Triton kernels under Triton's interpreter) only recomputes what is
already known. A recording holds the inputs and the real reference's outputs, and a *key*: the
release, the Triton version and a SHA-256 of the kernel sources the outputs came from. The fast
tier holds kvalign's stand-ins to the recorded outputs while the key still matches what is
installed; when it does not, it says which part changed and runs the real reference instead. The
slow tier records afresh from the real packages and requires the committed recording to match.

Recordings are written only by ``scripts/record_references.py``; nothing here is hand-written.
"""

from __future__ import annotations

import ast
import hashlib
import json
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


def path_for(kind: str, release: str) -> Path:
    return DIR / f"{kind}-{release}.json"


def load(kind: str, release: str) -> dict[str, Any] | None:
    path = path_for(kind, release)
    return json.loads(path.read_text()) if path.exists() else None


def stale_reason(recorded: dict[str, Any] | None, current: dict[str, str], where: str = "") -> str | None:
    """Why a recording cannot stand for the installed packages (None: it can)."""
    if recorded is None:
        return f"no recording{where}: run scripts/record_references.py"
    changed = [f"{k} {recorded['key'].get(k)!r} -> {v!r}" for k, v in current.items() if recorded["key"].get(k) != v]
    if changed:
        return f"recording{where} is stale ({'; '.join(changed)}): run scripts/record_references.py"
    return None


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
