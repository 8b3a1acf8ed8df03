"""Stand-in modules that let vLLM's cache-manager import chain load on a CPU-only
install (``kvtier[vllm]``: the vLLM wheel with ``--no-deps`` and a few small packages).

``vllm.v1.core.kv_cache_manager`` and ``vllm.v1.request`` import ``vllm.config``, whose
chain names serving-stack packages (``zmq``, ``transformers``, ``openai``, ...) that the
cache manager never calls. :func:`install` registers, for each such package that is *not*
installed, an empty module whose attributes are inert placeholder classes; installed
packages are never shadowed, so with a full vLLM install it does nothing. Every
placeholder attribute read is recorded in :data:`READS` (the tests assert the cache code
paths read none at call time).

Only the kit (:mod:`kvtier.adapters.vllm_config`, :mod:`kvtier.adapters.vllm_engine`,
:mod:`kvtier.adapters.vllm_kit`), the tests and ``bench/`` use it; the adapter
(:mod:`kvtier.adapters.vllm` and the modules it imports) imports nothing that needs it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["PACKAGES", "READS", "install", "installed"]

#: third-party packages named by the import chain of vllm.v1.core / vllm.v1.request (0.33)
PACKAGES: tuple[str, ...] = (
    "zmq", "transformers", "huggingface_hub", "safetensors", "aiohttp", "requests", "openai_harmony",
    "openai", "PIL", "cloudpickle", "uvloop", "cpuinfo", "prometheus_client", "xgrammar", "fastapi",
    "partial_json_parser", "llguidance", "tokenizers", "sentencepiece", "gguf", "blake3",
)
#: placeholder attributes read so far: "module.attr"
READS: set[str] = set()
_STUBBED: list[str] = []


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        READS.add(f"{cls.__module__}.{cls.__qualname__}.{name}")
        return _placeholder(f"{cls.__qualname__}.{name}", cls.__module__)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return super().__call__()

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema  # type: ignore[import-not-found, unused-ignore]

        return core_schema.any_schema()


def _placeholder(name: str, module: str) -> type:
    return _Meta(name.rsplit(".", 1)[-1], (_Placeholder,), {"__module__": module, "__qualname__": name})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        READS.add(f"{self.__name__}.{name}")
        value = _placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = set(roots)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(packages: Sequence[str] = PACKAGES) -> list[str]:
    """Stub every package of ``packages`` that is not installed; returns the stubbed
    ones. Idempotent."""
    missing = [p for p in packages if p not in _STUBBED and p not in sys.modules
               and importlib.util.find_spec(p) is None]
    if missing:
        sys.meta_path.append(_Finder(missing))
        _STUBBED.extend(missing)
    return list(_STUBBED)


def installed() -> list[str]:
    """The packages stubbed so far."""
    return list(_STUBBED)
