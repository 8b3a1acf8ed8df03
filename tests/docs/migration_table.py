"""The table of moved modules on ``docs/migration.md``, generated from ``kvtier._moved.MOVED``.

``python tests/docs/migration_table.py`` rewrites the table between the page's
``<!-- moved:begin -->`` and ``<!-- moved:end -->`` markers; ``test_migration_page.py``
fails while the page and ``MOVED`` differ (with this command in its message).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
BEGIN, END = "<!-- moved:begin -->", "<!-- moved:end -->"


def render(moved: Mapping[str, str]) -> str:
    """The markdown between the markers: one row per moved module, sorted by old path."""
    if not moved:
        return "No module has moved yet: every module is at the path it always had.\n"
    rows = [f"| `{old}` | `{moved[old]}` |" for old in sorted(moved)]
    return "\n".join(["| old module path | new module path |", "| --- | --- |", *rows]) + "\n"


def page_table(text: str) -> str:
    """The text between the markers of ``text`` (ValueError: markers missing or repeated)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{PAGE.name} needs exactly one {BEGIN} and one {END}")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write(moved: Mapping[str, str], page: Path = PAGE) -> bool:
    """Rewrite the page's table from ``moved``; True if the page changed."""
    text = page.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = f"{head}{BEGIN}\n{render(moved)}{END}{tail}"
    if new == text:
        return False
    page.write_text(new, encoding="utf-8")
    return True


if __name__ == "__main__":
    from kvtier._moved import MOVED

    changed = write(MOVED)
    print(f"{PAGE}: {'rewritten' if changed else 'already up to date'} ({len(MOVED)} moved modules)")
    sys.exit(0)
