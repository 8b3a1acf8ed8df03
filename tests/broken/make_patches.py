"""Regenerate the deliberately broken variants from the current sources: each is a small
text replacement in fsm/, spec/, src/kvtier/ or transfer/, written as a unified diff with
two lines of context (so it keeps applying while the code around it moves).

Two tables:

- :data:`BROKEN`: one broken rule per invariant of invariants.md (``tests/broken/*.patch``,
  each caught by a sequence of ``tests/regressions/*.json``).
- :data:`SEMANTIC`: realistic lifecycle bugs, not operator swaps (issue 12,
  ``tests/broken/semantic/*.patch``), each with the tests that catch it (pytest node
  ids; ``tests/test_semantic_mutants.py`` proves they do, ``bench/semantic_mutants.py``
  measures what ``kvtier fuzz`` alone catches).

    python tests/broken/make_patches.py            # rewrite every patch of both tables
    python tests/broken/make_patches.py NAME ...   # rewrite these
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]

#: patch name -> (invariant it breaks, [(file, old text, new text), ...])
BROKEN: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "01-root-closed-host": ("root_closed_host", [
        ("fsm/lifecycle/guards.py", '"parent_on_host": lambda n: bool(n.parent_on_host),',
         '"parent_on_host": lambda n: True,  # BROKEN'),
        ("fsm/node/writeback.py", "            if p.parent is None or p.state in HOST_VISIBLE or p.node_id in taken:\n"
         "                out.append(n)",
         "            if (p.parent is None or p.state in HOST_VISIBLE or p.node_id in taken\n"
         "                    or p.state == NODE_STATE.writing):  # BROKEN\n"
         "                out.append(n)  # a child is written back before its parent's copy is acknowledged"),
    ]),
    "02-host-means-acked": ("host_means_acked", [
        ("fsm/node/transfers.py", "            n.pending = self._reserve(transfers, n.dev)",
         "            n.host = self._reserve(transfers, n.dev)  # BROKEN: visible at once"),
    ]),
    "03-writeback-source-immutable": ("writeback_source_immutable", [
        ("fsm/node/reclaim.py", "return (n.state in (NS.device, NS.backed) and n.lock_ref == 0 and n.borrow_ref == 0",
         "return (n.state in (NS.device, NS.backed, NS.writing) and n.lock_ref == 0 and n.borrow_ref == 0"),
        ("fsm/node/reclaim.py", "            if n.state == NS.backed:\n                n = self._tail(n, need, freed)",
         "            if n.state == NS.writing:  # BROKEN: frees the source of a copy in flight\n"
         "                for g, k in self._release_device(n).items():\n"
         "                    freed[g] += k\n"
         "                continue\n"
         "            if n.state == NS.backed:\n                n = self._tail(n, need, freed)"),
    ]),
    "04-loadback-source-pinned": ("loadback_source_pinned", [
        ("fsm/lifecycle/guards.py", '"unpinned": lambda n: n.host_pin == 0,', '"unpinned": lambda n: True,  # BROKEN'),
        ("fsm/node/reclaim.py", "return (n.state in (NS.host, NS.backed) and n.host_pin == 0 and not n.has_host_child",
         "return (n.state in (NS.host, NS.backed) and not n.has_host_child  # BROKEN: pins ignored"),
    ]),
    "05-counts-with-receipts": ("counts_with_receipts", [
        ("fsm/node/receipts.py", "        for n in path:\n            n.lock_ref += 1\n            if owner is None",
         "        for n in path[:1]:  # BROKEN: the ancestors are not counted\n"
         "            n.lock_ref += 1\n            if owner is None"),
    ]),
    "06-split-preserves-ownership": ("split_preserves_ownership", [
        ("fsm/node/optable.py", "            op.nodes.insert(op.nodes.index(node), prefix)",
         "            pass  # BROKEN: the new fragment is not part of the operation"),
    ]),
    "07-operation-ends-once": ("operation_ends_once", [
        ("fsm/node/optable.py", "        if key in op.seen or c.rank in op.acked:",
         "        if False:  # BROKEN: duplicate completions are accepted"),
    ]),
    "08-release-once-after-fence": ("release_once_after_fence", [
        ("fsm/request/ends.py", '        r.poisoned = True\n        self.table.fire(r, RE.abort)',
         '        r.poisoned = True\n        self.table.fire(r, RE.abort)\n'
         '        if r.state == "aborting":  # BROKEN: released before its work in flight ended\n'
         '            self.table.free_own(r)'),
    ]),
    "09-host-evict-leaves": ("host_evict_leaves", [
        ("fsm/lifecycle/guards.py", '"has_host_child": lambda n: bool(n.has_host_child),',
         '"has_host_child": lambda n: False,  # BROKEN'),
        ("fsm/node/reclaim.py", "return (n.state in (NS.host, NS.backed) and n.host_pin == 0 and not n.has_host_child",
         "return (n.state in (NS.host, NS.backed) and n.host_pin == 0  # BROKEN: inner nodes too"),
    ]),
    "10-failure-not-success": ("failure_not_success", [
        ("fsm/node/transfers.py", "                if not ok:\n                    if fence:",
         "                if False:  # BROKEN: a failed loadback is reported as success\n"
         "                    if fence:"),
        ("fsm/node/transfers.py", "                store.trigger(n, EV.loadback_ack if ok else EV.loadback_fail)",
         "                store.trigger(n, EV.loadback_ack)"),
    ]),
    "11-atomic-admission": ("atomic_admission", [
        ("fsm/request/admission.py", "        except CapacityError:\n            if hold is not None:\n"
                                 "                core.unlock(hold)\n            return None",
         "        except CapacityError:\n            return None  # BROKEN: the device-hit lock is not rolled back"),
    ]),
    "12-loaded-equals-written": ("loaded_equals_written", [
        ("fsm/node/transfers.py", "                n.dev[g] = self._move(transfers, g, src, store.device[g].alloc(len(src)))",
         "                n.dev[g] = self._move(transfers, g, src, store.device[g].alloc(len(src)))[::-1]"
         "  # BROKEN: the mapping disagrees with the copy"),
    ]),
    "13-conservation": ("conservation", [
        ("fsm/node/ledger.py", "        for g, ps in lists.items():\n            self._callers[g].difference_update(ps)",
         "        for g, ps in lists.items():  # BROKEN: freed pages stay the caller's too"),
    ]),
    "14-borrowed-pages-stay": ("borrowed_pages_stay", [
        ("fsm/lifecycle/guards.py", '"unborrowed": lambda n: n.borrow_ref == 0,', '"unborrowed": lambda n: True,  # BROKEN'),
        ("fsm/node/reclaim.py", "return (n.state in (NS.device, NS.backed) and n.lock_ref == 0 and n.borrow_ref == 0",
         "return (n.state in (NS.device, NS.backed) and n.lock_ref == 0  # BROKEN: borrows ignored"),
    ]),
    "15-exact-continuation-state": ("exact_continuation_state", [
        ("fsm/node/match.py", "            if i < d and has_checkpoint(nd.dev_ckpt, n_state):",
         "            if i < d:  # BROKEN: any device node ends a hit"),
    ]),
    "16-forward-fence": ("forward_fence", [
        ("spec/lifecycle.toml", 'dest = "retracted"\nguards = ["!has_own_writeback", "settled"]',
         'dest = "retracted"\nguards = ["!has_own_writeback"]  # BROKEN: retract with a pass out'),
        ("spec/lifecycle.toml", 'dest = "retracting"\nguards = ["has_own_writeback", "settled"]',
         'dest = "retracting"\nguards = ["has_own_writeback"]  # BROKEN'),
    ]),
}


class Mutant(NamedTuple):
    """A semantic mutant: a realistic lifecycle bug and the tests that catch it."""

    area: str  #: "fsm-core" (node core), "fsm-request" (request lifecycle), "facade", "transfer"
    bug: str  #: what goes wrong, in one sentence
    catchers: tuple[str, ...]  #: pytest node ids (from the repository root) that fail with it
    edits: list[tuple[str, str, str]]  #: (file, old text, new text)


_C = "tests/test_semantic_catchers.py::"


def _seq(name: str) -> str:
    """The catcher that replays ``tests/regressions/semantic/<name>.json`` (expects a pass)."""
    return f"{_C}test_sequence_passes[{name}]"


#: mutant name -> :class:`Mutant` (patches in tests/broken/semantic/)
SEMANTIC: dict[str, Mutant] = {
    # -- node core (fsm/) -------------------------------------------------------------------
    "s01-chunk-ckpt-drops-writing-ancestor": Mutant(
        "fsm-core", "a deeper chunk checkpoint drops an ancestor's chunk checkpoint while that "
        "ancestor's writeback (which reads it) is in flight",
        (f"{_C}test_deeper_chunk_checkpoint_keeps_one_being_written",),
        [("fsm/node/publish.py", "if (a.chunk_checkpoint and a.state in (NS.device, NS.backed) and a.lock_ref <= 1",
          "if (a.chunk_checkpoint and a.state in (NS.device, NS.backed, NS.writing) and a.lock_ref <= 1"
          "  # BROKEN")]),
    "s02-exact-eviction-frees-prefix": Mutant(
        "fsm-core", "exact eviction splits the victim leaf but frees the prefix fragment (an inner "
        "node) instead of the tail",
        (_seq("s02-exact-eviction-frees-prefix"),),
        [("fsm/node/reclaim.py", "        if k < units:\n            self.store.split(n, units - k)  # n keeps the last k units\n"
                                 "        return n",
          "        if k < units:\n            return self.store.split(n, units - k)  # BROKEN: frees the prefix fragment\n"
          "        return n")]),
    "s03-exclusive-drops-pinned-duplicate": Mutant(
        "fsm-core", "an exclusive host tier drops a loaded-back node's duplicate host copy even "
        "while it is pinned (or has a host child)",
        (f"{_C}test_exclusive_host_tier_keeps_pinned_duplicates",),
        [("fsm/node/reclaim.py", "            if not self.host_victim(n):\n                continue\n"
                                 "            n = self._tail(n, need, freed)\n            got = store.ledger.release_host",
          "            if not self.host_victim(n) and not (store.exclusive and n.reloaded and n.state == NS.backed):\n"
          "                continue  # BROKEN: a duplicate copy is always droppable\n"
          "            n = self._tail(n, need, freed)\n            got = store.ledger.release_host")]),
    "s04-op-pin-not-split": Mutant(
        "fsm-core", "splitting a loading node moves the receipts' nodes but not the loadback's own "
        "pin (receipt -op_id) onto the new prefix fragment",
        (_seq("s04-op-pin-not-split"), f"{_C}test_split_of_a_loading_node_pins_both_fragments"),
        [("fsm/node/receipts.py", "        for rid in node.refs:\n            prefix.add_ref(rid)",
          "        for rid in node.refs:\n            if rid < 0:\n"
          "                continue  # BROKEN: an operation's own pin stays on the cut node only\n"
          "            prefix.add_ref(rid)")]),
    "s05-reuse-counted-by-locks": Mutant(
        "fsm-core", "every lock counts a reuse, so one request re-locking its path at each publish "
        "looks like many requests (selective write-through backs up one-off prompts)",
        (f"{_C}test_reuse_counts_distinct_requests",),
        [("fsm/node/receipts.py", "            if owner is None or owner != n.last_owner:",
          "            if True:  # BROKEN: every lock counts a reuse")]),
    "s06-lru-unlock-no-stamp": Mutant(
        "fsm-core", "an unlock does not stamp the path, so LRU goes by lock time: a long-running "
        "request's prefix is evicted before one released earlier",
        (f"{_C}test_lru_goes_by_release_time",),
        [("fsm/node/receipts.py", "            if stamp is not None:\n                n.last_access = stamp\n"
                             "            if n.lock_ref == 0:",
          "            if n.lock_ref == 0:  # BROKEN: the unlock does not stamp the path")]),
    "s07-layer-progress-fastest-rank": Mutant(
        "fsm-core", "a loadback's layer progress is taken from the fastest rank, not the slowest",
        (f"{_C}test_layer_progress_waits_for_every_rank",),
        [("fsm/node/optable.py", "        return min(op.layers.get(r, -1) for r in range(self.world_size))",
          "        return max(op.layers.get(r, -1) for r in range(self.world_size))  # BROKEN: fastest rank")]),
    "s08-queued-child-dropped": Mutant(
        "fsm-core", "a node queued behind its parent's writeback in flight is dropped from the "
        "queue instead of waiting: its writeback is never issued",
        (f"{_C}test_queued_child_is_issued_after_its_parent",),
        [("fsm/node/writeback.py", "            elif p.state == NODE_STATE.device and p.node_id not in self._queue:",
          "            elif p.node_id not in self._queue:  # BROKEN: also drops nodes whose parent is being written")]),
    "s09-load-refusal-leaks-pin": Mutant(
        "fsm-core", "a loadback refused for lack of device pages keeps the host pin it took",
        (_seq("s09-load-refusal-leaks-pin"),),
        [("fsm/node/transfers.py", "            free = store.device[g].free\n            store.receipts.release(pin)\n",
          "            free = store.device[g].free  # BROKEN: the pin is not rolled back\n")]),
    "s10-failed-loadback-keeps-checkpoint": Mutant(
        "fsm-core", "a failed loadback frees the history pages it reserved but keeps the "
        "checkpoint's destination pages on a node now only on the host",
        (_seq("s10-failed-loadback-keeps-checkpoint"),),
        [("fsm/node/transfers.py", "                    if n is op.checkpoint:\n"
                              "                        if fence:\n"
                              "                            _keep(op.fenced_dev, n.dev_ckpt)\n"
                              "                        else:\n"
                              "                            store.ledger.release_device(n.dev_ckpt)\n"
                              "                        n.dev_ckpt = {}",
          "                    if n is op.checkpoint:\n"
          "                        pass  # BROKEN: the checkpoint's device pages are kept")]),
    "s11-selective-queues-backed": Mutant(
        "fsm-core", "write_through_selective queues a hot node for writeback although it already "
        "has a host copy (backed)",
        (_seq("s11-selective-queues-backed"),),
        [("fsm/node/writeback.py", "                and node.hit_count >= self.threshold and node.state == NODE_STATE.device):",
          "                and node.hit_count >= self.threshold):  # BROKEN: backed nodes too")]),
    # -- request lifecycle (fsm/) --------------------------------------------------------------
    "s12-layer-ready-off-by-one": Mutant(
        "fsm-request", "layer_ready confuses a layer count with a layer index: the layer after "
        "the last loaded one reads as ready",
        (f"{_C}test_layer_ready_is_exact",),
        [("fsm/request/completions.py", "            if done < layer:\n                return False",
          "            if done + 1 < layer:  # BROKEN: count vs index\n                return False")]),
    "s13-joined-layers-fastest-rank": Mutant(
        "fsm-request", "a request joining a loadback in flight takes its layer progress from the "
        "fastest rank",
        (f"{_C}test_joined_loadback_layers_from_the_slowest_rank",),
        [("fsm/request/admission.py", "                r.layers[op] = min(ops[op].layers.get(k, -1) for k in range(core.world_size))",
          "                r.layers[op] = max(ops[op].layers.get(k, -1) for k in range(core.world_size))"
          "  # BROKEN")]),
    "s14-double-release-after-success": Mutant(
        "fsm-request", "a successful loadback releases the request's pins but keeps them on its "
        "record: the release at its end releases them again",
        (_seq("s14-double-release-after-success"),),
        [("fsm/request/completions.py", "                self.core.release(pin)\n            r.pins = []\n"
                                "            t.fire(r, RE.loadback_ack)",
          "                self.core.release(pin)\n            t.fire(r, RE.loadback_ack)  # BROKEN: pins stay listed")]),
    "s15-aborted-writeback-published": Mutant(
        "fsm-request", "abort does not poison the request's own writeback in flight: its possibly "
        "corrupt KV is published on the ack",
        (f"{_C}test_aborted_request_writeback_is_not_published",),
        [("fsm/request/ends.py", "        for op in own:\n            self.core.poison(op)",
          "        for op in own:\n            pass  # BROKEN: not poisoned")]),
    "s16-whole-prompt-reused": Mutant(
        "fsm-request", "a fully cached, aligned prompt is reused whole: no token is left to compute "
        "the first logits from",
        (f"{_C}test_whole_prompt_is_never_reused",),
        [("fsm/request/admission.py", "        usable = (prompt_tokens - 1) // t.align",
          "        usable = prompt_tokens // t.align  # BROKEN: the whole prompt may be a hit")]),
    "s17-fence-broken-on-loadback-failure": Mutant(
        "fsm-request", "a loadback that fails while the request's pass is out lets go of the lock "
        "at once, though the pass still reads the device hit",
        (_seq("s17-fence-broken-on-loadback-failure"),),
        [("fsm/request/completions.py", "        if not r.settled:\n            self._keep_held_prefix(r)\n"
                                "        t.fire(r, RE.loadback_fail)",
          "        if not r.settled and r.lock is not None:\n"
          "            self.core.unlock(r.lock)  # BROKEN: the pass out still reads the hit\n"
          "        t.fire(r, RE.loadback_fail)")]),
    "s18-deferred-frees-released-early": Mutant(
        "fsm-request", "frees deferred until a later pass returns are released at the first "
        "result (overlapped scheduling: the next pass still reads them)",
        (f"{_C}test_deferred_frees_wait_for_their_pass",),
        [("fsm/request/table.py", "        while r.deferred and r.deferred[0][0] <= r.results:",
          "        while r.deferred:  # BROKEN: every deferred free goes at the next result")]),
    "s19-fenced-layers-readable": Mutant(
        "fsm-request", "a failed loadback clears what the request waited on but does not mark its "
        "layers failed: a fenced request reads every layer as ready",
        (_seq("s17-fence-broken-on-loadback-failure"),),
        [("fsm/request/completions.py", "        t.stop_waiting(r)\n        r.layers_failed = True\n        if not r.settled:",
          "        t.stop_waiting(r)  # BROKEN: layers not marked failed\n        if not r.settled:")]),
    "s20-publish-leaks-old-lock": Mutant(
        "fsm-request", "publishing moves the request's lock to the new terminal without releasing "
        "the old lock",
        (_seq("s20-publish-leaks-old-lock"),),
        [("fsm/request/forward.py", "            new_lock = core.lock(result.node, r.request_id)\n"
                            "            if r.lock is not None:\n                core.unlock(r.lock)\n"
                            "            r.lock = new_lock",
          "            r.lock = core.lock(result.node, r.request_id)  # BROKEN: the old lock leaks")]),
    "s21-finish-forgets-own-writeback": Mutant(
        "fsm-request", "finish starts the request's own writeback but does not wait on it: the "
        "request stays finishing forever and never releases",
        (_seq("s21-finish-forgets-own-writeback"),),
        [("fsm/request/ends.py", "        self.table.fire(r, RE.finish)\n        self._wait_own(r, cmd)\n",
          "        self.table.fire(r, RE.finish)  # BROKEN: its own writeback is not waited on\n")]),
    "s22-overlapped-reserve-restarts": Mutant(
        "fsm-request", "a pass reserved while the previous one is out starts where the computed "
        "tokens end, so it reserves no new room",
        (f"{_C}test_overlapped_reserve_starts_after_the_pass_out",),
        [("fsm/request/admission.py", "        start = r.reserved if r.passes > r.results else r.tokens",
          "        start = r.tokens  # BROKEN: ignores the pass out"),
         ("fsm/request/admission.py", "        upto = (r.reserved if r.passes > r.results else r.tokens) + tokens",
          "        upto = r.tokens + tokens  # BROKEN: ignores the pass out")]),
    # -- facade (src/kvtier/tiered.py) ---------------------------------------------------------
    "s23-poll-quota-off-by-one": Mutant(
        "facade", "poll counts the batch it is about to issue against the writeback quota: with "
        "a quota of one, queued tree writebacks are never issued",
        (f"{_C}test_poll_issues_tree_writebacks_at_quota_one",),
        [("src/kvtier/tiered.py", "            room = self.max_writebacks_in_flight - core.ops_in_flight(Direction.WRITEBACK)",
          "            room = self.max_writebacks_in_flight - core.ops_in_flight(Direction.WRITEBACK) - 1  # BROKEN")]),
    "s24-expired-ops-not-routed": Mutant(
        "facade", "advance_step fails expired operations in the core but does not route them: "
        "their requests wait forever on ended operations",
        (_seq("s24-expired-ops-not-routed"),),
        [("src/kvtier/tiered.py", "        for s in self.core.advance_step(steps):\n            self._router.on_core_event(s)",
          "        self.core.advance_step(steps)  # BROKEN: expired operations are not routed")]),
    "s25-in-flight-ignores-passes": Mutant(
        "facade", "in_flight() forgets forward passes out, so a scheduler drains and stops with "
        "results still owed",
        (f"{_C}test_in_flight_counts_passes_out",),
        [("src/kvtier/tiered.py", "        return bool(self.core.ops_in_flight()) or self._table.owes_forward()",
          "        return bool(self.core.ops_in_flight())  # BROKEN: passes out are forgotten")]),
    # -- transfer/ -------------------------------------------------------------------------------
    "s26-failed-issue-no-barrier": Mutant(
        "transfer", "no barrier after a failed issue: the failure is acknowledged before the "
        "half-issued copies finish, and their pages are reused under them",
        (f"{_C}test_failed_issue_waits_for_half_issued_copies",),
        [("transfer/engine.py", "            counter.error = e\n"
                                "            try:  # the ack waits for whatever was issued before the failure\n"
                                "                counter.events.append(self.backend.record(direction))\n"
                                "            except Exception:\n                pass\n            return False",
          "            counter.error = e  # BROKEN: no barrier after the failure\n            return False")]),
    "s27-layer-reported-before-chunk": Mutant(
        "transfer", "poll_completions reports a chunk's layers as loaded while the chunk is still "
        "running (the next chunk after the completed ones)",
        ("tests/transfer/test_transfer_engine.py::test_layer_completions_follow_chunks_then_one_ack",
         f"{_C}test_layers_are_reported_only_after_their_chunk"),
        [("transfer/engine.py", "                while op.reported < len(op.chunks) and op.chunks[op.reported][0] < ok:",
          "                while op.reported < len(op.chunks) and op.chunks[op.reported][0] <= ok:  # BROKEN")]),
    "s28-wait-layer-chunk-off-by-one": Mutant(
        "transfer", "wait_layer maps a layer that starts a chunk to the chunk before it, so the "
        "forward pass reads that layer before it is loaded",
        ("tests/transfer/test_transfer_engine.py::test_destinations_are_poisoned_until_complete_and_waits_are_checked",
         f"{_C}test_wait_layer_waits_for_the_chunk_holding_the_layer"),
        [("transfer/layers.py", "        i = bisect.bisect_right([c[1] for c in self.chunks], layer)",
          "        i = bisect.bisect_left([c[1] for c in self.chunks], layer)  # BROKEN")]),
    "s29-failed-chunk-layers-reported": Mutant(
        "transfer", "a chunk whose copy fails still has its layers reported as loaded (the "
        "failed ack comes only at the end)",
        ("tests/transfer/test_transfer_engine.py::test_copy_failures_become_failed_acks",
         f"{_C}test_failed_chunk_layers_are_never_reported"),
        [("transfer/layers.py", "                self.error = err\n"
                                "                self.ok_limit = self.done_events  # chunks before this event succeeded\n",
          "                self.error = err  # BROKEN: later chunks still count as loaded\n")]),
}


def make(name: str) -> str:
    edits = SEMANTIC[name].edits if name in SEMANTIC else BROKEN[name][1]
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


def patch_path(name: str) -> Path:
    """Where the patch of ``name`` (either table) lives."""
    here = Path(__file__).parent
    return here / "semantic" / f"{name}.patch" if name in SEMANTIC else here / f"{name}.patch"


def main(argv: list[str]) -> int:
    for name in argv or [*sorted(BROKEN), *sorted(SEMANTIC)]:
        if name not in BROKEN and name not in SEMANTIC:
            raise SystemExit(f"unknown broken variant {name!r}")
        path = patch_path(name)
        path.parent.mkdir(exist_ok=True)
        path.write_text(make(name), encoding="utf-8")
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
