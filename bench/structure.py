"""The repository's structure measures, for this checkout or for commits, as one table.

    python bench/structure.py                       # this checkout
    python bench/structure.py --rev b1a6d87         # one commit
    python bench/structure.py --rev b1a6d87 --rev HEAD   # before / after columns
    python bench/structure.py --rev b1a6d87 --checkout   # a commit beside this checkout

A commit is read from ``git archive REV`` unpacked into a temporary folder; this checkout
from its files that git tracks or would track (``git ls-files --cached --others
--exclude-standard``), so a virtual environment or build output is never counted.

Measures (rows of the table; the lists after it name the modules behind the counts):

- files per folder: the files directly in each folder of ``fsm/``, ``transfer/`` and
  ``src/kvtier/`` (every kind of file), and the Python modules and their lines in all three;
- import circles: strongly connected components of two or more modules in the graph of
  the imports between the modules of those three folders (module names from
  pyproject.toml's ``[tool.setuptools] package-dir``). *All imports*: every ``import``
  statement of a module, wherever it stands (module level, ``if TYPE_CHECKING:``, inside
  functions); *runtime*: only those run when the module is imported (module and class
  level, ``if``/``try`` blocks included; not under ``if TYPE_CHECKING:`` nor inside a
  function). An import names the deepest module it loads: ``from . import x`` and ``from
  .pkg import x`` the module ``x`` if there is one, else the package; a parent package's
  ``__init__`` that the import system also runs is not an edge. An old module path from
  ``MOVED`` (src/kvtier/_moved.py) counts as the module it names now;
- test files and lines: ``tests/**/test_*.py``, all and those directly in ``tests/``;
- README lines: ``README.md``;
- modules over 500 lines in ``fsm/``, ``transfer/`` and ``src/kvtier/``.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("fsm", "transfer", "src/kvtier")
LIMIT = 500
DEFAULT_PACKAGE_DIR = {"kvtier": "src/kvtier", "kvtier.fsm": "fsm", "kvtier.transfer": "transfer"}


@dataclass
class Tree:
    """The files of one state of the repository: relative posix path -> absolute path on disk."""

    label: str
    files: dict[str, Path]

    def text(self, rel: str) -> str | None:
        p = self.files.get(rel)
        return p.read_text(encoding="utf-8", errors="replace") if p is not None else None


@dataclass
class Measures:
    label: str
    folder_files: dict[str, int] = field(default_factory=dict)
    modules: int = 0
    module_lines: int = 0
    circles: list[list[str]] = field(default_factory=list)
    runtime_circles: list[list[str]] = field(default_factory=list)
    test_files: int = 0
    test_lines: int = 0
    root_test_files: int = 0
    root_test_lines: int = 0
    readme_lines: int = 0
    long_modules: dict[str, int] = field(default_factory=dict)


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def checkout_tree() -> Tree:
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    files = {n: ROOT / n for n in names if n and (ROOT / n).is_file()}
    head = git("rev-parse", "--short", "HEAD").strip()
    dirty = bool(git("status", "--porcelain", "--", *FOLDERS, "tests", "README.md").strip())
    return Tree(f"checkout ({head}{', with changes' if dirty else ''})", files)


def rev_tree(rev: str, tmp: Path) -> Tree:
    try:
        short = git("rev-parse", "--short", f"{rev}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"bench/structure.py: {rev!r} is not a commit of this repository") from None
    dest = tmp / short
    dest.mkdir()
    archive = tmp / f"{short}.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), short], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    files = {p.relative_to(dest).as_posix(): p for p in dest.rglob("*") if p.is_file()}
    return Tree(short if short.startswith(rev) else f"{rev} ({short})", files)


def lines(text: str) -> int:
    return len(text.splitlines())


def package_dirs(tree: Tree) -> dict[str, str]:
    """Package -> folder, from pyproject.toml (longest folder first)."""
    text = tree.text("pyproject.toml")
    mapping = DEFAULT_PACKAGE_DIR
    if text is not None:
        mapping = tomllib.loads(text).get("tool", {}).get("setuptools", {}).get("package-dir", mapping)
    return dict(sorted(mapping.items(), key=lambda kv: -len(kv[1])))


def module_names(tree: Tree) -> dict[str, str]:
    """Dotted module name -> file, for the Python files of FOLDERS."""
    dirs = package_dirs(tree)
    out = {}
    for rel in tree.files:
        if not rel.endswith(".py") or not rel.startswith(tuple(f + "/" for f in FOLDERS)):
            continue
        for pkg, d in dirs.items():
            if rel.startswith(d.rstrip("/") + "/"):
                parts = rel[len(d.rstrip("/")) + 1:-3].split("/")
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join([pkg, *parts])] = rel
                break
    return out


def moved_table(tree: Tree) -> dict[str, str]:
    """``MOVED`` of src/kvtier/_moved.py when it is a literal dict (old module -> new)."""
    text = tree.text("src/kvtier/_moved.py")
    if text is None:
        return {}
    for node in ast.parse(text).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "MOVED" and getattr(node, "value", None) is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}
    return {}


def runtime_imports(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The import statements run when a module with this body is imported."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(stmt, ast.If):
            test = stmt.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                yield from runtime_imports(stmt.orelse)
            else:
                yield from runtime_imports(stmt.body)
                yield from runtime_imports(stmt.orelse)
        elif isinstance(stmt, ast.ClassDef):
            yield from runtime_imports(stmt.body)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            for part in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from runtime_imports(part)
        elif isinstance(stmt, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            yield from runtime_imports(stmt.body)
            yield from runtime_imports(getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                yield from runtime_imports(case.body)


def targets(stmt: ast.stmt, module: str, is_package: bool, known: set[str], moved: dict[str, str]) -> set[str]:
    """The known modules an import statement of ``module`` names."""

    def resolve(name: str) -> str | None:
        name = moved.get(name, name)
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    out: set[str | None] = set()
    if isinstance(stmt, ast.Import):
        out = {resolve(a.name) for a in stmt.names}
    elif isinstance(stmt, ast.ImportFrom):
        base = stmt.module or ""
        if stmt.level:
            pkg = module if is_package else module.rpartition(".")[0]
            for _ in range(stmt.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        for a in stmt.names:
            sub = moved.get(f"{base}.{a.name}", f"{base}.{a.name}")
            out.add(sub if sub in known else resolve(base))
    return {t for t in out if t is not None and t != module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of 2+ nodes (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found, key=lambda c: (-len(c), c))


def measure(tree: Tree) -> Measures:
    m = Measures(tree.label)
    for rel in tree.files:
        for top in FOLDERS:
            if rel.startswith(top + "/"):
                folder = rel.rpartition("/")[0]
                m.folder_files[folder + "/"] = m.folder_files.get(folder + "/", 0) + 1
    names = module_names(tree)
    known = set(names)
    moved = moved_table(tree)
    every: dict[str, set[str]] = {}
    runtime: dict[str, set[str]] = {}
    for mod, rel in names.items():
        text = tree.text(rel) or ""
        n = lines(text)
        m.modules += 1
        m.module_lines += n
        if n > LIMIT:
            m.long_modules[rel] = n
        try:
            tree_ast = ast.parse(text)
        except SyntaxError:
            print(f"bench/structure.py: {tree.label}: {rel} does not parse; its imports are not counted", file=sys.stderr)
            continue
        pkg = rel.endswith("/__init__.py")
        stmts = [s for s in ast.walk(tree_ast) if isinstance(s, (ast.Import, ast.ImportFrom))]
        every[mod] = set().union(*(targets(s, mod, pkg, known, moved) for s in stmts)) if stmts else set()
        run = list(runtime_imports(tree_ast.body))
        runtime[mod] = set().union(*(targets(s, mod, pkg, known, moved) for s in run)) if run else set()
    m.circles, m.runtime_circles = circles(every), circles(runtime)
    for rel in tree.files:
        if rel.startswith("tests/") and rel.rpartition("/")[2].startswith("test_") and rel.endswith(".py"):
            n = lines(tree.text(rel) or "")
            m.test_files += 1
            m.test_lines += n
            if rel.count("/") == 1:
                m.root_test_files += 1
                m.root_test_lines += n
    m.readme_lines = lines(tree.text("README.md") or "")
    return m


def table(ms: list[Measures]) -> str:
    def row(name: str, values: Iterable[object]) -> str:
        return "| " + " | ".join([name, *(f"{v:,}" if isinstance(v, int) else str(v) for v in values)]) + " |"

    out = ["| measure | " + " | ".join(m.label for m in ms) + " |", "|---|" + "---:|" * len(ms)]
    folders = sorted(set().union(*(m.folder_files for m in ms)))
    for f in folders:
        out.append(row(f"files in `{f}`", (m.folder_files.get(f, "-") for m in ms)))
    out.append(row("Python modules in fsm/, transfer/, src/kvtier/", (m.modules for m in ms)))
    out.append(row("their lines", (m.module_lines for m in ms)))
    out.append(row("import circles (all imports)", (len(m.circles) for m in ms)))
    out.append(row("modules in import circles", (sum(map(len, m.circles)) for m in ms)))
    out.append(row("runtime import circles", (len(m.runtime_circles) for m in ms)))
    out.append(row("modules in runtime import circles", (sum(map(len, m.runtime_circles)) for m in ms)))
    out.append(row("test files (`tests/**/test_*.py`)", (m.test_files for m in ms)))
    out.append(row("test lines", (m.test_lines for m in ms)))
    out.append(row("test files directly in `tests/`", (m.root_test_files for m in ms)))
    out.append(row("test lines directly in `tests/`", (m.root_test_lines for m in ms)))
    out.append(row("README.md lines", (m.readme_lines for m in ms)))
    out.append(row(f"modules over {LIMIT} lines", (len(m.long_modules) for m in ms)))
    return "\n".join(out)


def details(m: Measures) -> str:
    out = [f"{m.label}:"]
    for title, comps in (("import circles (all imports)", m.circles), ("runtime import circles", m.runtime_circles)):
        out.append(f"- {title}:" + (" none" if not comps else ""))
        out += [f"  - {len(c)} modules: {', '.join(c)}" for c in comps]
    longs = sorted(m.long_modules.items(), key=lambda kv: -kv[1])
    out.append(f"- modules over {LIMIT} lines: " + (", ".join(f"{f} ({n:,})" for f, n in longs) or "none"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", default=[], metavar="REV",
                    help="a commit to measure (repeat for before / after columns)")
    ap.add_argument("--checkout", action="store_true", help="also measure this checkout (the default without --rev)")
    ap.add_argument("--no-details", action="store_true", help="only the table, not the modules behind the counts")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtier-structure-") as tmp:
        trees = [rev_tree(r, Path(tmp)) for r in args.rev]
        if args.checkout or not args.rev:
            trees.append(checkout_tree())
        ms = [measure(t) for t in trees]
    print(table(ms))
    if not args.no_details:
        print()
        print("\n\n".join(details(m) for m in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
