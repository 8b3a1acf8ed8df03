"""Argument checks shared by the core and the facade: one place, one wording.

Every integer argument goes through :func:`as_int`, which accepts anything
``operator.index`` accepts (``int``, ``numpy.int64``, ...) except ``bool``, and
raises the caller's error class with a message that names the value.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Hashable, Sequence
from itertools import chain
from typing import cast

from .errors import ConfigError, KvtierError, UsageError

__all__ = ["as_int", "as_time", "finite", "plain_int", "plain_bool", "as_bool", "as_text", "as_keys", "check_key_sequence", "check_hashable", "check_comparable", "ConfigError", "UsageError"]


def as_int(value: object, what: str, *, minimum: int | None = 0, maximum: int | None = None,
           error: type[KvtierError] = UsageError) -> int:
    """``value`` as a plain ``int``, checked against ``minimum`` and ``maximum`` (inclusive).

    Args:
        value: the value given (``int`` or any integer type ``operator.index`` accepts).
        what: how the message names it, e.g. ``"reserve: tokens"``.
        minimum: the lower bound (``None``: unbounded).
        maximum: the upper bound (``None``: unbounded).
        error: the error class to raise (``UsageError`` for calls, ``ConfigError`` for
            configuration).

    Raises:
        error: ``value`` is a bool, not an integer, or out of bounds.
    """
    if isinstance(value, bool):
        raise error(f"{what} must be an int{_bounds(minimum, maximum)}, got {value!r}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{what} must be an int{_bounds(minimum, maximum)}, got {value!r}") from None
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise error(f"{what} must be an int{_bounds(minimum, maximum)}, got {value!r}")
    return v


def as_time(value: object, what: str, *, infinite: bool = False, error: type[KvtierError] = UsageError) -> float:
    """``value`` as a ``float`` if it is a finite real number (``int``, ``float``, ``numpy``
    scalars; a bool, NaN or an infinity raises ``error``; ``+inf`` too unless ``infinite``):
    a clock reading or a duration in seconds. An operation stamped at NaN never expires."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not (finite(value) or (infinite and value == math.inf))):
        raise error(f"{what} must be a finite number of seconds{' or inf' if infinite else ''}, got {value!r}")
    return float(value)


def finite(value: object) -> bool:
    """Whether ``math.isfinite(value)``, for a number; ``False`` where it would raise (an int
    past a float's range, 10**400, or anything that is not a number). Never raises."""
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except (OverflowError, TypeError, ValueError):
        return False


def plain_int(value: object) -> int | None:
    """``value`` as a plain ``int`` if ``operator.index`` accepts it (``numpy`` integers
    too), else ``None`` (a bool, a float, a str, ...). Never raises."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def plain_bool(value: object) -> bool | None:
    """``value`` as a plain ``bool`` if it is one (``numpy.bool_`` too), else ``None``."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    return None


def as_bool(value: object, what: str, *, error: type[KvtierError] = UsageError) -> bool:
    """``value`` if it is a ``bool`` (``numpy.bool_`` too); anything else raises ``error``."""
    v = plain_bool(value)
    if v is None:
        raise error(f"{what} must be True or False, got {value!r}")
    return v


def as_text(value: object, what: str, *, error: type[KvtierError] = UsageError) -> str:
    """``value`` if it is a non-empty ``str``; anything else raises ``error``."""
    if not isinstance(value, str) or not value:
        raise error(f"{what} must be a non-empty str, got {value!r}")
    return value


#: the sequence types checked without an ABC ``isinstance`` (the common case)
_LIST_TUPLE = (list, tuple)


def as_keys(value: Sequence[Hashable], what: str, *, error: type[KvtierError] = UsageError) -> Sequence[Hashable]:
    """``value`` if it is a list or tuple (not a str or bytes) of hashable unit keys whose
    hash and ``==`` do not raise (:func:`check_hashable`, :func:`check_comparable`)."""
    if type(value) not in _LIST_TUPLE and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
        raise error(f"{what} must be a list or tuple of unit keys, got {value!r}")
    # the common case in C-level passes (check_hashable's and check_comparable's own first
    # tests); anything else takes them, which name the key that is wrong
    try:
        hash(value if type(value) is tuple else tuple(value))
    except Exception:
        check_hashable(value, what, error=error)
    kinds = set(map(type, value))
    if not (kinds <= _PLAIN_KEYS
            or (kinds == _TUPLE and _PLAIN_KEYS.issuperset(map(type, chain.from_iterable(value))))):  # type: ignore[arg-type]
        check_comparable(value, what, error=error)
    return value


def check_key_sequence(value: object, what: str) -> None:
    """Raise UsageError unless ``value`` is a sequence of unit keys (a str or bytes is
    refused: its characters are not units)."""
    if type(value) not in _LIST_TUPLE and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
        raise UsageError(f"{what} must be a sequence of unit keys (not a str or bytes), got {value!r}")


#: Unit key types whose hash and ``==`` never raise: the radix tree compares them unprobed.
_PLAIN_KEYS = frozenset({int, str, bytes})
_TUPLE = {tuple}
_PROBE = object()


def check_hashable(value: Sequence[Hashable], what: str, *, error: type[KvtierError] = UsageError) -> None:
    """Raise ``error`` naming the first unit of ``value`` that cannot be hashed, or whose
    hash raises (a radix tree's children are found by hashing unit keys)."""
    try:
        hash(value if isinstance(value, tuple) else tuple(value))  # one C-level pass
    except Exception as first:  # a key's own __hash__ (or the sequence's iteration) may raise anything
        try:
            keys = list(value)
        except Exception as exc:
            raise error(f"{what}: the unit keys could not be read: {type(exc).__name__}: {exc}") from exc
        for u in keys:
            try:
                hash(u)
            except TypeError:
                raise error(f"{what}: unit keys must be hashable, got {u!r}") from None
            except Exception as exc:
                raise error(f"{what}: a unit key's hash raised {type(exc).__name__}: {exc}") from exc
        raise error(f"{what}: the unit keys could not be hashed: {type(first).__name__}: {first}") from first


def check_comparable(value: Sequence[Hashable], what: str, *, error: type[KvtierError] = UsageError) -> None:
    """Raise ``error`` naming the first unit key of ``value`` whose ``==`` (or the truth of
    its result) raises: the radix tree compares unit keys with ``==``, and such a key is
    refused before anything changes. Keys of other types than int, str, bytes and tuples
    of those are probed once each (``==`` with itself and with a foreign object, and the
    truth of each result; a tuple's elements one by one)."""
    kinds = set(map(type, value))
    if kinds <= _PLAIN_KEYS:
        return  # plain keys (the common case: one C-level pass)
    if kinds == _TUPLE and _PLAIN_KEYS.issuperset(map(type, chain.from_iterable(cast("Sequence[tuple[Hashable, ...]]", value)))):
        return  # tuples of plain keys
    for u in value:
        if type(u) not in _PLAIN_KEYS:
            try:
                _probe(u)
            except Exception as exc:  # a key's own __eq__ or __bool__ may raise anything
                raise error(f"{what}: a unit key's == raised {type(exc).__name__}: {exc} "
                            f"(unit keys must compare without raising), got a {type(u).__name__}") from exc


def _probe(u: object) -> None:
    """Compare ``u`` with itself and with a foreign object, and take the truth of each
    result (a tuple's elements one by one: tuple comparison skips identical elements)."""
    if type(u) is tuple:
        for x in u:
            if type(x) not in _PLAIN_KEYS:
                _probe(x)
        return
    bool(u == u)
    bool(u == _PROBE)
    bool(_PROBE == u)


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""
