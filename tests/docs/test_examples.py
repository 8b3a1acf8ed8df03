"""The examples of the README and the docs run as written and do what their pages say.

Each block after an ``<!-- example:NAME -->`` marker (README.md: ``embed``; docs/embedding.md:
``batch``; docs/transfer.md: ``transfer``; docs/l3.md: ``l3``) is executed verbatim; what
it prints, what the page says it prints and the cache it leaves are checked.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from docs.codeblocks import README, Block, example

EXAMPLES = ("embed", "batch", "transfer", "l3")


def run(block: Block, code: str | None = None) -> tuple[list[str], dict[str, object]]:
    """Execute ``block`` (or ``code`` in its place) in a fresh namespace: printed lines, namespace."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code or block.code, block.name, "exec"), namespace)
    return out.getvalue().splitlines(), namespace


def said_on_page(block: Block, line: str) -> bool:
    """The page quotes ``line`` as output (in backticks, possibly broken over lines)."""
    text = " ".join(block.page.read_text(encoding="utf-8").split())
    return f"`{' '.join(line.split())}`" in text


def test_every_example_marker_has_a_test_here() -> None:
    from docs.codeblocks import all_blocks

    names = {b.marker.split(":", 1)[1] for b in all_blocks() if b.marker and b.marker.startswith("example:")}
    assert names == set(EXAMPLES)


def test_embedding_example_is_in_the_readme_and_about_thirty_lines() -> None:
    block = example("embed")
    assert block.page == README
    assert 20 <= len(block.code.strip().splitlines()) <= 40
    assert "from kvtier import Completion, TieredCache" in block.code  # the package exports the facade


def test_embedding_example_runs() -> None:
    block = example("embed")
    printed, namespace = run(block)
    assert printed == [
        "a: 0 of 70 prompt tokens cached (-)",
        "b: 64 of 70 prompt tokens cached (device)",
        "c: 0 of 100 prompt tokens cached (-)",
        "d: 64 of 70 prompt tokens cached (host)",
    ]
    assert all(said_on_page(block, line) for line in printed)
    cache = namespace["cache"]
    from kvtier import TieredCache

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


def test_transfer_example_moves_real_bytes_on_cpu() -> None:
    """The pages a request wrote come back from the host into other device pages, intact."""
    block = example("transfer")
    printed, namespace = run(block)
    assert printed == ["d: 64 hit tokens, 48 loaded back, pages hold [1, 2, 3, 4, 5]", "393216 bytes loaded back"]
    assert all(said_on_page(block, line) for line in printed)
    cache = namespace["cache"]
    cache.check_invariants()  # type: ignore[attr-defined]
    st = cache.stats()  # type: ignore[attr-defined]
    assert st["loadbacks"] == 1 and st["pages_loaded"] == 3 and st["demotions"] >= 1
    assert "..." not in block.code.replace('"..."', "")  # nothing left for the reader to fill in


def test_batched_step_example_runs() -> None:
    """One call per step for the whole batch: a short reservation leaves the others'
    outcomes intact and is retried once pages are freed."""
    block = example("batch")
    printed, namespace = run(block)
    assert printed == [
        "a:ok b:ok c:ok",
        "a:ok b:ok c:short",  # c's chunk does not fit beside a and b: a and b go on
        "c:short",  # a and b finish after this step's call
        "c:ok",
        "c:ok",
        "-",
    ]
    assert said_on_page(block, "a:ok b:ok c:ok") and said_on_page(block, "a:ok b:ok c:short")
    cache = namespace["cache"]
    cache.check_invariants()  # type: ignore[attr-defined]
    cache.poll()  # type: ignore[attr-defined]
    assert cache.requests() == []  # type: ignore[attr-defined]
    assert all(not cache.core.external_pages(g) for g in cache.core.device)  # type: ignore[attr-defined]
    assert all(n.lock_ref == 0 for n in cache.core.nodes())  # type: ignore[attr-defined]


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A redis-server of this test's own on a free loopback port (no persistence)."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI") or os.environ.get("KVTIER_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed (scripts/test.sh installs it with apt-get)")
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="kvtier-docs-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_l3_example_serves_a_second_instance_from_the_store(redis_url: str) -> None:
    """The second instance never computed the prompt: all of it comes from the store."""
    block = example("l3")
    assert block.code.count('"redis://127.0.0.1:6379"') == 1  # the page's URL, replaced by this test's server
    printed, namespace = run(block, block.code.replace('"redis://127.0.0.1:6379"', repr(redis_url)))
    assert printed == ["r2: 64 hit tokens, 64 from the host", "4 objects read from the store"]
    assert all(said_on_page(block, line) for line in printed)
    a, b = namespace["a"], namespace["b"]
    assert a.cache.l3.stats.put_ok == 4 and a.cache.l3.stats.get_ok == 0  # type: ignore[attr-defined]
    for inst in (a, b):
        inst.cache.check_invariants()  # type: ignore[attr-defined]
        inst.cache.l3.check_invariants()  # type: ignore[attr-defined]
