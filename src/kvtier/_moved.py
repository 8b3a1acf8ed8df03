"""Old import paths of modules that moved, kept working.

kvtier 0.1's layout grouped ``kvtier.fsm``, ``kvtier.transfer`` and ``kvtier`` by the spec's
chapters and by job (``docs/migration.md`` lists every move). An engine that imports a module
by its old dotted path (``import kvtier.fsm.core``, ``from kvtier.transfer.backend import
make_backend``) gets the module at its new path: the *same* module object, so a monkeypatch
through either name is seen through both. ``kvtier/__init__.py`` installs :data:`FINDER` on
``sys.meta_path``; ``import kvtier.fsm.core`` always imports ``kvtier`` first, so the finder is in
place before any old path is asked for.

An old path is resolved lazily (nothing is imported until it is asked for) and warns nothing:
new code should use the new paths, which ``docs/migration.md`` gives.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from types import CodeType, ModuleType

#: old dotted module path -> new dotted module path. Filled by the moves themselves.
MOVED: dict[str, str] = {
    # fsm: kvtier.fsm grouped by the spec's chapters (lifecycle/, node/, request/, l3/); the old
    # modules kvtier.fsm.node, kvtier.fsm.request and kvtier.fsm.l3 are now packages that
    # re-export what those modules exported
    "kvtier.fsm.admission": "kvtier.fsm.request.admission",
    "kvtier.fsm.batch": "kvtier.fsm.request.batch",
    "kvtier.fsm.completions": "kvtier.fsm.request.completions",
    "kvtier.fsm.core": "kvtier.fsm.node.core",
    "kvtier.fsm.counters": "kvtier.fsm.request.counters",
    "kvtier.fsm.eviction": "kvtier.fsm.node.eviction",
    "kvtier.fsm.fence": "kvtier.fsm.request.fence",
    "kvtier.fsm.fetch": "kvtier.fsm.node.fetch",
    "kvtier.fsm.forward": "kvtier.fsm.request.forward",
    "kvtier.fsm.guards": "kvtier.fsm.lifecycle.guards",
    "kvtier.fsm.invariants": "kvtier.fsm.node.invariants",
    "kvtier.fsm.l3checks": "kvtier.fsm.l3.checks",
    "kvtier.fsm.l3options": "kvtier.fsm.l3.options",
    "kvtier.fsm.ledger": "kvtier.fsm.node.ledger",
    "kvtier.fsm.machines": "kvtier.fsm.lifecycle.machines",
    "kvtier.fsm.match": "kvtier.fsm.node.match",
    "kvtier.fsm.names": "kvtier.fsm.lifecycle.names",
    "kvtier.fsm.ops": "kvtier.fsm.node.ops",
    "kvtier.fsm.optable": "kvtier.fsm.node.optable",
    "kvtier.fsm.pages": "kvtier.fsm.node.pages",
    "kvtier.fsm.publish": "kvtier.fsm.node.publish",
    "kvtier.fsm.receipts": "kvtier.fsm.node.receipts",
    "kvtier.fsm.reclaim": "kvtier.fsm.node.reclaim",
    "kvtier.fsm.request_ends": "kvtier.fsm.request.ends",
    "kvtier.fsm.request_table": "kvtier.fsm.request.table",
    "kvtier.fsm.results": "kvtier.fsm.node.results",
    "kvtier.fsm.spec": "kvtier.fsm.lifecycle.spec",
    "kvtier.fsm.transfers": "kvtier.fsm.node.transfers",
    "kvtier.fsm.tree": "kvtier.fsm.node.tree",
    "kvtier.fsm.writeback": "kvtier.fsm.node.writeback",
    # transfer: the backends and their registry in kvtier.transfer.backends
    "kvtier.transfer.backend": "kvtier.transfer.backends",
    "kvtier.transfer.backend_cpu": "kvtier.transfer.backends.cpu",
    "kvtier.transfer.backend_hybrid": "kvtier.transfer.backends.hybrid",
    "kvtier.transfer.backend_numba": "kvtier.transfer.backends.numba_sm",
    "kvtier.transfer.backend_torch": "kvtier.transfer.backends.torch_copy",
    "kvtier.transfer.copy_engine": "kvtier.transfer.backends.copy_engine",
    "kvtier.transfer.cuda_streams": "kvtier.transfer.backends.cuda_streams",
    "kvtier.transfer.fake_async": "kvtier.transfer.backends.fake_async",
    "kvtier.transfer.hybrid": "kvtier.transfer.backends.hybrid_choice",
    "kvtier.transfer.kernels": "kvtier.transfer.backends.kernels",
    # facade: src/kvtier grouped by job (cli/, replay/, model/, scheduler/); a module merged
    # into another maps to the module that now holds its names
    "kvtier.argtypes": "kvtier.cli.argtypes",
    "kvtier.check": "kvtier.cli.check",
    "kvtier.costmodel": "kvtier.replay.costmodel",
    "kvtier.diagram": "kvtier.cli.diagram",
    "kvtier.exitcodes": "kvtier.cli.exitcodes",
    "kvtier.facade_views": "kvtier.tiered",
    "kvtier.fingerprint": "kvtier.replay.fingerprint",
    "kvtier.l3replay": "kvtier.replay.l3replay",
    "kvtier.logreader": "kvtier.cli.logreader",
    "kvtier.model_replay": "kvtier.replay.model_replay",
    "kvtier.multi_cli": "kvtier.replay.command",
    "kvtier.plot": "kvtier.replay.plot",
    "kvtier.replay_cli": "kvtier.replay.command",
    "kvtier.router": "kvtier.replay.router",
    "kvtier.tinymodel": "kvtier.model.tiny",
    "kvtier.trace": "kvtier.replay.trace",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module already at its new path."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._original: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self._original = module.__spec__
        return module

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, so ``python -m <old path>`` runs it (runpy asks for it)."""
        spec = importlib.util.find_spec(self.new)
        loader = None if spec is None else spec.loader
        get_code = getattr(loader, "get_code", None)
        return None if get_code is None else get_code(self.new)

    def exec_module(self, module: ModuleType) -> None:
        # the import system wrote the alias's spec and loader onto the real module: put its
        # own back, so that reloading, pickling and pytest see the module where it lives
        module.__spec__ = self._original
        if self._original is not None:
            module.__loader__ = self._original.loader


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that answers only the old paths in its table."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = moved

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = self.moved.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


FINDER = MovedModuleFinder(MOVED)


def install() -> None:
    """Put :data:`FINDER` on ``sys.meta_path`` once (idempotent)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.append(FINDER)
