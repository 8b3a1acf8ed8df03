"""Run ``kvtier replay`` on the GPU with a transfer backend its command line does not list.

``kvtier replay --backend`` offers ``none``, ``cpu``, ``torch`` and ``numba``, and the
replay's byte executor puts its device pool on the GPU for ``torch`` and ``numba`` only
(``src/kvtier/replay/command.py``, ``src/kvtier/replay/fingerprint.py``). Until ``hybrid`` is
added there, this script runs the replay with ``--backend numba`` (CUDA pools) and
replaces each executor's transfer engine, right after it is built and before any
copy, by one on the backend named here; the JSON's ``setup.backend`` says which.

    python bench/replay_backend.py hybrid --byte-scale 1 --layers 8 --limit 300 --json > out.json

``hybrid:page`` runs the hybrid backend with a page-major host pool
(``HostPool(layout="page")``), where the staging path moves whole host extents.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: replay_backend.py BACKEND [kvtier replay options]", file=sys.stderr)
        return 2
    backend, rest = argv[0], argv[1:]
    backend, _, layout = backend.partition(":")
    base = os.environ.get("KVTIER_REPLAY_BASE", "numba")  # "cpu" to try this script without a GPU
    from kvtier import cli
    from kvtier.replay import fingerprint
    from kvtier.transfer import HostPool, TransferEngine

    original = fingerprint.BytesExecutor.__init__
    host_layout = layout

    def init(self: Any, layout: Any, device_pages: Any, host_pages: Any, _backend: str = "cpu",
             salt: int = 0) -> None:
        original(self, layout, device_pages, host_pages, base, salt)
        if host_layout:
            self.host = HostPool(list(layout.groups), host_pages or {g.name: 1 for g in layout.groups},
                                 layout=host_layout)
        # a page-major host measures the calibration at bind: the committed one has no copy
        # sizes of whole host extents (bench/RESULTS.md)
        opts = {"calibration": "measure"} if host_layout and backend == "hybrid" else None
        self.engine = TransferEngine(list(layout.groups), self.host, self.device, backend, backend_options=opts)

    fingerprint.BytesExecutor.__init__ = init  # type: ignore[method-assign,assignment]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["replay", "--backend", base, *rest])
    text = out.getvalue()
    if "--json" in rest and rc == 0:
        doc = json.loads(text)
        doc["setup"]["backend"] = backend + (f" (host layout {layout})" if layout else "")
        doc["setup"]["backend_note"] = "run through bench/replay_backend.py (numba's CUDA pools, engine replaced)"
        text = json.dumps(doc, indent=1) + "\n"
    sys.stdout.write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
