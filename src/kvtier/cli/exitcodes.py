"""Exit statuses of the ``kvtier`` command (one meaning each, for every subcommand)."""

from __future__ import annotations

import argparse
import enum
import re
import textwrap

__all__ = ["ExitCode", "epilog", "LineFormatter"]


class ExitCode(enum.IntEnum):
    """What ``kvtier`` returns to the shell."""

    OK = 0
    """Success: the run completed and every check passed."""
    FAILED = 1
    """A check failed: fuzz or verify found (or a replayed file reproduced) a violation, check
    rejected an event log, the committed diagrams differ from the spec, or a replay read back
    wrong bytes or stalled."""
    USAGE = 2
    """Bad input: an invalid option or value, a malformed trace or sequence file, a file that
    cannot be read, a missing optional dependency, or a backend this machine lacks."""
    INCOMPLETE = 3
    """Stopped before the end: ``verify --max-seconds`` ran out, or ``fuzz --require-coverage``
    did not reach full coverage."""
    INTERNAL = 4
    """An unexpected error inside kvtier (a bug: the traceback is printed; please report it)."""
    INTERRUPTED = 130
    """Interrupted (Ctrl-C)."""


_SHORT = {
    ExitCode.OK: "success",
    ExitCode.FAILED: "a check failed (a violation found or reproduced, an event log rejected, "
                     "diagrams out of date, wrong bytes read back, a stalled replay)",
    ExitCode.USAGE: "bad input (option, value, trace or sequence file, unreadable file, "
                    "missing optional dependency, backend without CUDA)",
    ExitCode.INCOMPLETE: "stopped before the end (verify --max-seconds, fuzz --require-coverage)",
    ExitCode.INTERNAL: "internal error (a kvtier bug; traceback printed)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


def epilog() -> str:
    """The exit statuses as ``--help`` epilog text (one per line)."""
    return "exit status:\n" + "\n".join(f"  {int(c):<3}  {_SHORT[c]}" for c in ExitCode)


class LineFormatter(argparse.HelpFormatter):
    """argparse help formatter that wraps each line of a description or epilog on its own,
    so the exit-status table keeps one status per line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for line in text.splitlines():
            hang = re.match(r"\s*(\d+\s+)?", line)  # continuation lines align after "  2    "
            out.append(textwrap.fill(line, width, initial_indent=indent,
                                     subsequent_indent=indent + " " * (hang.end() if hang else 0))
                       if line.strip() else "")
        return "\n".join(out)
