"""Shared benchmark plumbing: timing, one plain-text table, and recording a run in
``bench/RESULTS.md`` under its own delimited section.

A benchmark is a function ``(args) -> list[Row]``; a script collects them in a list, so
more rows are added by appending a function.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["Row", "median_seconds", "format_table", "provenance", "record_section"]

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    """One line of a benchmark table.

    Attributes:
        name: what was measured.
        ops: operations in one timed run (triggers, matches, ...).
        seconds: median wall time of one run.
        baseline: name of the row this one is compared with (its "vs" column is the
            time per op relative to the baseline's), or ``None``.
        note: free text (units of a memory figure, what the ops are, ...).
        target: the goal this row is held to and whether it was met (e.g.
            ``">= 100,000/s: met"``), or ``""``.
        timed: ``False`` for a figure that is not a time (memory): the time columns show
            ``-`` and the figure goes in ``note``.
    """

    name: str
    ops: int
    seconds: float
    baseline: str | None = None
    note: str = ""
    target: str = ""
    timed: bool = True

    @property
    def per_second(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else float("inf")

    @property
    def per_op_us(self) -> float:
        return 1e6 * self.seconds / self.ops if self.ops else 0.0


def median_seconds(setup: Callable[[], T], run: Callable[[T], object], repeat: int) -> float:
    """Median wall time of ``run(setup())`` over ``repeat`` runs (setup untimed, GC off)."""
    times = []
    for _ in range(repeat):
        state = setup()
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            run(state)
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return statistics.median(times)


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned plain-text table."""
    by_name = {r.name: r for r in rows}
    header = ("benchmark", "ops/run", "median ms", "ops/s", "us/op", "vs baseline", "target", "note")
    lines = [header]
    for r in rows:
        if not r.timed:
            lines.append((r.name, f"{r.ops:,}", "-", "-", "-", "-", r.target, r.note))
            continue
        base = by_name.get(r.baseline) if r.baseline else None
        ratio = f"{r.per_op_us / base.per_op_us:.1f}x" if base and base.timed and base.per_op_us > 0 else "-"
        lines.append((r.name, f"{r.ops:,}", f"{1e3 * r.seconds:.2f}", f"{r.per_second:,.0f}",
                      f"{r.per_op_us:.3g}", ratio, r.target, r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    numeric = {1, 2, 3, 4}

    def fmt(line: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(lines[0]), rule, *(fmt(line) for line in lines[1:])])


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    # bench/RESULTS.md itself is what a run records into: a change there is not a change to what was measured
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/RESULTS.md")
    return sha + (" (with local changes)" if changed else "")


def provenance(argv: Sequence[str], extra: str = "") -> str:
    """Command, date, machine and commit of this run, as Markdown lines."""
    cmd = " ".join(shlex.quote(a) for a in ["python", *argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{os.cpu_count()}-core {_cpu()}, {platform.system()}, "
               f"Python {platform.python_version()}{extra}")
    if hasattr(os, "getloadavg"):  # other work on the machine slows every row alike
        machine += f"; load average {os.getloadavg()[0]:.2f} at the end of the run"
    return "\n".join([f"- command: `{cmd}`", f"- date: {date}", f"- machine: {machine}",
                      f"- commit: {_commit()}"])


def record_section(path: Path, key: str, title: str, body: str) -> None:
    """Write ``body`` into ``path`` as section ``## title`` between
    ``<!-- key:begin -->`` and ``<!-- key:end -->``, replacing that section if present and
    leaving every other section as it is."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    section = f"{begin}\n## {title}\n\n{body.strip()}\n{end}\n"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("bench/harness.py is a library; run a benchmark script such as bench/lifecycle.py")
