"""Old module paths keep importing after the layout by the spec's chapters
(``kvtier._moved``): the same module object, lazily, and runnable with ``python -m``."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kvtier
from kvtier import _moved

OPTIONAL = {"kvtier.plot": "matplotlib"}  # old paths whose new module needs an optional extra


def test_the_finder_is_installed_by_import_kvtier() -> None:
    assert _moved.FINDER in sys.meta_path
    _moved.install()
    assert sys.meta_path.count(_moved.FINDER) == 1


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_path_is_the_module_at_its_new_path(old: str, new: str) -> None:
    extra = OPTIONAL.get(old)
    if extra is not None:
        pytest.importorskip(extra)
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__ is not None and module.__spec__.name == new


def test_a_monkeypatch_through_the_old_path_is_seen_through_the_new(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_moved.MOVED, "kvtier.old_tiered_for_test", "kvtier.tiered")
    old = importlib.import_module("kvtier.old_tiered_for_test")
    monkeypatch.setattr(old, "MARK_FOR_TEST", 7, raising=False)
    assert importlib.import_module("kvtier.tiered").MARK_FOR_TEST == 7  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "kvtier.old_tiered_for_test")


def test_a_path_not_in_the_table_is_not_answered() -> None:
    assert _moved.FINDER.find_spec("kvtier.no_such_module_anywhere") is None
    with pytest.raises(ModuleNotFoundError, match="kvtier.no_such_module_anywhere"):
        importlib.import_module("kvtier.no_such_module_anywhere")


def test_python_dash_m_runs_the_module_at_its_new_path() -> None:
    code = ("import runpy, sys, kvtier._moved as m\n"
            "m.MOVED['kvtier.old_exitcodes_for_test'] = 'kvtier.fsm.errors'\n"
            "runpy.run_module('kvtier.old_exitcodes_for_test', run_name='not_main')\n"
            "print('ran')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "ran"
    assert kvtier.__name__ == "kvtier"
