"""The argument checks shared by the core and the facade (kvtier.fsm.checks): exact
messages naming the value and its bounds, numpy integers and booleans turned into plain
values, and the first unhashable unit key named."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import says

from kvtier.fsm import ConfigError, UsageError
from kvtier.fsm.checks import as_bool, as_int, as_keys, as_text, check_hashable, plain_bool, plain_int


def test_as_bool_takes_numpy_bools_only_and_as_text_names_the_value() -> None:
    """checks.py:61, 77: a numpy bool is a bool (``numpy.bool`` in numpy 2, ``numpy.bool_``
    in numpy 1, stood in for by a class of that name and module), another numpy scalar is
    not; an empty text is refused naming the value."""
    import numpy as np

    from kvtier.fsm.checks import as_bool, as_text

    assert as_bool(np.bool_(True), "flag") is True and as_bool(np.bool_(False), "flag") is False
    numpy1_bool = type("bool_", (), {"__module__": "numpy", "__bool__": lambda self: True})
    assert as_bool(numpy1_bool(), "flag") is True
    with pytest.raises(UsageError) as e:
        as_bool(np.int64(1), "flag")
    assert str(e.value) == "flag must be True or False, got np.int64(1)"
    with pytest.raises(UsageError) as e:
        as_text("", "request id")
    assert str(e.value) == "request id must be a non-empty str, got ''"


def test_as_int_takes_zero_by_default_and_names_value_and_bounds() -> None:
    assert as_int(0, "x") == 0 and as_int(7, "x") == 7
    says(lambda: as_int(-1, "x"), "x must be an int >= 0, got -1")
    says(lambda: as_int(True, "x"), "x must be an int >= 0, got True")
    says(lambda: as_int("3", "x"), "x must be an int >= 0, got '3'")
    says(lambda: as_int(2.0, "x", error=ConfigError), "x must be an int >= 0, got 2.0", ConfigError)


def test_as_int_bounds_are_inclusive_and_each_may_be_absent() -> None:
    assert as_int(1, "x", minimum=1) == 1 and as_int(4, "x", maximum=4) == 4
    assert as_int(1, "x", minimum=1, maximum=1) == 1
    assert as_int(-5, "x", minimum=None) == -5 and as_int(-5, "x", minimum=None, maximum=4) == -5
    says(lambda: as_int(0, "x", minimum=1), "x must be an int >= 1, got 0")
    says(lambda: as_int(5, "x", minimum=0, maximum=4), "x must be an int in 0..4, got 5")
    says(lambda: as_int(-1, "x", minimum=0, maximum=4), "x must be an int in 0..4, got -1")
    says(lambda: as_int(5, "x", minimum=None, maximum=4), "x must be an int <= 4, got 5")
    says(lambda: as_int("a", "x", minimum=None), "x must be an int, got 'a'")


def test_as_int_and_plain_int_return_plain_ints_for_numpy_integers() -> None:
    v = as_int(np.int64(3), "x")
    assert v == 3 and type(v) is int
    p = plain_int(np.int32(5))
    assert p == 5 and type(p) is int
    assert plain_int(9) == 9 and type(plain_int(9)) is int
    assert plain_int(True) is None and plain_int(False) is None
    assert plain_int(2.0) is None and plain_int("2") is None


def test_plain_bool_takes_bools_and_numpy_booleans_only() -> None:
    assert plain_bool(True) is True and plain_bool(False) is False
    t, f = plain_bool(np.True_), plain_bool(np.False_)
    assert t is True and f is False
    old = type("bool_", (), {"__module__": "numpy", "__bool__": lambda self: True})  # numpy 1.x's name
    assert plain_bool(old()) is True
    other = type("bool", (), {"__module__": "elsewhere", "__bool__": lambda self: True})  # not numpy's
    assert plain_bool(other()) is None
    assert plain_bool(1) is None and plain_bool(0) is None and plain_bool(None) is None


def test_as_bool_returns_the_bool_and_refuses_anything_else_naming_it() -> None:
    assert as_bool(True, "flag") is True and as_bool(False, "flag") is False
    assert as_bool(np.True_, "flag") is True
    says(lambda: as_bool(1, "flag"), "flag must be True or False, got 1")
    says(lambda: as_bool(None, "flag", error=ConfigError), "flag must be True or False, got None", ConfigError)


def test_as_text_takes_non_empty_str_only() -> None:
    assert as_text("a", "name") == "a"
    says(lambda: as_text("", "name"), "name must be a non-empty str, got ''")
    says(lambda: as_text(5, "name"), "name must be a non-empty str, got 5")
    says(lambda: as_text(b"a", "name", error=ConfigError), "name must be a non-empty str, got b'a'", ConfigError)


def test_as_keys_takes_lists_and_tuples_of_hashables_and_names_the_first_bad_unit() -> None:
    keys = ["a", 1]
    assert as_keys(keys, "k") is keys and as_keys((), "k") == ()
    says(lambda: as_keys("ab", "k"), "k must be a list or tuple of unit keys, got 'ab'")
    says(lambda: as_keys(b"ab", "k"), "k must be a list or tuple of unit keys, got b'ab'")
    says(lambda: as_keys({1, 2}, "k"), "k must be a list or tuple of unit keys, got {1, 2}")  # type: ignore[arg-type]
    says(lambda: as_keys(["a", [1], {2}], "k"), "k: unit keys must be hashable, got [1]")
    says(lambda: check_hashable((1, {"a": 1}), "c", error=ConfigError), "c: unit keys must be hashable, got {'a': 1}",
          ConfigError)
    check_hashable([1, ("a", 2)], "c")


def test_as_time_refuses_an_int_past_a_float_s_range_naming_it() -> None:
    """An int too large for a float (10**400) is no finite number of seconds: refused with
    the caller's error naming it, as NaN is (it raised OverflowError from ``math.isfinite``)."""
    from kvtier.fsm.checks import as_time

    for big in (10**400, -10**400):
        says(lambda: as_time(big, "now"), f"now must be a finite number of seconds, got {big!r}")
        says(lambda: as_time(big, "now", infinite=True, error=ConfigError),
             f"now must be a finite number of seconds or inf, got {big!r}", ConfigError)
    assert as_time(2**1023, "now") == float(2**1023) and as_time(-5, "now") == -5.0
