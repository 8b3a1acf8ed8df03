"""Write the mutation section of bench/RESULTS.md from the committed raw results.

Usage: python bench/mutation/record.py   (reads results/*.xml, exclusions.txt and notes.md here)
"""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import record_section  # noqa: E402
import score  # noqa: E402


def main() -> int:
    buf = io.StringIO()
    with redirect_stdout(buf):
        score.main(["--markdown"])
    notes = (HERE / "notes.md").read_text(encoding="utf-8")
    body = notes.replace("{{TABLE}}", buf.getvalue().strip())
    record_section(HERE.parent / "RESULTS.md", "mutation", "Mutation testing of fsm/ (mutmut 2.x)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
