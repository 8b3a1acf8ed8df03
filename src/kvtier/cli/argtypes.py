"""argparse value types shared by the command-line modules (clear messages, no tracebacks)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["positive_int", "int_in_range", "positive_float", "float_in_range", "fraction"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def int_in_range(low: int, high: int) -> Callable[[str], int]:
    """argparse type: an int in ``low .. high``."""

    def parse(text: str) -> int:
        v = _int(text)
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be between {low} and {high}")
        return v

    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    v = _float(text)
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return v


def float_in_range(low: float, high: float) -> Callable[[str], float]:
    """argparse type: a finite float in ``low .. high``."""

    def parse(text: str) -> float:
        v = _float(text)
        if not math.isfinite(v) or not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number between {low:g} and {high:g}")
        return v

    return parse


def fraction(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    v = _float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 1")
    return v
