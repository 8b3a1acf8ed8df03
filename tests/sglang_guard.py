"""Load SGLang's cache modules on a CPU machine for the sglang-marked tests, or skip
(the loading itself is :func:`kvtier.testing.sglang_cpu.load_sglang`).

SGLang 0.5.23 installs with ``pip install --no-deps sglang==0.5.23`` (docs/sglang.md);
its mem_cache and scheduler modules then import cleanly once two things are arranged:

- ``sglang/__init__.py`` is not run (it patches Hugging Face ``transformers`` and imports
  the front-end language API; none of the cache code uses either): the package is
  registered with its real path, so every submodule loads from the wheel;
- third-party packages its import chains name but the cache code never calls, when not
  installed, are served by placeholder modules (:data:`PLACEHOLDERS`; every attribute is an
  inert class). :data:`TOUCHED` lists the attributes read.

Without SGLang the module skips, unless ``KVTIER_REQUIRE_SGLANG=1`` (CI's SGLang step),
where a missing SGLang fails the run. With vLLM installed too it skips unless
``KVTIER_REQUIRE_SGLANG=1``: the placeholders would change what vLLM's modules import in
the same process, so the sglang-marked tests run in a pytest process of their own.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvtier.testing.sglang_cpu import PLACEHOLDERS, TOUCHED, load_sglang

__all__ = ["PLACEHOLDERS", "TOUCHED", "require_sglang"]


def require_sglang() -> None:
    """Skip the calling module without SGLang (fail under ``KVTIER_REQUIRE_SGLANG=1``);
    otherwise make SGLang's cache modules importable (see the module docstring)."""
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
            raise RuntimeError("KVTIER_REQUIRE_SGLANG=1 but sglang is not installed")
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23 and its small CPU "
                    "packages; docs/sglang.md)", allow_module_level=True)
    if importlib.util.find_spec("vllm") is not None and os.environ.get("KVTIER_REQUIRE_SGLANG") != "1":
        # the placeholders would change what vLLM's modules import in this process
        pytest.skip("vLLM is installed too: run the sglang tests in a process of their own "
                    "(KVTIER_REQUIRE_SGLANG=1 python -m pytest -m sglang tests/adapters)", allow_module_level=True)
    load_sglang()
