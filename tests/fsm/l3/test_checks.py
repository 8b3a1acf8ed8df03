"""The ``l3_*`` invariants (kvtier.fsm.l3.checks, ``L3Tier.check_invariants``): each check
names its invariant, the object or the tier, and what is wrong, on a tier corrupted in one
place."""

from __future__ import annotations

import pytest
from core_helpers import ack, h1, put
from l3_helpers import answer_at_once, backed, h1_tier, one_command, stored

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.l3 import L3Options, L3Tier, StoreResult

KEY = ("a", "b", "c")


def test_l3_checks_name_the_object_or_the_tier_and_what_is_wrong() -> None:
    """l3checks.py:22-32: an object whose op id is not its operation's, a put whose source
    node lost its pin (still host-visible), and fetching nodes of a get the tier does not
    have in flight are each reported under their invariant, naming the object (its key's
    first 12 characters and state) or the L3 tier."""
    t = h1_tier()
    backed(t.core, KEY)
    assert t.offer(KEY[:1], 0.0) == 1
    [o] = t.objects.values()
    label = t.keys_for(KEY[:1])[0][:12]
    assert o.label == label
    o.op_id = 7
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_ends_by_deadline", f"invariant 'l3_ends_by_deadline' violated "
                                                 f"by object {label} (putting): in put op 1 but putting")
    o.op_id = 1
    [n] = t.core.walk(KEY[:1])
    assert n.host_pin == 1 and n.state == "backed"
    n.host_pin = 0
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_put_source_pinned", f"invariant 'l3_put_source_pinned' "
                                                 f"violated by object {label} (putting): put 1 does not pin "
                                                 f"the host copies it reads")
    n.host_pin = 1
    t.check_invariants()
    t.core.fetches.reserve(t.core.root, ["zz"], 77)  # fetching nodes behind the tier's back
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by "
                                                 "the L3 tier: fetching nodes of get 77, which is not in flight")


def test_l3_checks_of_gets_and_of_objects_without_an_operation() -> None:
    """l3checks.py:33-50: a get whose fetching nodes are gone, an object fetched without the
    store's answer, and an object in flight that no operation lists are reported under
    their invariants, naming the object."""
    store = stored(KEY)
    t = h1_tier()
    label = t.keys_for(KEY)[0][:12]
    t.prefetch("r1", KEY, 0.0)
    t.complete(answer_at_once(store, one_command(t)), 0.0)
    get = one_command(t)
    o = t.objects[t.keys_for(KEY)[0]]
    o.store_answered = False
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_visible_by_answer", f"invariant 'l3_visible_by_answer' "
                                                 f"violated by object {label} (getting): fetched without the "
                                                 f"store's answer")
    o.store_answered = True
    t.check_invariants()
    t.core.fetches.settle(get.op_id, 3)  # the nodes settle behind the tier's back
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_get_invisible", f"invariant 'l3_get_invisible' violated by "
                                                 f"object {label} (getting): get 2 owns no fetching nodes")
    tp = h1_tier()
    backed(tp.core, KEY)
    tp.offer(KEY[:1], 0.0)
    [p] = tp.objects.values()
    tp.operations[1].objects.clear()  # no operation lists it any more
    p.op_id = 7
    with pytest.raises(InvariantViolation) as e:
        tp.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_ends_by_deadline", f"invariant 'l3_ends_by_deadline' violated "
                                                 f"by object {p.label} (putting): no operation in flight")


def _put_in_flight() -> tuple[L3Tier, object]:
    """An h1 core holding units abcd on the host (backed) with an L3 put of them in flight."""
    core = CacheCore(h1(), 16, 16)
    ack(core, core.writeback(put(core, tuple("abcd")).node))
    tier = L3Tier(core, L3Options(deadline_s=1.0))
    assert tier.offer(tuple("abcd"), 0.0) == 4
    (cmd,) = tier.poll_commands()
    op = tier.operations[cmd.op_id]
    assert [o.state for o in op.objects] == ["putting"] * 4 and op.receipt is not None
    tier.check_invariants()
    return tier, op


