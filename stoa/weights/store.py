"""Moved: publishing to ``stoa.weights.publish`` (trainer side), worker sync to ``stoa.weights.sync``,
the pointer to ``stoa.weights.pointer`` and keys to ``stoa.layout``; kept for imports until the sweep."""

from __future__ import annotations

from stoa.layout import anchor_prefix, patch_key, pointer_key, weights_prefix
from stoa.weights.pointer import MANIFEST_NAME, POINTER_SCHEMA, Pointer
from stoa.weights.publish import DEFAULT_ANCHOR_EVERY, GcInfo, PublishInfo, WeightPublisher
from stoa.weights.sync import Refusal, WeightSync

__all__ = [
    "DEFAULT_ANCHOR_EVERY",
    "MANIFEST_NAME",
    "POINTER_SCHEMA",
    "GcInfo",
    "Pointer",
    "PublishInfo",
    "Refusal",
    "WeightPublisher",
    "WeightSync",
    "anchor_prefix",
    "patch_key",
    "pointer_key",
    "weights_prefix",
]
