"""The README's headline table is what ``kvtier replay`` prints today, and says how it was made.

The replay is re-run with ``--backend none`` (metadata only: no bytes move, every count is
the same as the default ``cpu`` run's); every row of counts must equal the README's. The
bookkeeping row is a timing and is not compared. The sentence above the table names the
command, the commit, the date and the machine's load.
"""

from __future__ import annotations

import contextlib
import io
import re

from docs.codeblocks import README, section

TIMING_ROWS = ("kvtier bookkeeping",)


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_headline_table_is_labelled_with_command_commit_date_and_load() -> None:
    start = section(README, "## Start here")
    label = " ".join(start.split("\n| ", 1)[0].split("\n\n")[-1].split())
    assert re.search(r"^The table `kvtier replay` printed, run at commit `[0-9a-f]{7,40}` on \d{4}-\d{2}-\d{2} "
                     r"on a .+ at load average .+ \(.+ s wall", label), label


def test_headline_table_counts_are_what_kvtier_replay_prints() -> None:
    from kvtier.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["replay", "--backend", "none"]) == 0
    fresh = table_rows(out.getvalue())
    shown = table_rows(section(README, "## Start here"))
    assert [r.split(" | ")[0] for r in shown] == [r.split(" | ")[0] for r in fresh]  # same rows, same order
    for mine, now in zip(shown, fresh):
        if not mine.startswith(tuple(f"| {t}" for t in TIMING_ROWS)):
            assert mine == now
    # the setup lines under the table, but for the backend
    footer = [line for line in out.getvalue().splitlines() if line.startswith(("preset ", "modeled times", "capacities"))]
    assert len(footer) == 3
    for line in footer:
        assert line.replace("backend none", "backend cpu") in section(README, "## Start here")
