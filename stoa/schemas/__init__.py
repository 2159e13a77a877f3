"""Typed, versioned schemas of a run's bucket objects other than records and weights.

``stoa.layout`` spells every key; this package says what the objects under those keys hold. Each object has
one frozen dataclass with a ``schema`` version field, a writer's ``to_json`` and a ``parse`` that reads the
untrusted bytes through ``stoa.untrusted`` (bounded size, depth and numbers, exact types) and raises
:class:`BadSchemaObject` naming the key; writers and readers both use it, nobody else parses these objects.

==================================================  ==============================================
object (key in ``stoa.layout``)                     schema
==================================================  ==============================================
``status.json`` (``status_key``)                    :class:`stoa.schemas.control.RunStatus`
``trainer/lease.json`` (``lease_key``)              :class:`stoa.schemas.control.LeaseRecord`
``evaluator.json`` (``evaluator_key``)              :class:`stoa.schemas.control.EvaluatorHeartbeat`
``trackers/<name>.json`` (``tracker_key``)          :class:`stoa.schemas.control.TrackerHandle`
``trainer/journal.json`` (``journal_key``)          :class:`stoa.schemas.journal.Journal`
  its pool uses / quarantine rows                   :class:`~stoa.schemas.journal.PoolUse`,
                                                    :class:`~stoa.schemas.journal.QuarantineRow`
a line of a metrics chunk (``metrics_chunk_key``)   :class:`stoa.schemas.rows.MetricsRow`
``workers/<id>-<seq>`` (``presence_key``)           none: empty, the key is the whole message
==================================================  ==============================================

Versions: an object without a ``schema`` field is version 1, and writers leave the field out at version 1
(:func:`versioned`), so every object is written byte for byte as before the schemas existed and older stoa
versions read it; the field appears from version 2 on. A version above the one this stoa knows is refused (a
newer writer's object is never half-read).
Metrics rows carry no ``schema`` field (every key of a row is a metric for trackers and ``stoa status``): a row
is version 1. The BM25 index manifest (``stoa-index.json``) keeps its own ``format`` version and parser in
``stoa.retrieval.manifest``.

This package imports only the standard library and ``stoa.untrusted``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from stoa.untrusted import BadBucketObject, check_int, load_object

SCHEMA_FIELD = "schema"
"""The field that holds an object's schema version (absent: version 1)."""
DEFAULT_FIX = "delete it (its writer writes it again) or restore it from a backup"

T = TypeVar("T")


class BadSchemaObject(BadBucketObject):
    """A bucket object that does not parse under its schema; the message names its key and what is wrong.

    Args:
        key: the object's key (or file name).
        problem: what is wrong with it.
        fix: what the operator can do.
    """

    def __init__(self, key: str, problem: str, fix: str = DEFAULT_FIX) -> None:
        super().__init__(key, problem, fix)


def load(data: bytes, key: str, *, max_bytes: int, max_depth: int) -> dict[str, Any]:
    """The JSON object in ``data`` (``stoa.untrusted.load_object``); :class:`BadSchemaObject` naming ``key``.

    Args:
        data: the stored bytes.
        key: the object's key, for the message.
        max_bytes: longest object accepted.
        max_depth: deepest nesting accepted.
    """
    return checked(key, lambda: load_object(data, "it", max_bytes=max_bytes, max_depth=max_depth))


def checked(key: str, read: Callable[[], T], fix: str = DEFAULT_FIX) -> T:
    """``read()``, its ``ValueError`` raised as :class:`BadSchemaObject` naming ``key``.

    Args:
        key: the object's key, for the message.
        read: reads the fields (raises ``ValueError`` naming the field).
        fix: what the operator can do, for the message.
    """
    try:
        return read()
    except BadSchemaObject:
        raise
    except ValueError as e:
        raise BadSchemaObject(key, f"is malformed ({str(e)[:200]})", fix) from None


def versioned(fields: dict[str, Any]) -> dict[str, Any]:
    """An object's fields as written: the ``schema`` field left out at version 1 (see the module).

    Args:
        fields: every field, ``schema`` included.
    """
    return {k: v for k, v in fields.items() if not (k == SCHEMA_FIELD and v == 1)}


def schema_version(d: Mapping[str, Any], key: str, known: int) -> int:
    """The object's schema version: 1 when absent (written before the field), refused above ``known``.

    Args:
        d: the parsed object.
        key: the object's key, for the message.
        known: the newest version this stoa reads.
    """
    return checked(key, lambda: check_int(d.get(SCHEMA_FIELD, 1), SCHEMA_FIELD, lo=1, hi=known))
