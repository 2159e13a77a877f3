"""Total parsing of untrusted JSON: bounded size, depth and numbers; every failure is one ``ValueError``.

Everything a worker writes is hostile to the trainer. ``json.loads`` alone is not a total function:
deeply nested arrays raise ``RecursionError``, ``1`` followed by hundreds of zeros becomes an integer
that ``float()`` refuses with ``OverflowError``, ``1e999`` parses to infinity and ``NaN`` parses at all.
``loads_bounded`` checks the nesting depth before parsing, refuses oversize numbers, non-finite floats
and the ``NaN``/``Infinity`` constants, and raises nothing but ``ValueError``. The ``field_*`` helpers
read one typed field of a parsed object and raise ``ValueError`` naming the field.

This module imports only the standard library and numpy.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

MAX_DEPTH = 8
"""Deepest nesting of arrays and objects accepted by default."""
MAX_NUMBER_CHARS = 32
"""Longest literal of a number accepted (enough for any float64 and any int64)."""
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def nesting_depth(data: bytes) -> int:
    """Deepest bracket nesting of JSON text, ignoring brackets inside strings (linear, no recursion).

    Args:
        data: JSON text as bytes.
    """
    bare = np.frombuffer(_STRING.sub(b'""', data), np.uint8)
    if bare.size == 0:
        return 0
    step = np.isin(bare, _OPEN).astype(np.int64) - np.isin(bare, _CLOSE).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"integer literal of {len(text)} characters")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"number literal of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def loads_bounded(data: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse untrusted JSON; raise ``ValueError`` (never anything else) when it is not acceptable.

    Args:
        data: the bytes.
        max_bytes: longest input accepted.
        max_depth: deepest nesting of arrays/objects accepted.
    """
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes of JSON > {max_bytes}")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep > {max_depth}")
    text = data.decode("utf-8")  # strict: json.loads would guess UTF-16/32 from the first bytes
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError as e:  # unreachable after the depth check; kept so the function stays total
        raise ValueError("JSON nested too deep") from e


def field_str(obj: Mapping[str, Any], name: str, *, max_len: int = 256, default: str | None = None) -> str:
    """A string field of at most ``max_len`` characters.

    Args:
        obj: the parsed object.
        name: the field.
        max_len: longest value accepted.
        default: value when the field is absent (None: the field is required).
    """
    value = obj.get(name, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError(f"{name} must be a string of at most {max_len} characters")
    return value


def field_int(obj: Mapping[str, Any], name: str, *, lo: int = 0, hi: int = 2**53) -> int:
    """An integer field in ``[lo, hi]`` (booleans refused).

    Args:
        obj: the parsed object.
        name: the field.
        lo: smallest value accepted.
        hi: largest value accepted.
    """
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]")
    return value


def field_float(obj: Mapping[str, Any], name: str, *, bound: float = 1e30, default: float | None = None) -> float:
    """A finite number field with ``|value| <= bound`` (integers accepted, booleans refused).

    Args:
        obj: the parsed object.
        name: the field.
        bound: largest magnitude accepted.
        default: value when the field is absent (None: the field is required).
    """
    value = obj.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not abs(value) <= bound:
        raise ValueError(f"{name} must be a number with magnitude <= {bound:g}")
    return float(value)


def field_number_map(obj: Mapping[str, Any], name: str, *, max_items: int = 32) -> dict[str, float]:
    """An optional object of string -> finite number (e.g. sampling settings, timings).

    Args:
        obj: the parsed object.
        name: the field.
        max_items: most entries accepted.
    """
    value = obj.get(name, {})
    if not isinstance(value, dict) or len(value) > max_items:
        raise ValueError(f"{name} must be an object of at most {max_items} numbers")
    if any(len(k) > 64 for k in value):
        raise ValueError(f"{name} keys must be at most 64 characters")
    return {k: field_float(value, k) for k in value}
