"""Load SGLang's cache modules on a machine without its GPU dependencies (a CPU box).

SGLang 0.5.23 installs with ``pip install --no-deps sglang==0.5.23`` (docs/sglang.md); its
mem_cache and scheduler modules then import cleanly once two things are arranged:

- ``sglang/__init__.py`` is not run (it patches Hugging Face ``transformers`` and imports the
  front-end language API; none of the cache code uses either): the package is registered with
  its real path, so every submodule loads from the wheel;
- third-party packages its import chains name but the cache code never calls, when not
  installed, are served by placeholder modules (:data:`PLACEHOLDERS`; every attribute is an inert
  class). :data:`TOUCHED` lists the attributes read.

The placeholders change what other engines' modules (vLLM's) import in the same process, so
``kvtier fuzz`` runs the SGLang machine in a process of its own (:func:`run_child`, the
``python -m kvtier.testing.sglang_cpu`` entry point) and the sglang-marked tests run in a
pytest process of their own (``tests/sglang_guard.py`` calls :func:`load_sglang`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from typing import Any

__all__ = ["PLACEHOLDERS", "TOUCHED", "installed", "load_sglang", "loaded", "run_child"]

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
        from pydantic_core import core_schema  # type: ignore[import-not-found,unused-ignore]

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


def installed() -> bool:
    """Whether SGLang is installed here (its package is on the path)."""
    return importlib.util.find_spec("sglang") is not None


def loaded() -> bool:
    """Whether :func:`load_sglang` ran in this process (SGLang's cache modules import)."""
    return _LOADED


def load_sglang() -> None:
    """Make SGLang's cache modules importable in this process (see the module docstring);
    a second call does nothing.

    Raises:
        ImportError: SGLang is not installed, or its cache modules still do not import.
    """
    global _LOADED
    if _LOADED:
        return
    if not installed():
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23 and its small CPU "
                          "packages; docs/sglang.md)")
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


def run_child(argv: list[str] | None = None) -> int:
    """``python -m kvtier.testing.sglang_cpu``: run a campaign of the SGLang machine alone in
    this process (SGLang loaded by :func:`load_sglang`) and write what it did as JSON to
    ``--result``: ``{"available": false, "reason": ...}`` where SGLang does not load, else
    ``steps``, ``examples``, ``checks``, ``seconds``, and for a failure ``saved`` (the sequence
    file), ``invariant``, ``message``, ``steps_run``, ``failed_step``, ``detail``,
    ``first_failure_step`` and ``first_failure_seconds``. Exit status 0 either way."""
    p = argparse.ArgumentParser(prog="python -m kvtier.testing.sglang_cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", type=float, default=0.25)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--save", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--no-shrink", action="store_true")
    ns = p.parse_args(argv)
    out: dict[str, Any]
    try:
        load_sglang()
        from ..adapters import sglang_machine  # noqa: F401  (the machine imports here or not at all)
    except Exception as exc:  # noqa: BLE001 - installed but not loadable: the campaign leaves it out
        out = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    else:
        from .fuzz import campaign

        res = campaign(steps=ns.steps, minutes=ns.minutes, seed_value=ns.seed, faults=ns.faults,
                       world_size=ns.world_size, save=ns.save, mix={"sglang": 1.0}, progress=False,
                       shrink=not ns.no_shrink)
        out = {"available": True, "steps": res.steps, "examples": res.examples, "checks": res.checks,
               "seconds": res.seconds}
        if res.failure is not None and res.failure_result is not None:
            r = res.failure_result
            out.update(saved=str(res.saved), invariant=r.invariant, message=r.message, steps_run=r.steps_run,
                       failed_step=r.failed_step, detail=r.detail, first_failure_step=res.first_failure_step,
                       first_failure_seconds=res.first_failure_seconds)
    with open(ns.result, "w") as f:
        json.dump(out, f)
    return 0


#: set in the child's environment: a campaign there never starts another child
CHILD_ENV = "KVTIER_FUZZ_CHILD"

if __name__ == "__main__":  # pragma: no cover - the child process of kvtier fuzz
    # run the package's copy of this module (not ``__main__``'s), whose load flag the campaign reads
    from .sglang_cpu import run_child as _run

    raise SystemExit(_run())