def _get_in_flight() -> tuple[L3Tier, object]:
    """A second instance whose prefetch of abcd (stored by the first) has its get in flight."""
    tier, op = _put_in_flight()
    tier.complete(StoreResult(op.op_id, ok=(True,) * 4), 0.0)
    core = CacheCore(h1(), 16, 16)
    other = L3Tier(core, L3Options(deadline_s=1.0))
    assert other.prefetch("r", tuple("abcd"), 0.0)
    (exists,) = other.poll_commands()
    other.complete(StoreResult(exists.op_id, present=4), 0.0)
    (get,) = other.poll_commands()
    gop = other.operations[get.op_id]
    assert [o.state for o in gop.objects] == ["getting"] * 4 and get.op_id in core.fetches
    other.check_invariants()
    return other, gop


def _violation(tier: L3Tier) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as exc:
        tier.check_invariants()
    return exc.value


def test_an_object_of_a_put_in_the_wrong_state_or_op_is_named() -> None:
    tier, op = _put_in_flight()
    o = op.objects[2]
    o.state = "leased"
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_ends_by_deadline", f"object {o.key[:12]} (leased)")
    assert str(e) == (f"invariant 'l3_ends_by_deadline' violated by object {o.key[:12]} (leased): "
                      f"in put op {op.op_id} but leased")
    o.state = "putting"
    o.op_id = op.op_id + 50  # the right state, another operation
    assert str(_violation(tier)) == (f"invariant 'l3_ends_by_deadline' violated by object {o.key[:12]} (putting): "
                                     f"in put op {op.op_id} but putting")


def test_a_put_that_does_not_pin_its_source_is_named_by_its_first_object() -> None:
    tier, op = _put_in_flight()
    first = op.objects[0]
    want = (f"invariant 'l3_put_source_pinned' violated by object {first.key[:12]} (putting): "
            f"put {op.op_id} does not pin the host copies it reads")
    (node,) = op.receipt.nodes
    node.host_pin = 0  # unpinned, still host-visible
    assert str(_violation(tier)) == want
    node.host_pin = 1
    state, node.state = node.state, "device"  # pinned, but no visible host copy
    assert str(_violation(tier)) == want
    node.state = state
    tier.check_invariants()
    op.receipt = None
    assert str(_violation(tier)) == want
    objects = list(op.objects)
    op.objects.clear()  # a put of nothing: the subject is the tier
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_put_source_pinned", "the L3 tier")
    assert str(e) == f"invariant 'l3_put_source_pinned' violated by the L3 tier: put {op.op_id} does not pin the host copies it reads"
    op.objects.extend(objects)


def test_a_get_without_fetching_nodes_or_the_stores_answer_is_named() -> None:
    tier, op = _get_in_flight()
    first = op.objects[0]
    op.objects[3].store_answered = False
    assert str(_violation(tier)) == (f"invariant 'l3_visible_by_answer' violated by object {first.key[:12]} "
                                     "(getting): fetched without the store's answer")
    op.objects[3].store_answered = True
    tier.check_invariants()
    tier.core.fetches.settle(op.op_id, 0)  # the core's get ended behind the tier's back
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_get_invisible", f"object {first.key[:12]} (getting)")
    assert str(e) == (f"invariant 'l3_get_invisible' violated by object {first.key[:12]} (getting): "
                      f"get {op.op_id} owns no fetching nodes")


def test_an_object_in_flight_without_its_operation_is_named() -> None:
    tier, op = _put_in_flight()
    o = op.objects.pop(1)  # no longer listed by its put
    tier.check_invariants()  # still listed by the put's op id
    o.op_id = op.op_id + 50
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_ends_by_deadline", f"object {o.key[:12]} (putting)")
    assert str(e) == f"invariant 'l3_ends_by_deadline' violated by object {o.key[:12]} (putting): no operation in flight"


def test_fetching_nodes_of_a_get_the_tier_did_not_issue_are_named() -> None:
    tier, op = _put_in_flight()
    assert tier.core.fetches.reserve(tier.core.root, ["q"], 77)  # a get the tier never issued
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_get_invisible", "the L3 tier")
    assert str(e) == "invariant 'l3_get_invisible' violated by the L3 tier: fetching nodes of get 77, which is not in flight"
