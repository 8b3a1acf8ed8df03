"""Regenerate the deliberately broken variants (tests/broken/*.patch) from the current
sources: each is a small text replacement in fsm/ or src/kvtier/, written as a unified
diff with two lines of context (so it keeps applying while the code around it moves).

    python tests/broken/make_patches.py        # rewrite every patch
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: patch name -> (invariant it breaks, [(file, old text, new text), ...])
BROKEN: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "01-root-closed-host": ("root_closed_host", [
        ("fsm/guards.py", '"parent_on_host": lambda n: bool(n.parent_on_host),',
         '"parent_on_host": lambda n: True,  # BROKEN'),
        ("fsm/writeback.py", "            if p.parent is None or p.state in HOST_VISIBLE:\n                out.append(n)",
         "            if p.parent is None or p.state in HOST_VISIBLE or p.state == NODE_STATE.writing:  # BROKEN\n"
         "                out.append(n)  # a child is written back before its parent's copy is acknowledged"),
    ]),
    "02-host-means-acked": ("host_means_acked", [
        ("fsm/transfers.py", "            n.pending = self._reserve(transfers, n.dev)",
         "            n.host = self._reserve(transfers, n.dev)  # BROKEN: visible at once"),
    ]),
    "03-writeback-source-immutable": ("writeback_source_immutable", [
        ("fsm/reclaim.py", "return (n.state in (NS.device, NS.backed) and n.lock_ref == 0 and n.borrow_ref == 0",
         "return (n.state in (NS.device, NS.backed, NS.writing) and n.lock_ref == 0 and n.borrow_ref == 0"),
        ("fsm/reclaim.py", "            if n.state == NS.backed:\n                n = self._tail(n, need, freed)",
         "            if n.state == NS.writing:  # BROKEN: frees the source of a copy in flight\n"
         "                for g, k in self._release_device(n).items():\n"
         "                    freed[g] += k\n"
         "                continue\n"
         "            if n.state == NS.backed:\n                n = self._tail(n, need, freed)"),
    ]),
    "04-loadback-source-pinned": ("loadback_source_pinned", [
        ("fsm/guards.py", '"unpinned": lambda n: n.host_pin == 0,', '"unpinned": lambda n: True,  # BROKEN'),
        ("fsm/reclaim.py", "return (n.state in (NS.host, NS.backed) and n.host_pin == 0 and not n.has_host_child",
         "return (n.state in (NS.host, NS.backed) and not n.has_host_child  # BROKEN: pins ignored"),
    ]),
    "05-counts-with-receipts": ("counts_with_receipts", [
        ("fsm/receipts.py", "        for n in node.path():\n            n.lock_ref += 1\n            if owner is None",
         "        for n in node.path()[:1]:  # BROKEN: the ancestors are not counted\n"
         "            n.lock_ref += 1\n            if owner is None"),
    ]),
    "06-split-preserves-ownership": ("split_preserves_ownership", [
        ("fsm/optable.py", "            op.nodes.insert(op.nodes.index(node), prefix)",
         "            pass  # BROKEN: the new fragment is not part of the operation"),
    ]),
    "07-operation-ends-once": ("operation_ends_once", [
        ("fsm/optable.py", "        if key in op.seen or c.rank in op.acked:",
         "        if False:  # BROKEN: duplicate completions are accepted"),
    ]),
    "08-release-once-after-fence": ("release_once_after_fence", [
        ("fsm/request_ends.py", '        r.poisoned = True\n        self.table.fire(r, "abort")',
         '        r.poisoned = True\n        self.table.fire(r, "abort")\n'
         '        if r.state == "aborting":  # BROKEN: released before its work in flight ended\n'
         '            self.table.free_own(r)'),
    ]),
    "09-host-evict-leaves": ("host_evict_leaves", [
        ("fsm/guards.py", '"has_host_child": lambda n: bool(n.has_host_child),',
         '"has_host_child": lambda n: False,  # BROKEN'),
        ("fsm/reclaim.py", "return (n.state in (NS.host, NS.backed) and n.host_pin == 0 and not n.has_host_child",
         "return (n.state in (NS.host, NS.backed) and n.host_pin == 0  # BROKEN: inner nodes too"),
    ]),
    "10-failure-not-success": ("failure_not_success", [
        ("fsm/transfers.py", "                if not ok:\n                    core.ledger.release_device(n.dev)",
         "                if False:  # BROKEN: a failed loadback is reported as success\n"
         "                    core.ledger.release_device(n.dev)"),
        ("fsm/transfers.py", "                core.trigger(n, EV.loadback_ack if ok else EV.loadback_fail)",
         "                core.trigger(n, EV.loadback_ack)"),
    ]),
    "11-atomic-admission": ("atomic_admission", [
        ("fsm/admission.py", "        except CapacityError:\n            if hold is not None:\n"
                                 "                core.unlock(hold)\n            return None",
         "        except CapacityError:\n            return None  # BROKEN: the device-hit lock is not rolled back"),
    ]),
    "12-loaded-equals-written": ("loaded_equals_written", [
        ("fsm/transfers.py", "                n.dev[g] = self._move(transfers, g, src, core.device[g].alloc(len(src)))",
         "                n.dev[g] = self._move(transfers, g, src, core.device[g].alloc(len(src)))[::-1]"
         "  # BROKEN: the mapping disagrees with the copy"),
    ]),
    "13-conservation": ("conservation", [
        ("fsm/ledger.py", "        for g, ps in lists.items():\n            self._callers[g].difference_update(ps)",
         "        for g, ps in lists.items():  # BROKEN: freed pages stay the caller's too"),
    ]),
    "14-borrowed-pages-stay": ("borrowed_pages_stay", [
        ("fsm/guards.py", '"unborrowed": lambda n: n.borrow_ref == 0,', '"unborrowed": lambda n: True,  # BROKEN'),
        ("fsm/reclaim.py", "return (n.state in (NS.device, NS.backed) and n.lock_ref == 0 and n.borrow_ref == 0",
         "return (n.state in (NS.device, NS.backed) and n.lock_ref == 0  # BROKEN: borrows ignored"),
    ]),
    "15-exact-continuation-state": ("exact_continuation_state", [
        ("fsm/match.py", "            if i < d and has_checkpoint(nd.dev_ckpt, n_state):",
         "            if i < d:  # BROKEN: any device node ends a hit"),
    ]),
    "16-forward-fence": ("forward_fence", [
        ("spec/lifecycle.toml", 'dest = "retracted"\nguards = ["!has_own_writeback", "settled"]',
         'dest = "retracted"\nguards = ["!has_own_writeback"]  # BROKEN: retract with a pass out'),
        ("spec/lifecycle.toml", 'dest = "retracting"\nguards = ["has_own_writeback", "settled"]',
         'dest = "retracting"\nguards = ["has_own_writeback"]  # BROKEN'),
    ]),
}


def make(name: str) -> str:
    _, edits = BROKEN[name]
    texts: dict[str, str] = {}
    for path, old, new in edits:
        text = texts.get(path) or (REPO / path).read_text(encoding="utf-8")
        if text.count(old) != 1:
            raise SystemExit(f"{name}: {path}: the text to break occurs {text.count(old)} times")
        texts[path] = text.replace(old, new)
    out = []
    for path, text in texts.items():
        before = (REPO / path).read_text(encoding="utf-8").splitlines(keepends=True)
        out.extend(difflib.unified_diff(before, text.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=2))
    return "".join(out)


def main(argv: list[str]) -> int:
    for name in argv or sorted(BROKEN):
        (Path(__file__).parent / f"{name}.patch").write_text(make(name), encoding="utf-8")
        print(f"tests/broken/{name}.patch")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
