"""Total parsing of untrusted JSON: bounded size, depth and numbers; every failure is one ``ValueError``.

Everything in the bucket is hostile to its readers: any worker's credentials can write any object. This is
the one parser for such bytes (records, the run contract, the weights pointer, patch headers and anchor
manifests, the lease, the journal, heartbeats, status). ``json.loads`` alone is not a total function:
deeply nested arrays raise ``RecursionError``, ``1`` followed by thousands of zeros hits Python's digit
limit or becomes an integer that ``float()`` refuses, ``1e999`` parses to infinity and ``NaN`` parses at
all. ``loads_bounded`` checks the size and the nesting depth before parsing (in linear time), decodes strict
UTF-8 (no guessing of UTF-16/32), refuses oversize number literals, non-finite floats and the
``NaN``/``Infinity`` constants, and raises nothing but ``ValueError``. The ``field_*`` and ``check_*``
helpers read one typed value of a parsed object (exact types: a bool is not an integer, a float is not an
integer, a string holds no lone surrogate) and raise ``ValueError`` naming it. ``BadBucketObject`` is the
error a client raises when it cannot go on without an object it had to refuse (the command line maps it to
its own exit code).

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
MAX_INT = (1 << 63) - 1
"""Largest integer a ``check_int`` accepts by default (fits int64)."""
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one running to the end: every match ends at a quote or the end, so a
scan is linear (an unterminated string that only ended at a quote made every later quote rescan the rest)."""
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_CHUNK = 1 << 20


class BadBucketObject(ValueError):
    """An object in the bucket that no honest stoa wrote, which this client cannot do without.

    The message is one line naming the object, what is wrong with it and the fix (restore it from a backup,
    delete it, or start a new run); ``stoa`` exits with its own code (``stoa.cli.EXIT_CODES``).

    Args:
        key: the object's key.
        problem: what is wrong with it.
        fix: what the operator can do.
    """

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key} {problem}; {fix}")


