"""Strict reading of JSON written by the trainer: every malformed input is one ``WeightsError``, never a crash.

The weight plane's JSON (patch headers, anchor manifests, safetensors headers, the pointer) comes from a
bucket other machines can write to, so its readers must be total functions over arbitrary bytes: no
``RecursionError`` from deep nesting, no ``OverflowError`` from ``1e999``, no ``AttributeError`` from a
number where a string belongs, no ``UnicodeEncodeError`` from a lone surrogate in a name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from stoa.weights.errors import WeightsError

MAX_INT = (1 << 63) - 1
"""Largest integer any field may hold (fits int64; versions, sizes, offsets and dims are far below)."""

ErrorFactory = Callable[[str, str], WeightsError]
"""Builds the error to raise: ``(reason, detail) -> PatchError/AnchorError/SyncError``."""


class FieldError(ValueError):
    """Internal: a field has the wrong type or range; readers turn it into their own ``bad_format``."""


def load_json(data: bytes | bytearray | memoryview | str, error: ErrorFactory, what: str) -> Any:
    """Parse JSON, turning every failure (syntax, encoding, nesting depth, digit limits) into ``error``.

    Args:
        data: the JSON text.
        error: builds the error raised on failure (reason ``bad_format``).
        what: what is being read, for the message (``"patch header"``).
    """
    try:
        return json.loads(bytes(data) if isinstance(data, memoryview | bytearray) else data)
    except RecursionError:
        raise error("bad_format", f"{what}: JSON nested too deeply") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise error("bad_format", f"{what}: {str(e)[:200]}") from None


def obj(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object with string keys, else ``FieldError``.

    Args:
        value: parsed JSON.
        what: field name for the message.
    """
    if not isinstance(value, dict):
        raise FieldError(f"{what} is {type(value).__name__}, not an object")
    return value


def text(d: Mapping[str, Any], key: str, *, max_len: int = 4096) -> str:
    """A string field that encodes as UTF-8 (no lone surrogates) and is at most ``max_len`` characters.

    Args:
        d: the JSON object.
        key: the field.
        max_len: longest accepted value.
    """
    if key not in d:
        raise FieldError(f"missing {key!r}")
    return check_text(d[key], key, max_len=max_len)


def check_text(value: Any, what: str, *, max_len: int = 4096) -> str:
    """``value`` if it is a UTF-8-encodable string of at most ``max_len`` characters, else ``FieldError``.

    Args:
        value: the value.
        what: field name for the message.
        max_len: longest accepted value.
    """
    if not isinstance(value, str):
        raise FieldError(f"{what} is {type(value).__name__}, not a string")
    if len(value) > max_len:
        raise FieldError(f"{what} is longer than {max_len} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError(f"{what} is not valid UTF-8 text") from None
    return value


def integer(d: Mapping[str, Any], key: str, *, lo: int = 0, hi: int = MAX_INT) -> int:
    """An integer field (not a bool, not a float) within ``[lo, hi]``.

    Args:
        d: the JSON object.
        key: the field.
        lo: smallest accepted value.
        hi: largest accepted value.
    """
    if key not in d:
        raise FieldError(f"missing {key!r}")
    return check_int(d[key], key, lo=lo, hi=hi)


def check_int(value: Any, what: str, *, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value`` if it is an int (not a bool) within ``[lo, hi]``, else ``FieldError``.

    Args:
        value: the value.
        what: field name for the message.
        lo: smallest accepted value.
        hi: largest accepted value.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise FieldError(f"{what} is {type(value).__name__}, not an integer")
    if not lo <= value <= hi:
        raise FieldError(f"{what} = {value if abs(value) < 10**30 else 'huge'} outside [{lo}, {hi}]")
    return value


def int_list(value: Any, what: str, *, max_len: int = 32, hi: int = MAX_INT) -> list[int]:
    """A JSON array of non-negative integers (a shape, a pair of offsets).

    Args:
        value: the value.
        what: field name for the message.
        max_len: most elements accepted.
        hi: largest accepted element.
    """
    if not isinstance(value, list) or len(value) > max_len:
        raise FieldError(f"{what} is not a list of at most {max_len} integers")
    return [check_int(v, what, hi=hi) for v in value]


def element_count(shape: list[int], what: str, *, hi: int) -> int:
    """Product of ``shape`` computed exactly, refused above ``hi`` (no int64 wrap-around).

    Args:
        shape: non-negative dims.
        what: tensor name for the message.
        hi: largest accepted element count.
    """
    n = 1
    for d in shape:
        n *= d
        if n > hi:
            raise FieldError(f"{what}: shape {shape[:8]} holds more than {hi} elements")
    return n
