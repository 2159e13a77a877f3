"""The weight plane's view of ``stoa.untrusted``: its ``ValueError`` becomes the plane's own error type.

The weight plane's JSON (patch headers, anchor manifests, safetensors headers, the pointer) comes from a
bucket other machines can write to; it is parsed and type-checked by ``stoa.untrusted`` (the one parser of
untrusted bytes), and every refusal there reaches the plane's callers as a ``PatchError``, ``AnchorError``
or ``SyncError`` with reason ``bad_format`` (or the reader's own), never as a crash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from stoa.untrusted import loads_bounded
from stoa.weights.errors import WeightsError

ErrorFactory = Callable[[str, str], WeightsError]
"""Builds the error to raise: ``(reason, detail) -> PatchError/AnchorError/SyncError``."""


def load_json(data: bytes | bytearray | memoryview, error: ErrorFactory, what: str, *, max_bytes: int) -> Any:
    """``stoa.untrusted.loads_bounded``, its refusal raised as ``error("bad_format", ...)``.

    Args:
        data: the JSON text.
        error: builds the error raised on failure.
        what: what is being read, for the message (``"patch header"``).
        max_bytes: longest input accepted.
    """
    with refused_as(error, what):
        return loads_bounded(data, max_bytes=max_bytes)


@contextlib.contextmanager
def refused_as(error: ErrorFactory, what: str, reason: str = "bad_format") -> Iterator[None]:
    """Turn a ``ValueError`` raised inside (``stoa.untrusted``'s readers) into ``error(reason, ...)``.

    Args:
        error: builds the error raised.
        what: what is being read, for the message.
        reason: the error's reason.
    """
    try:
        yield
    except ValueError as e:
        raise error(reason, f"{what}: {str(e)[:300]}") from None
