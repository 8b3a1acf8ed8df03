"""Pick the tests a mutant of fsm/ is run against (called by runner.sh for every mutant).

mutmut 2 applies a mutant in place and keeps the original as ``fsm/.../<file>.py.bak``. This
finds the mutated line (the one line that differs from the backup), the innermost function
whose body holds it, and every test of the subset (``tests.txt``) that ran any line of that
function unmutated (``covermap.json``, built by covermap.py): only those tests can see the
mutant, since a test that never enters the function runs exactly as before until it does.
It prints them one per line, fastest first, into the file named by argv[1], and prints:

- ``some``: the file lists the tests to run;
- ``all``:  the line runs outside any function (module or class level, a ``def`` line and
  its defaults or decorators) or inside one that also runs at import: the file lists the
  whole subset, fastest first;
- ``none``: no test of the subset enters the function: the mutant survives without a run.

This is per-test coverage analysis, as Stryker's ``perTest`` and mutmut 3 do it; the map is
of the committed sources and tests: rebuild it (or --add new tests) after either changes.
The map's test list is the subset: a test missing from the map is never selected.
"""

from __future__ import annotations

import ast
import difflib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def mutated() -> tuple[str, list[int], str]:
    baks = sorted((ROOT / "fsm").rglob("*.py.bak"))
    if len(baks) != 1:
        raise SystemExit(f"expected one fsm/**/*.py.bak while a mutant is applied, found {len(baks)}")
    bak = baks[0]
    src = bak.with_suffix("")
    old = bak.read_text(encoding="utf-8").splitlines()
    new = src.read_text(encoding="utf-8").splitlines()
    lines = sorted({i + 1 for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
                    if tag != "equal" for i in range(i1, max(i2, i1 + 1))})
    return src.relative_to(ROOT).as_posix(), lines, "\n".join(old)


def scope(tree: ast.AST, line: int) -> tuple[int, int] | None:
    """(first, last) line of the innermost function whose *body* holds ``line``."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            first = body[0].lineno
            if isinstance(node, ast.Lambda):
                first = node.lineno
            if first <= line <= node.end_lineno and (best is None or first >= best[0]):
                best = (first, node.end_lineno)
    return best


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    rel, lines, original = mutated()
    cmap = json.loads((HERE / "covermap.json").read_text(encoding="utf-8"))
    by_line = cmap["files"].get(rel, {})
    tree = ast.parse(original)
    names = cmap["tests"]
    tests: set[int] = set()
    for line in lines:
        sc = scope(tree, line)
        if sc is None:
            tests = set(range(len(names)))
            break
        for ln in range(sc[0], sc[1] + 1):
            tests.update(by_line.get(str(ln), ()))
    if any(names[i] == "<import>" for i in tests):
        # the whole subset, fastest first
        out.write_text("\n".join(t for t in names if t != "<import>") + "\n", encoding="utf-8")
        print("all")
        return 0
    if not tests:
        print("none")
        return 0
    out.write_text("\n".join(names[i] for i in sorted(tests)) + "\n", encoding="utf-8")
    print("some")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
