"""The project's shape and packaging rules (docs/migration.md, "The layout by the spec's chapters").

- imports: inside a package relative, across packages ``kvtier.``-absolute; nothing
  imports ``fsm``, ``transfer`` or ``spec`` as top-level modules; ``fsm/`` never
  imports torch or numba;
- which package may import which (README.md, "Layout"): ``fsm/`` imports no other kvtier
  package (neither ``transfer`` nor the facade); ``transfer/`` imports only ``fsm``'s
  records and errors; the facade (``src/kvtier/``) imports both;
- nothing can shadow a mapped package (``src/kvtier/fsm*``, a root-level ``kvtier/``);
- ``import kvtier``, ``kvtier.fsm`` and building the command line load neither torch,
  numba nor hypothesis (checked in a fresh interpreter);
- every subpackage on disk is listed in pyproject and every data file is shipped;
- pytest runs with ``--import-mode=importlib`` from ``tests/``;
- the layout by the spec's chapters: no module of fsm/, transfer/ or src/kvtier/ over 500
  lines; no part of ``fsm/node/`` imports the core, and ``fsm/node/`` has no import circle;
  no test file is named after a round of work or a tool (``tests/`` mirrors the code).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]

#: import name -> folder, as mapped by setuptools ``package-dir``.
MAPPED = {"kvtier": "src/kvtier", "kvtier.fsm": "fsm", "kvtier.transfer": "transfer", "kvtier.spec": "spec"}
#: folders whose Python files are scanned (the mapped packages plus tests and benchmarks).
SCANNED = ("fsm", "transfer", "src/kvtier", "tests", "bench")
#: names that exist only as folders of this repository, never as importable top-level modules.
FORBIDDEN_TOP_LEVEL = {"fsm", "transfer", "spec"}
#: modules that ``import kvtier`` / ``kvtier.fsm`` / ``kvtier --help`` must not load.
HEAVY = ("torch", "numba", "hypothesis")
#: the modules of ``fsm/`` that ``transfer/`` may import: the records that cross the
#: boundary (commands, completions, cache groups) and the errors.
FSM_FOR_TRANSFER = ("records", "errors")


def _py_files(folder: str) -> Iterator[Path]:
    for path in sorted((REPO / folder).rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def _owner(module: str) -> str | None:
    """The mapped package (longest prefix of :data:`MAPPED`) that ``module`` belongs to."""
    best = None
    for pkg in MAPPED:
        if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best)):
            best = pkg
    return best


def _dotted(path: Path, repo: Path) -> tuple[str, str] | None:
    """(mapped package owning ``path``, dotted name of the package ``path`` sits in), or
    ``None`` for tests/ and bench/."""
    for pkg, folder in sorted(MAPPED.items(), key=lambda kv: -len(kv[1])):
        root = repo / folder
        if root in path.parents:
            return pkg, ".".join((pkg, *path.parent.relative_to(root).parts))
    return None


def _relative_target(node: ast.ImportFrom, package: str) -> list[str] | None:
    """The modules a relative import names (its base, then base.name for each name), or
    ``None`` when it climbs above the top-level package."""
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    if node.module:
        base = f"{base}.{node.module}"
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (classes, functions, assignments)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


#: what ``from kvtier.fsm import X`` may name in ``transfer/``: the records and errors
#: (read from this repository's fsm/, whatever ``repo`` a scan is given).
FSM_NAMES_FOR_TRANSFER = frozenset(set(FSM_FOR_TRANSFER).union(
    *(_top_level_names(REPO / "fsm" / f"{m}.py") for m in FSM_FOR_TRANSFER)))


def _layer_problem(where: str, node: ast.Import | ast.ImportFrom, target: str) -> str | None:
    """Whether the mapped package ``where`` may import ``target`` (an absolute module)."""
    owner = _owner(target)
    if owner is None or owner == where:
        return None
    if where == "kvtier.fsm":
        return f"fsm/ imports {target} (the core imports no other kvtier package)"
    if where == "kvtier.transfer":
        allowed = owner == "kvtier.fsm" and (
            target in {f"kvtier.fsm.{m}" for m in FSM_FOR_TRANSFER}
            or (target == "kvtier.fsm" and (isinstance(node, ast.Import)
                                           or all(a.name in FSM_NAMES_FOR_TRANSFER for a in node.names))))
        if not allowed:
            return f"transfer/ imports {target} (it may import only kvtier.fsm's records and errors)"
    return None


def _import_problems(path: Path, repo: Path = REPO) -> list[str]:
    rel = path.relative_to(repo)
    where = _dotted(path, repo)
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))):
        line = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            if where is None:
                problems.append(f"{line}: relative import outside a kvtier package")
                continue
            targets = _relative_target(node, where[1])
            if targets is None:
                problems.append(f"{line}: relative import climbs above the kvtier package")
                continue
            crossed = next((t for t in targets if _owner(t) != where[0]), None)
            if crossed is not None:
                problems.append(f"{line}: relative import of {crossed} crosses from {where[0]} "
                                f"into {_owner(crossed)}; use a kvtier.-absolute import")
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            targets = [node.module]
        else:
            continue
        for target in targets:
            top = target.split(".")[0]
            if top in FORBIDDEN_TOP_LEVEL:
                problems.append(f"{line}: imports {target!r} as a top-level module; "
                                f"use kvtier.{target}")
            if where is not None and _owner(target) == where[0]:
                problems.append(f"{line}: absolute import {target!r} inside its own package "
                                f"{where[0]}; use a relative import")
            if where is not None and where[0] == "kvtier.fsm" and top in ("torch", "numba"):
                problems.append(f"{line}: fsm/ imports {top} (the core is pure Python)")
            layer = None if where is None else _layer_problem(where[0], node, target)
            if layer is not None:
                problems.append(f"{line}: {layer}")
    return problems


def test_scanned_folders_hold_the_code() -> None:
    files = {f.relative_to(REPO).parts[0] for folder in SCANNED for f in _py_files(folder)}
    assert {"fsm", "transfer", "src", "tests"} <= files


def test_imports_respect_package_boundaries() -> None:
    problems = [p for folder in SCANNED for f in _py_files(folder) for p in _import_problems(f)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, problem", [
    ("import fsm\n", "'fsm' as a top-level module"),
    ("from transfer import engine\n", "'transfer' as a top-level module"),
    ("from fsm.records import Completion\n", "'fsm.records' as a top-level module"),
    ("import spec.lifecycle\n", "'spec.lifecycle' as a top-level module"),
    ("from ..fsm import records\n", "crosses from kvtier into kvtier.fsm"),
    ("from .. import fsm\n", "crosses from kvtier into kvtier.fsm"),
    ("from .profiles import x\n", None),
    ("from kvtier.fsm import records\n", None),
    ("from ... import x\n", "climbs above"),
    ("from kvtier.cli import main\n", "inside its own package kvtier"),
])
def test_the_import_scan_catches(tmp_path: Path, source: str, problem: str | None) -> None:
    """The scanner itself, on a file in src/kvtier/testing/ (problem None: allowed)."""
    target = tmp_path / "src" / "kvtier" / "testing" / "bad.py"
    target.parent.mkdir(parents=True)
    target.write_text(source)
    problems = _import_problems(target, tmp_path)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize("folder, source, problem", [
    ("fsm", "def f():\n    import torch\n", "fsm/ imports torch (the core is pure Python)"),
    ("fsm", "from numba import cuda\n", "fsm/ imports numba (the core is pure Python)"),
    ("transfer", "from ..fsm import ConfigError\n", "crosses from kvtier.transfer into kvtier"),
    ("transfer", "from kvtier.transfer.plan import x\n", "inside its own package kvtier.transfer"),
    ("tests", "from .helpers import x\n", "relative import outside a kvtier package"),
    ("bench", "import transfer.engine\n", "'transfer.engine' as a top-level module"),
    ("fsm", "from kvtier.transfer import TransferEngine\n", "fsm/ imports kvtier.transfer (the core imports no"),
    ("fsm", "def f():\n    import kvtier.transfer.plan\n", "fsm/ imports kvtier.transfer.plan"),
    ("fsm", "from kvtier.tiered import TieredCache\n", "fsm/ imports kvtier.tiered"),
    ("fsm", "from kvtier import tiered\n", "fsm/ imports kvtier (the core"),
    ("transfer", "from kvtier.fsm.cache import TieredPrefixCache\n", "transfer/ imports kvtier.fsm.cache"),
    ("transfer", "from kvtier.fsm import cache\n", "may import only kvtier.fsm's records and errors"),
    ("transfer", "from kvtier.fsm import Direction, TieredPrefixCache\n", "transfer/ imports kvtier.fsm "),
    ("transfer", "from kvtier.tiered import TieredCache\n", "transfer/ imports kvtier.tiered"),
    ("transfer", "from kvtier.fsm import ConfigError, Direction, records\n", None),
    ("transfer", "from kvtier.fsm.records import TransferCommand\n", None),
    ("transfer", "import kvtier.fsm.errors\n", None),
    ("src/kvtier", "from kvtier.transfer import TransferEngine\nfrom kvtier.fsm.cache import MatchMode\n", None),
])
def test_the_import_scan_catches_elsewhere(tmp_path: Path, folder: str, source: str,
                                           problem: str | None) -> None:
    """The scanner on a file in another folder (problem None: allowed)."""
    target = tmp_path / folder / "bad.py"
    target.parent.mkdir(parents=True)
    target.write_text(source)
    problems = _import_problems(target, tmp_path)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_transfer_may_name_the_records_and_errors() -> None:
    """The names transfer/ may import from kvtier.fsm are exactly those of fsm's records and
    errors modules, and they include what transfer/ uses today."""
    assert {"Direction", "TransferCommand", "Completion", "CacheGroupSpec", "ConfigError", "KvtierError"} \
        <= FSM_NAMES_FOR_TRANSFER
    assert not {"TieredPrefixCache", "MatchMode", "Node", "Operation", "cache"} & FSM_NAMES_FOR_TRANSFER


def test_nothing_shadows_a_mapped_package() -> None:
    facade = REPO / "src" / "kvtier"
    shadows = [p.name for p in facade.iterdir()
               if any(fnmatch.fnmatch(p.name, f"{n}*") for n in FORBIDDEN_TOP_LEVEL)]
    assert not shadows, f"src/kvtier/ holds {shadows}: it would shadow kvtier.fsm/transfer/spec"
    assert not (REPO / "kvtier").exists(), "a root-level kvtier/ shadows the installed package"


def test_import_kvtier_and_cli_load_no_heavy_module() -> None:
    code = (
        "import json, pkgutil, sys\n"
        "import kvtier, kvtier.fsm, kvtier.cli\n"
        "for m in pkgutil.walk_packages(kvtier.fsm.__path__, 'kvtier.fsm.'):\n"
        "    __import__(m.name)\n"
        "kvtier.cli.build_parser()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO, timeout=60)
    loaded = json.loads(out.stdout)
    fsm_modules = {f"kvtier.fsm.{p.stem}" for p in (REPO / "fsm").glob("*.py") if p.stem != "__init__"}
    assert fsm_modules | {"kvtier.cli", "kvtier.fsm"} <= set(loaded)
    heavy = [m for m in loaded if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY))
             or m.startswith("numba_cuda")]
    assert heavy == [], f"loaded: {heavy}"
    assert "kvtier.transfer" not in loaded, "the facade must import kvtier.transfer lazily"


def test_spec_ships_as_package_data() -> None:
    spec = resources.files("kvtier.spec")
    assert spec.joinpath("lifecycle.toml").read_text(encoding="utf-8").lstrip().startswith("#")
    assert spec.joinpath("README.md").is_file()
    assert resources.files("kvtier").joinpath("py.typed").is_file()


def _subpackages_on_disk() -> set[str]:
    found = set()
    for pkg, folder in MAPPED.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((pkg, *parts)))
    return found


def test_pyproject_maps_and_lists_every_subpackage() -> None:
    assert SETUPTOOLS["package-dir"] == MAPPED
    listed = set(SETUPTOOLS["packages"])
    on_disk = _subpackages_on_disk()
    assert listed == on_disk, (f"unlisted in pyproject: {sorted(on_disk - listed)}; "
                               f"listed but absent: {sorted(listed - on_disk)}")


def test_every_folder_with_python_code_is_a_package() -> None:
    """A folder of .py files without __init__.py would be left out of the wheel."""
    missing = sorted({str(f.parent.relative_to(REPO)) for pkg, folder in MAPPED.items()
                      for f in _py_files(folder) if not (f.parent / "__init__.py").exists()})
    assert not missing, f"folders without __init__.py: {missing}"


def test_every_data_file_is_shipped() -> None:
    """Each non-Python file in a package folder matches that package's package-data globs."""
    data = SETUPTOOLS.get("package-data", {})
    unshipped = []
    for pkg in _subpackages_on_disk():
        owner = _owner(pkg)
        assert owner is not None
        folder = REPO / MAPPED[owner] / Path(*pkg.split(".")[len(owner.split(".")):])
        for f in folder.iterdir():
            if f.is_file() and f.suffix not in (".py", ".pyc") \
                    and not any(fnmatch.fnmatch(f.name, g) for g in data.get(pkg, ())):
                unshipped.append(str(f.relative_to(REPO)))
    assert not unshipped, f"package files missing from [tool.setuptools.package-data]: {unshipped}"


