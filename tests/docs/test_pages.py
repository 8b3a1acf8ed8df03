"""The README is a front door and the docs pages are whole: the README's size and order, its
links to every guide page, links that resolve, every page in the MkDocs nav, the limits and
exit statuses the replay page lists, and the moved-module table of the migration page."""

from __future__ import annotations

import re
from pathlib import Path

from docs import migration_table
from docs.codeblocks import DOCS, README, REPO, blocks, pages, section

GUIDE = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.glob("*.md") if p.name != "index.md")


def test_readme_is_about_250_lines() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert 200 <= n <= 300, f"README.md has {n} lines: keep it a front door, move detail to docs/"


def test_readme_order_commands_first_then_install_then_the_embedding_example() -> None:
    text = README.read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings == ["Start here", "Install", "Embedding kvtier in a scheduler", "kvtier inside vLLM and SGLang",
                        "Layout and reading order", "More"]
    code = [b for b in blocks(README) if b.lang in ("bash", "python")]
    assert code[0].code == "bash scripts/setup.sh && .venv/bin/kvtier replay\n"
    assert code[1].code == "bash scripts/test.sh\n"
    first_python = next(b for b in code if b.lang == "python")
    assert first_python.marker == "example:embed"


def test_setup_and_test_scripts_do_what_the_readme_says() -> None:
    """setup.sh: a venv in .venv, the pinned CPU torch first, kvtier with the testing extra
    (which ``kvtier replay`` needs nothing beyond); test.sh: the test extras, the whole suite
    under the simulator and the kvtier-ci profile."""
    setup = (REPO / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert "python3 -m venv .venv" in setup
    torch_at, project_at = setup.index("torch==2.13.0"), setup.index("-e '.[testing]'")
    assert torch_at < project_at
    test = (REPO / "scripts" / "test.sh").read_text(encoding="utf-8")
    assert "-e '.[test,testing,l3,mooncake]'" in test
    for needed in ("redis-server", "libibverbs1", "graphviz", "NUMBA_ENABLE_CUDASIM=1", "kvtier-ci", '"$@"'):
        assert needed in test, needed
    assert re.search(r"python -m pytest .*\"\$@\"$", test, flags=re.M)  # the whole suite: no paths given


def test_readme_links_every_guide_page_once_in_more() -> None:
    more = section(README, "## More")
    linked = re.findall(r"\]\(docs/([\w-]+\.md)\)", more)
    assert sorted(linked) == GUIDE
    assert all(line.startswith("- ") for line in more.strip().splitlines()), "one line per topic"


def _links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # not inside code blocks
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]


def test_relative_links_resolve() -> None:
    bad = []
    for page in pages():
        for target in _links(page):
            path = target.split("#", 1)[0]
            if not path:
                continue
            dest = (page.parent / path).resolve()
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target}")
            elif page != README and not dest.is_relative_to(DOCS.resolve()) and not dest.is_relative_to(REPO / "diagrams"):
                bad.append(f"{page.relative_to(REPO)}: {target} leaves docs/ (MkDocs cannot follow it: name the file in backticks)")
    assert not bad


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = re.findall(r"^\s+- (?:[^:]+: |\"[^\"]+\": )?([\w/-]+\.md)$", (REPO / "mkdocs.yml").read_text(encoding="utf-8"),
                     flags=re.M)
    files = sorted(p.relative_to(DOCS).as_posix() for p in pages() if p != README)
    assert sorted(nav) == files


