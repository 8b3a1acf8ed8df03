"""The README's example of embedding kvtier in a scheduler runs as written (issue 4).

The code block right after the ``<!-- example:embed -->`` marker in README.md is
extracted verbatim and executed; what it prints and the cache it leaves are checked.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- example:embed -->"


def example_code(marker: str = MARKER) -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(marker) == 1, f"README.md needs exactly one {marker} marker"
    m = re.search(re.escape(marker) + r"\s*\n```python\n(.*?)\n```", text, re.DOTALL)
    assert m is not None, f"no ```python block right after {marker}"
    return m.group(1) + "\n"


def test_readme_example_is_about_thirty_lines() -> None:
    lines = example_code().strip().splitlines()
    assert 20 <= len(lines) <= 40


def test_readme_example_runs() -> None:
    code = example_code()
    namespace: dict[str, object] = {"__name__": "readme_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README) + ":example:embed", "exec"), namespace)
    assert out.getvalue().splitlines() == [
        "a: 0 of 70 prompt tokens cached (-)",
        "b: 64 of 70 prompt tokens cached (device)",
        "c: 0 of 100 prompt tokens cached (-)",
        "d: 64 of 70 prompt tokens cached (host)",
    ]
    cache = namespace["cache"]
    from kvtier.tiered import TieredCache

    assert isinstance(cache, TieredCache)
    cache.check_invariants()
    # every request ended and was forgotten; nothing is held outside the tree or in flight
    cache.poll()
    assert cache.requests() == []
    assert not cache.core.operations()
    assert all(not cache.core.external_pages(g) for g in cache.core.device)
    assert all((n.lock_ref, n.host_pin, n.borrow_ref) == (0, 0, 0) for n in cache.core.nodes())
    stats = cache.stats()
    assert stats["loadbacks"] == 1 and stats["demotions"] >= 1 and stats["writebacks"] >= 1


def test_readme_transfer_example_runs_on_cpu() -> None:
    """The transfer example (``<!-- example:transfer -->``) moves real bytes: the pages a
    request wrote come back from the host into other device pages, intact."""
    code = example_code("<!-- example:transfer -->")
    namespace: dict[str, object] = {"__name__": "readme_transfer"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README) + ":example:transfer", "exec"), namespace)
    assert out.getvalue().splitlines() == ["d: 64 hit tokens, 48 loaded back, pages hold [1, 2, 3, 4, 5]",
                                           "393216 bytes loaded back"]
    cache = namespace["cache"]
    from kvtier.tiered import TieredCache

    assert isinstance(cache, TieredCache)
    cache.check_invariants()
    st = cache.stats()
    assert st["loadbacks"] == 1 and st["pages_loaded"] == 3 and st["demotions"] >= 1
    assert "..." not in code.replace('"..."', "")  # nothing left for the reader to fill in


def test_readme_batched_step_example_runs() -> None:
    """The batched step example (issue 14): one call per step for the whole batch; a short
    reservation leaves the others' outcomes intact and is retried once pages are freed."""
    code = example_code("<!-- example:batch -->")
    namespace: dict[str, object] = {"__name__": "readme_batch_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README) + ":example:batch", "exec"), namespace)
    assert out.getvalue().splitlines() == [
        "a:ok b:ok c:ok",
        "a:ok b:ok c:short",  # c's chunk does not fit beside a and b: a and b go on
        "c:short",  # a and b finish after this step's call
        "c:ok",
        "c:ok",
        "-",
    ]
    cache = namespace["cache"]
    from kvtier.tiered import TieredCache

    assert isinstance(cache, TieredCache)
    cache.check_invariants()
    cache.poll()
    assert cache.requests() == []
    assert all(not cache.core.external_pages(g) for g in cache.core.device)
    assert all(n.lock_ref == 0 for n in cache.core.nodes())