def test_pytest_configuration() -> None:
    ini = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert "--import-mode=importlib" in ini["addopts"].split()
    assert ini["testpaths"] == ["tests"]


#: the most lines one module of fsm/, transfer/ or src/kvtier/ may have (one job per module).
MODULE_LINES = 500
#: the folders of shipped code.
SHIPPED = ("fsm", "transfer", "src/kvtier")


def _long_modules(folder: Path, limit: int) -> dict[str, int]:
    """Python files under ``folder`` with more than ``limit`` lines: relative path -> lines."""
    out = {}
    for f in sorted(folder.rglob("*.py")):
        if "__pycache__" not in f.parts:
            lines = len(f.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                out[str(f.relative_to(folder))] = lines
    return out


def test_no_shipped_module_is_over_500_lines(tmp_path: Path) -> None:
    assert {folder: _long_modules(REPO / folder, MODULE_LINES) for folder in SHIPPED} == \
        {folder: {} for folder in SHIPPED}
    assert (REPO / "fsm" / "node" / "core.py").exists() and not (REPO / "fsm" / "cache.py").exists()
    # the check itself counts lines exactly: 500 pass, 501 do not
    (tmp_path / "ok.py").write_text("x = 1\n" * MODULE_LINES, encoding="utf-8")
    (tmp_path / "long.py").write_text("x = 1\n" * (MODULE_LINES + 1), encoding="utf-8")
    assert _long_modules(tmp_path, MODULE_LINES) == {"long.py": MODULE_LINES + 1}


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every kvtier module ``path`` (a module of ``package``) imports, wherever the import
    stands (module level, functions, ``if TYPE_CHECKING:``), relative imports resolved;
    ``from X import name`` counts ``X`` and ``X.name``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("kvtier")}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules of ``graph`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _node_core_graph() -> dict[str, set[str]]:
    modules = {f"kvtier.fsm.node.{f.stem}": f for f in sorted((REPO / "fsm" / "node").glob("*.py"))
               if f.stem != "__init__"}
    return {m: _imported_modules(f, "kvtier.fsm.node") & set(modules) for m, f in modules.items()}


def test_no_part_of_the_node_core_imports_the_core() -> None:
    """The node core's parts take a shared store and their sibling parts (fsm/node/store.py),
    never the whole core: only core.py and the package's re-exports name it."""
    importers = sorted(m for m, deps in _node_core_graph().items() if "kvtier.fsm.node.core" in deps)
    assert importers == []
    assert len(_node_core_graph()) > 15


def test_the_node_core_has_no_import_circle() -> None:
    assert _circles(_node_core_graph()) == []
    # the search itself: a circle of three is found, a chain is not
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": {"c"}}) == []


#: a test file named after a round of work or the tool that found a gap, not its subject
ROUND_NAME = re.compile(r"(^|_)(s\d+[a-z]?|session\d*|issue\d+|round\d+|mutants?|mutmut|review)(_|\.py$)")


def test_no_test_file_is_named_after_a_round_of_work() -> None:
    tests = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))
    # the semantic mutants are the subject of the test of the planted bugs' catalogue
    named = [t for t in tests if ROUND_NAME.search(Path(t).name) and t != "tests/test_semantic_mutants.py"]
    assert named == []
    assert len(tests) > 80
    assert [n for n in ("test_fsm_mutants_s6a.py", "test_batch_mutants_s6.py", "test_core_session4.py",
                        "test_issue12_cases.py", "test_records.py", "test_issue_then_copy_failure.py")
                        if ROUND_NAME.search(n)] == \
        ["test_fsm_mutants_s6a.py", "test_batch_mutants_s6.py", "test_core_session4.py", "test_issue12_cases.py"]


def _foreign_private_reads(text: str, where: str) -> list[str]:
    """``x._name`` in ``text`` where ``x`` is not ``self`` or ``cls``: another object's
    private attribute (dunders excluded)."""
    return [f"{where}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_the_core_and_its_tests_use_only_public_views() -> None:
    """No code outside a class reads its private attributes (issue 11): the node core's
    parts talk through their public views, and so do its tests and its benchmark."""
    node = REPO / "tests" / "fsm" / "node"
    files = [*_py_files("fsm"), *(node / f"test_{name}.py" for name in (
                 "completions", "core_stateful", "eviction", "invariants", "loadback", "match", "node", "parts",
                 "publish", "refusals", "results", "split", "stats", "writeback")),
             REPO / "tests" / "fsm" / "lifecycle" / "test_names.py", REPO / "tests" / "fsm" / "test_presets.py",
             REPO / "tests" / "core_helpers.py", REPO / "bench" / "lifecycle.py"]
    assert len(files) > 30
    found = [p for f in files for p in _foreign_private_reads(f.read_text(encoding="utf-8"), f.name)]
    assert found == []
    # the scan itself: another object's private attribute is found, self's, cls's and dunders are not
    assert _foreign_private_reads("c._x\nself._y\ncls._z\nc.__class__\nc.tree._nodes[1]\n", "t") == [
        "t:1: c._x", "t:5: c.tree._nodes"]