def test_replay_page_lists_every_exit_status_and_limit() -> None:
    from kvtier.exitcodes import ExitCode
    from kvtier import scheduler, tiered, trace
    from kvtier.fsm import pages as pool_pages

    limits = section(DOCS / "replay.md", "## Limits and exit codes")
    for status in ExitCode:
        assert f"| {int(status)} |" in limits
    for name in ("MAX_LINE_BYTES", "MAX_DECOMPRESSED_BYTES", "MAX_GZIP_RATIO", "MAX_OUTPUT_LENGTH", "MAX_HASH_IDS",
                 "MAX_HASH_ID", "MAX_INPUT_LENGTH", "MAX_TIMESTAMP_MS", "MAX_JSON_DEPTH", "DEFAULT_MAX_IDLE_STEPS",
                 "MAX_POOL_PAGES", "DEFAULT_OP_DEADLINE_STEPS", "DEFAULT_ENDED_HISTORY"):
        assert name in limits, name
    assert "`300000t` is a token count" in section(DOCS / "replay.md", "## Options")
    # the figures the table states are the constants' values
    assert trace.MAX_LINE_BYTES == 1 << 20 and trace.MAX_DECOMPRESSED_BYTES == 1 << 30
    assert trace.MAX_GZIP_RATIO == 200 and trace.MAX_JSON_DEPTH == 32
    assert trace.MAX_INPUT_LENGTH == 1_048_576 and trace.MAX_HASH_IDS == 2048 and trace.MAX_OUTPUT_LENGTH == 131_072
    assert trace.MAX_HASH_ID == 2**64 - 1 and trace.MAX_TIMESTAMP_MS == 1e13
    assert scheduler.DEFAULT_MAX_IDLE_STEPS == 100_000 and pool_pages.MAX_POOL_PAGES == 2**53
    assert tiered.DEFAULT_OP_DEADLINE_STEPS == 10_000 and tiered.DEFAULT_ENDED_HISTORY == 1024


def test_migration_page_lists_exactly_the_moved_modules() -> None:
    from kvtier._moved import MOVED

    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    assert migration_table.page_table(text) == migration_table.render(MOVED), \
        "docs/migration.md and kvtier._moved.MOVED differ: run python tests/docs/migration_table.py"
    assert section(DOCS / "migration.md", "## The layout by the spec's chapters").count(migration_table.BEGIN) == 1


def test_migration_table_renders_one_row_per_move() -> None:
    moved = {"kvtier.fsm.core": "kvtier.fsm.node.core", "kvtier.check": "kvtier.cli.check"}
    table = migration_table.render(moved).splitlines()
    assert table[2:] == ["| `kvtier.check` | `kvtier.cli.check` |", "| `kvtier.fsm.core` | `kvtier.fsm.node.core` |"]
    assert "| `kvtier.fsm.core` |" not in migration_table.render({})


FIGURE = re.compile(r"\d+(?:\.\d+)?\s?%|\d+\.\d+ (?:GB|MB/s|GB/s|s|ms|us)\b")


def figure_tables(page: Path) -> list[tuple[str, str]]:
    """(the heading of its section and the paragraph before, the table) of every table on
    ``page`` holding measured figures (percentages, decimal GB, GB/s, seconds)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    found = []
    for m in re.finditer(r"((?:^\|.*\|\n)+)", text, flags=re.M):
        if FIGURE.search(m.group(1)):
            before = text[:m.start()].rstrip().rsplit("\n\n", 1)[-1]
            headings = re.findall(r"^#+ .*$", text[:m.start()], flags=re.M)
            found.append(((headings[-1] + "\n" if headings else "") + before, m.group(1)))
    return found


def test_every_table_of_figures_says_its_command_commit_and_date() -> None:
    tables = {page: figure_tables(page) for page in pages()}
    assert len(tables[README]) == 1  # the headline table
    for page, found in tables.items():
        for before, table in found:
            said = " ".join(before.split())
            assert re.search(r"`kvtier [^`]+`|`python [^`]+`|`bash [^`]+`|`bench/[\w/.-]+`", said), \
                (page.name, table[:80], "no command")
            # a table of several rounds (docs/history.md) gives each row's date and commit as columns
            header = [c.strip().lower() for c in table.splitlines()[0].strip("|").split("|")]
            # or names the commit and date of each column in its header
            if not {"date", "commit"} <= set(header):
                head = table.splitlines()[0]
                assert re.search(r"commit `?[0-9a-f]{7,40}`?", said) or re.search(r"\b[0-9a-f]{7,40}\b", head), \
                    (page.name, table[:80], "no commit")
                assert re.search(r"\d{4}-\d{2}-\d{2}", said + head), (page.name, table[:80], "no date")