def nesting_depth(data: bytes) -> int:
    """Deepest bracket nesting of JSON text, ignoring brackets inside strings (linear, no recursion).

    Args:
        data: JSON text as bytes.
    """
    brackets = _STRING.sub(b"", bytes(data)).translate(None, _BRACKETS)
    depth = deepest = 0
    for at in range(0, len(brackets), _CHUNK):  # bounded temporaries, whatever the input's size
        chunk = np.frombuffer(brackets, np.uint8, count=min(_CHUNK, len(brackets) - at), offset=at)
        step = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int32)
        levels = np.cumsum(step, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


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


def loads_bounded(data: bytes | bytearray | memoryview, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse untrusted JSON; raise ``ValueError`` (never anything else) when it is not acceptable.

    Args:
        data: the bytes (``bytearray`` and ``memoryview`` are read too).
        max_bytes: longest input accepted.
        max_depth: deepest nesting of arrays/objects accepted.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"JSON must be bytes, not {type(data).__name__}")
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes of JSON > {max_bytes}")
    data = bytes(data)
    depth = nesting_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep > {max_depth}")
    text = data.decode("utf-8")  # strict: json.loads would guess UTF-16/32 from the first bytes
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError as e:  # unreachable after the depth check; kept so the function stays total
        raise ValueError("JSON nested too deep") from e


def load_object(data: bytes | bytearray | memoryview, what: str, *, max_bytes: int,
                max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """``loads_bounded`` for a document that must be a JSON object; ``ValueError`` naming ``what`` otherwise.

    Args:
        data: the bytes.
        what: the object's name for messages (``run.json``).
        max_bytes: longest input accepted.
        max_depth: deepest nesting accepted.
    """
    try:
        value = loads_bounded(data, max_bytes=max_bytes, max_depth=max_depth)
    except ValueError as e:
        raise ValueError(f"{what}: {str(e)[:200]}") from None
    return as_object(value, what)


def as_object(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else ``ValueError``.

    Args:
        value: parsed JSON.
        what: its name for the message.
    """
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {_kind(value)}, not an object")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def check_text(value: Any, what: str, *, max_len: int = 4096) -> str:
    """``value`` if it is a string of at most ``max_len`` characters that encodes as UTF-8 (no lone
    surrogate, which ``\\ud800`` in JSON yields), else ``ValueError``.

    Args:
        value: the value.
        what: its name for the message.
        max_len: longest value accepted.
    """
    if not isinstance(value, str):
        raise ValueError(f"{what} is {_kind(value)}, not a string")
    if len(value) > max_len:
        raise ValueError(f"{what} is longer than {max_len} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8 text") from None
    return value


def check_int(value: Any, what: str, *, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value`` if it is an integer (not a bool, not a float) in ``[lo, hi]``, else ``ValueError``.

    Args:
        value: the value.
        what: its name for the message.
        lo: smallest value accepted.
        hi: largest value accepted.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} is {_kind(value)}, not an integer")
    if not lo <= value <= hi:
        raise ValueError(f"{what} = {value if abs(value) < 10**30 else 'huge'} outside [{lo}, {hi}]")
    return value


def check_number(value: Any, what: str, *, lo: float = -1e30, hi: float = 1e30) -> float:
    """``value`` as a float if it is a finite number (an integer too, not a bool) in ``[lo, hi]``.

    Args:
        value: the value.
        what: its name for the message.
        lo: smallest value accepted.
        hi: largest value accepted.
    """
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{what} is {_kind(value)}, not a number")
    if not lo <= value <= hi:  # also refuses NaN, should a caller pass one in
        raise ValueError(f"{what} outside [{lo:g}, {hi:g}]")
    return float(value)


def int_list(value: Any, what: str, *, max_len: int = 32, lo: int = 0, hi: int = MAX_INT) -> list[int]:
    """A JSON array of at most ``max_len`` integers in ``[lo, hi]`` (a shape, a pair of offsets, token ids).

    Args:
        value: the value.
        what: its name for the message.
        max_len: most elements accepted.
        lo: smallest element accepted.
        hi: largest element accepted.
    """
    if not isinstance(value, list) or len(value) > max_len:
        raise ValueError(f"{what} is not a list of at most {max_len} integers")
    return [check_int(v, what, lo=lo, hi=hi) for v in value]


def element_count(shape: list[int], what: str, *, hi: int) -> int:
    """Product of ``shape`` computed exactly, refused above ``hi`` (no int64 wrap-around).

    Args:
        shape: non-negative dims.
        what: the tensor's name for the message.
        hi: largest element count accepted.
    """
    n = 1
    for d in shape:
        n *= d
        if n > hi:
            raise ValueError(f"{what}: shape {shape[:8]} holds more than {hi} elements")
    return n


def field_text(obj: Mapping[str, Any], name: str, *, max_len: int = 4096) -> str:
    """A required string field (``check_text``): missing, mistyped or too long is ``ValueError``.

    Args:
        obj: the parsed object.
        name: the field.
        max_len: longest value accepted.
    """
    if name not in obj:
        raise ValueError(f"missing {name!r}")
    return check_text(obj[name], name, max_len=max_len)


def field_bool(obj: Mapping[str, Any], name: str, *, default: bool | None = None) -> bool:
    """A boolean field (``0``/``1`` refused).

    Args:
        obj: the parsed object.
        name: the field.
        default: value when the field is absent (None: the field is required).
    """
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false")
    return value


def field_object(obj: Mapping[str, Any], name: str, *, max_items: int = 256,
                 default: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An object field of at most ``max_items`` entries (its values unchecked: the caller reads them).

    Args:
        obj: the parsed object.
        name: the field.
        max_items: most entries accepted.
        default: value when the field is absent (None: the field is required).
    """
    value = obj.get(name, default)
    if not isinstance(value, dict) or len(value) > max_items:
        raise ValueError(f"{name} must be an object of at most {max_items} entries")
    return dict(value)


def field_str(obj: Mapping[str, Any], name: str, *, max_len: int = 256, default: str | None = None) -> str:
    """A string field of at most ``max_len`` characters, valid UTF-8 (``check_text``).

    Args:
        obj: the parsed object.
        name: the field.
        max_len: longest value accepted.
        default: value when the field is absent (None: the field is required).
    """
    value = obj.get(name, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError(f"{name} must be a string of at most {max_len} characters")
    return check_text(value, name, max_len=max_len)


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
