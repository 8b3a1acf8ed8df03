"""The fenced code blocks of ``README.md`` and ``docs/``, for the tests that run or check them.

A block is a top-level fence (```` ```LANG ```` at the start of a line to the next ```` ``` ````).
The HTML comment on the line before it, if any, is its marker:

- ``<!-- example:NAME -->``: an example whose output a test of its own checks
  (``test_examples.py``);
- ``<!-- run -->``: a bash block that ``test_code_blocks.py`` runs;
- ``<!-- continues -->``: a python block that continues the previous python block of its
  page (the two run in order, in one namespace).

Python blocks whose first line is ``# tests/<file>.py`` are files an engine saves (the kit
example of ``docs/testing.md``), run by pytest in ``test_kit_example.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*(\S.*?)\s*-->\s*$")


def pages() -> list[Path]:
    """README.md and every markdown page under docs/ (the API reference pages included;
    the ``docs/diagrams`` link to the generated drawings holds none)."""
    found = [p for p in DOCS.rglob("*.md") if "diagrams" not in p.relative_to(DOCS).parts]
    return [README, *sorted(found)]


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, the 1-based line of its opening fence, its language,
    its text (without the fences) and its marker (or ``None``)."""

    page: Path
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def name(self) -> str:
        """``page:line``, relative to the repository (a test id)."""
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def saved_as(self) -> str | None:
        """The file an engine saves this python block as (its ``# tests/...py`` first line)."""
        first = self.code.split("\n", 1)[0]
        m = re.fullmatch(r"# (tests/[\w/]+\.py)", first)
        return m.group(1) if m and self.lang == "python" else None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order (ValueError: a fence left open)."""
    lines = page.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: a code fence that is never closed")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mm = _MARKER.match(lines[k]) if k >= 0 else None
        out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n", mm.group(1) if mm else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    """Every block of every page."""
    return [b for p in pages() for b in blocks(p)]


def example(name: str) -> Block:
    """The one block marked ``<!-- example:NAME -->`` (AssertionError: none or several)."""
    found = [b for b in all_blocks() if b.marker == f"example:{name}"]
    assert len(found) == 1, f"expected exactly one <!-- example:{name} --> block, found {[b.name for b in found]}"
    assert found[0].lang == "python", f"{found[0].name}: example:{name} is not a python block"
    return found[0]


def python_groups() -> list[list[Block]]:
    """The python blocks the generic test runs, each with its continuations: every python
    block but the ``example:`` ones and the saved files (ValueError: a continuation with no
    python block before it on its page)."""
    groups: list[list[Block]] = []
    for page in pages():
        last: list[Block] | None = None
        for b in blocks(page):
            if b.lang != "python":
                continue
            if b.marker == "continues":
                if last is None:
                    raise ValueError(f"{b.name}: <!-- continues --> but no python block before it on its page")
                last.append(b)
                continue
            if (b.marker or "").startswith("example:") or b.saved_as is not None:
                last = None
                continue
            last = [b]
            groups.append(last)
    return groups


def section(page: Path, heading: str) -> str:
    """The text of the section that starts with the heading line ``heading`` (``## ...``)
    up to the next heading of the same or a higher level (lines inside code fences are
    never headings)."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = page.read_text(encoding="utf-8").split("\n")
    assert heading in lines, f"{page.name} has no heading {heading!r}"
    out: list[str] = []
    fenced = False
    for line in lines[lines.index(heading) + 1:]:
        if _FENCE.match(line) or line.rstrip() == "```":
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        out.append(line)
    return "\n".join(out)
