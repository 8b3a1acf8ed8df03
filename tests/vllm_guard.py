"""Skip a vLLM-marked test module cleanly when vLLM is absent, unless
``KVTIER_REQUIRE_VLLM=1`` (CI sets it in the step that installs vLLM), where a missing
vLLM fails the run instead of skipping it."""

import importlib.util
import os

import pytest


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVTIER_REQUIRE_VLLM=1 but vllm is not installed")
    pytest.skip("vllm is not installed (pip install -e '.[vllm]' and pip install --no-deps vllm==0.33.0; docs/vllm.md)",
                allow_module_level=True)
