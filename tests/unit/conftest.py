"""Real systems for the unit layer: Dynamo's router binding and SGLang's radix cache on CPU.

Nothing here is mocked. Where a real system is missing the tests that need it skip, saying what
to install — they never pass without having run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import xdist_scopes

from kvalign.oracles.base import OracleUnavailable, RouterHasher
from router_paths import open_router_path

#: a vLLM child started outside the vLLM scope fails its test (see the hook's docstring)
sys.addaudithook(xdist_scopes.refuse_vllm_child_outside_scope)
#: a fast test that imports SGLang from a file outside xdist_scopes.SGLANG_FILES fails at its teardown
sys.addaudithook(xdist_scopes.note_sglang_import_outside_scope)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    xdist_scopes.refuse_unlisted_sglang_import(item.nodeid, slow=item.get_closest_marker("slow") is not None)


@pytest.fixture(scope="session")
def router_hasher() -> RouterHasher:
    """``dynamo._core.compute_block_hash_for_seq`` from the installed ai-dynamo-runtime."""
    from kvalign.oracles.dynamo import load_router_hasher

    try:
        return load_router_hasher()
    except OracleUnavailable as exc:
        pytest.skip(f"real Dynamo router unavailable: {exc}")


@pytest.fixture(scope="session")
def dynamo_tree() -> Callable[[], object]:
    """Factory for Dynamo's real ``RadixTree``."""
    from kvalign.oracles.dynamo import DynamoRadixTree

    try:
        DynamoRadixTree()
    except OracleUnavailable as exc:
        pytest.skip(f"real Dynamo RadixTree unavailable: {exc}")
    return DynamoRadixTree


@pytest.fixture(scope="session")
def sglang_available() -> str:
    """The installed sglang version, after importing its cache classes once."""
    from kvalign.oracles.sglang import SglangRadixCache, sglang_version

    try:
        SglangRadixCache(1, eagle=False)
    except OracleUnavailable as exc:
        pytest.skip(f"real SGLang radix cache unavailable: {exc}")
    return sglang_version()


@pytest.fixture(scope="session")
def cache_factory(sglang_available: str) -> Callable[[str], Callable[[int, bool], object]]:
    """``cache_factory(kind)`` -> ``make(page_size, eagle)`` building a fresh real SGLang cache."""
    from kvalign.oracles.sglang import SglangRadixCache

    return lambda kind: lambda page_size, eagle: SglangRadixCache(page_size, eagle=eagle, kind=kind)


@pytest.fixture(scope="session")
def mm_oracles(router_hasher: RouterHasher, sglang_available: str):
    """Dynamo's real frontend (with the recording worker) and SGLang's real multimodal path, for the
    tiny Qwen2-VL; both started once per session (20-40 s on two cores)."""
    from kvalign.oracles.frontend_mm import FrontendPreprocessor
    from kvalign.oracles.sglang_mm import SglangMultimodal
    from kvalign.verify.props.mm.strategies import MM_PAGE_SIZES

    try:
        frontend = FrontendPreprocessor(MM_PAGE_SIZES)
    except OracleUnavailable as exc:
        pytest.skip(f"Dynamo's frontend cannot preprocess image requests here: {exc}")
    try:
        sglang = SglangMultimodal(frontend.model_dir)
    except OracleUnavailable as exc:
        frontend.close()
        pytest.skip(f"SGLang's multimodal path cannot run here: {exc}")
    yield frontend, sglang
    sglang.close()
    frontend.close()


@pytest.fixture(scope="session")
def installed_cell(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The installed pair's ``kvalign matrix --cell --json`` run (:mod:`installed_cell`), once per session: the
    merge test and the local-build test read the same row (both files in one xdist scope)."""
    from installed_cell import run_cell

    from kvalign.releases.versions import installed_versions

    v = installed_versions()
    return run_cell(v["ai-dynamo-runtime"], v["sglang"], tmp_path_factory.mktemp("installed-cell"))


@pytest.fixture(scope="module")
def hicache_router_path(sglang_available: str) -> Iterator[Any]:
    """The real relay -> router path, for a SGLang whose host tier kvalign's HiCache stand-in covers (else skip)."""
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    path = open_router_path("real Dynamo router path unavailable")
    yield path
    path.close()


@pytest.fixture
def official_vllm_wheels(request: pytest.FixtureRequest) -> None:
    """Tests that install official vLLM wheels (hundreds of MB each) run in the nightly only, as the SGLang
    release matrix does: ``KVALIGN_NIGHTLY=1``, ``-m nightly`` or ``-m matrix``."""
    from recorded import is_nightly

    expr = request.config.getoption("markexpr") or ""
    if not (is_nightly(expr) or "matrix" in expr):
        pytest.skip("official vLLM wheels (hundreds of MB each): nightly only (KVALIGN_NIGHTLY=1, -m nightly or "
                    "-m matrix)")


@pytest.fixture(scope="module")
def cli_parser() -> Iterator[Any]:
    """kvalign's argument parser, built once for the module, and ``kvalign.cli.main`` parsing with it.

    ``main`` builds the whole parser (every subcommand, about 260 arguments) on each call: 12 ms of
    argparse. A module that runs the CLI in-process hundreds of times (a Hypothesis test running
    ``replay`` and ``diagnose`` per example) spent seconds of CPU on rebuilding the same parser. Parsing
    leaves the parser as it was, so one serves the module; it is built after the module's imports, with
    the registry and environment its tests see (a module that changes either must not use this)."""
    from kvalign import cli

    parser = cli.build_parser()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "build_parser", lambda: parser)
        yield parser
