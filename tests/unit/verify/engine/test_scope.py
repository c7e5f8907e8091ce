"""What a verdict speaks for (kvalign.verify.engine.scope.py): never a bare ALIGNED over a surface that did not run."""

from __future__ import annotations

from kvalign.commands import check_text
from kvalign.verify import props
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.engine.scope import Scope

SGLANG = props.of_engine("sglang")
DEFAULT = Scope.of(SGLANG, props.default_names())
ROWS = [RowResult("hash", "plain", "base", 10, 0, 0.1)]


def test_every_opt_in_property_names_the_surface_a_verdict_without_it_leaves_out() -> None:
    """A property ``check`` leaves out by default is about a part of a deployment (images, hybrid layers,
    a storage tier): the verdict must be able to name it."""
    assert all(p.surface for p in props.REGISTRY if not p.default)


def test_the_default_run_is_aligned_for_deployments_without_the_opt_in_surfaces() -> None:
    assert DEFAULT.aligned_for() == "deployments without image prompts, hybrid models or a storage tier"
    assert [n for n, _ in DEFAULT.not_run] == ["mm", "hybrid", "storage"]
    text = check_text.verdict(ROWS, 1.0, scope=DEFAULT).splitlines()
    assert text[0] == "ALIGNED for deployments without image prompts, hybrid models or a storage tier"
    assert text[1].startswith("  10 cases in 1.0s") and text[2] == "  not run: mm, hybrid, storage (--all runs every property)"


def test_a_run_of_everything_is_a_plain_verdict_and_leaving_out_a_universal_property_narrows_it() -> None:
    everything = Scope.of(SGLANG, props.names())
    assert everything.complete and everything.not_run_line() is None and everything.aligned_for() == "every property"
    assert check_text.verdict(ROWS, 1.0, scope=everything).splitlines()[0].startswith("ALIGNED: 10 cases")
    only_hash = Scope.of(SGLANG, ["hash"])
    assert only_hash.aligned_for() == "what ran only: hash"  # block keys are every deployment's: no "without"
    assert check_text.verdict(ROWS, 1.0, scope=only_hash).splitlines()[0] == "ALIGNED for what ran only: hash"


def test_a_misaligned_run_still_names_what_did_not_run() -> None:
    rows = [RowResult("hash", "plain", "base", 10, 1, 0.1, "x", "ROUTER_EAGLE_OFF")]
    text = check_text.verdict(rows, 1.0, scope=DEFAULT).splitlines()
    assert text[0].startswith("MISALIGNED: 10 cases") and text[1].startswith("  not run: mm, hybrid, storage")
    assert DEFAULT.as_json()["not_run"][0] == {"property": "mm", "surface": "image prompts"}


def test_check_engine_vllm_is_a_verdict_on_int_hash_workers_and_all_adds_the_bytes_ones():
    """vLLM's bytes block hashes are a setting a user opts into (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): the default
    verdict leaves them out and names them; --all runs them (issue 44)."""
    from kvalign.commands.check import engine_properties

    vllm = props.of_engine("vllm")
    default = Scope.of(vllm, [p.name for p in engine_properties("vllm", False, None)])
    assert default.ran == ("vllm",) and default.not_run == (
        ("vllm_bytes", "vLLM workers with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"),)
    rows = [RowResult("hashes", "plain", "int", 10, 0, 0.1)]
    text = check_text.verdict(rows, 1.0, scope=default).splitlines()
    assert text[0] == "ALIGNED for deployments without vLLM workers with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"
    assert text[2] == "  not run: vllm_bytes (--all runs every property)"
    everything = Scope.of(vllm, [p.name for p in engine_properties("vllm", True, None)])
    assert everything.complete and everything.ran == ("vllm", "vllm_bytes")
    # negative control: the SGLang engine's default run never picks a vLLM property, nor --all one
    assert not {p.engine for p in engine_properties("sglang", False, None)} - {"sglang"}
    assert not {p.engine for p in engine_properties("sglang", True, None)} - {"sglang"}
