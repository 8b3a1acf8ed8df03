"""Load SGLang's cache modules on a CPU machine for the sglang-marked tests, or skip.

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

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

import pytest

#: third-party packages SGLang's cache import chains name without calling them in the tests
PLACEHOLDERS = ("triton", "transformers", "zmq", "requests", "PIL", "starlette", "torchvision", "IPython",
                "tvm_ffi", "huggingface_hub", "sentencepiece", "safetensors", "compressed_tensors", "gguf",
                "aiohttp", "openai", "partial_json_parser", "fastapi", "uvicorn", "uvloop", "setproctitle",
                "outlines", "xgrammar", "llguidance", "cuda", "sgl_kernel", "flashinfer", "einops",
                "interegular", "blobfile", "tiktoken", "pynvml", "datasets",
                "modelscope", "decord", "soundfile", "av", "timm", "msgpack", "cloudpickle", "lark",
                "jsonschema")
TOUCHED: dict[str, list[str]] = {}


class _Meta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> Any:
        return super().__new__(mcls, name, bases, ns)

    def __init__(cls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> None:
        super().__init__(name, bases, ns)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}", cls.__module__)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __setitem__(cls, key: Any, value: Any) -> None:
        pass

    def __contains__(cls, item: Any) -> bool:
        return False

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a decorator (@triton.jit)
        return super().__call__()

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False


class _Base(metaclass=_Meta):
    def __init_subclass__(cls, **kw: Any) -> None:
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(name, type(self).__module__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getitem__(self, item: Any) -> Any:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _placeholder(qualname: str, module: str) -> type:
    cls = _Meta(qualname.rsplit(".", 1)[-1], (_Base,), {"__module__": module})
    cls.__qualname__ = qualname
    return cls


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        TOUCHED.setdefault(self.__name__.split(".")[0], []).append(f"{self.__name__}.{name}")
        value = _placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.roots and fullname not in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = _Module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_LOADED = False


def require_sglang() -> None:
    """Skip the calling module without SGLang (fail under ``KVTIER_REQUIRE_SGLANG=1``);
    otherwise make SGLang's cache modules importable (see the module docstring)."""
    global _LOADED
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
            raise RuntimeError("KVTIER_REQUIRE_SGLANG=1 but sglang is not installed")
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23 and its small CPU "
                    "packages; docs/sglang.md)", allow_module_level=True)
    if importlib.util.find_spec("vllm") is not None and os.environ.get("KVTIER_REQUIRE_SGLANG") != "1":
        # the placeholders would change what vLLM's modules import in this process
        pytest.skip("vLLM is installed too: run the sglang tests in a process of their own "
                    "(KVTIER_REQUIRE_SGLANG=1 python -m pytest -m sglang tests/adapters)", allow_module_level=True)
    if _LOADED:
        return
    import torch
    from torch.utils import _triton

    # torch caches whether Triton exists: ask before a placeholder triton is on the path
    _triton.has_triton_package()
    _triton.has_triton()
    import torch._inductor.compile_fx  # noqa: F401  (inductor probes triton once at import)

    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        assert spec is not None and spec.submodule_search_locations is not None
        mod = types.ModuleType("sglang")
        mod.__path__ = list(spec.submodule_search_locations)
        mod.__file__ = spec.origin
        mod.__spec__ = importlib.machinery.ModuleSpec("sglang", None, origin=spec.origin, is_package=True)
        mod.__spec__.submodule_search_locations = mod.__path__
        sys.modules["sglang"] = mod
    roots = {name for name in PLACEHOLDERS if importlib.util.find_spec(name) is None}
    sys.meta_path.append(_Finder(roots))
    importlib.import_module("sglang.srt.mem_cache.radix_cache")
    _LOADED = True
    del torch
