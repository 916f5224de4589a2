"""Argument checks of the Python layer: integers are integers (int, numpy integer or anything with
``__index__``; never a float, a string or a bool), numbers are real numbers (never a string), and
every rejection is an :class:`fmkv.FmkvError` naming the argument -- a :class:`fmkv.FmkvTypeError`
(also a ``TypeError``) for a wrong type, a plain FmkvError (a ``ValueError``) for a value out of
range -- with ``.code`` / ``.status`` set like the library's own errors.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional

from . import _fmkv
from ._fmkv import FmkvError, FmkvTypeError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1


def error(message: str, status: str = "INVALID_ARGUMENT", cls: type = FmkvError) -> FmkvError:
    """An FmkvError (or subclass) carrying ``status`` and its code, ready to raise."""
    e = cls(message)
    e.code, e.status = _fmkv.STATUS_CODES[status], status
    return e


def type_error(name: str, expected: str, value: Any) -> FmkvTypeError:
    shown = f" {value!r:.60}" if isinstance(value, (numbers.Number, str, bytes)) or value is None else ""
    return error(f"{name} must be {expected}, got {type(value).__name__}{shown}", cls=FmkvTypeError)


def integer(name: str, value: Any, lo: Optional[int] = -INT64_MAX - 1, hi: Optional[int] = INT64_MAX,
            status: str = "INVALID_ARGUMENT") -> int:
    """``value`` as a Python int in [lo, hi] (default: int64, what the binding takes; None: unbounded)."""
    if isinstance(value, bool):
        raise type_error(name, "an integer", value)
    try:
        v = operator.index(value)
    except TypeError:
        raise type_error(name, "an integer", value) from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        lo_s = "" if lo is None else f"{lo}"
        hi_s = "" if hi is None else f"{hi}"
        raise error(f"{name} must be in [{lo_s}, {hi_s}], got {v}", status)
    return v


def index(name: str, value: Any, what: str) -> int:
    """A sequence or layer index: an integer; one outside int64 names the missing ``what``."""
    v = integer(name, value, None, None)
    if not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise error(f"{what} {v} does not exist", "OUT_OF_RANGE")
    return v


def real(name: str, value: Any, finite: bool = True) -> float:
    """``value`` as a float: an int, float or numpy real; finite unless ``finite=False``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise type_error(name, "a real number", value)
    v = float(value)
    if finite and not math.isfinite(v):
        raise error(f"{name} must be finite, got {v}")
    return v


def string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise type_error(name, "a string", value)
    return value


def width_pair(where: str, p: Any) -> tuple:
    """``p`` as a (k_bits, v_bits) tuple of two integers (an FmkvError naming ``where`` otherwise; the widths
    themselves are checked by fmkv.Config)."""
    try:
        t = tuple(p)
    except TypeError:
        t = None
    if t is None or len(t) != 2 or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in t):
        raise error(f"{where} = {p!r} is not a (k_bits, v_bits) pair of integers")
    return (int(t[0]), int(t[1]))

