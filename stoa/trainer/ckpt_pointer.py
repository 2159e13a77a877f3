"""The checkpoint pointer ``trainer/checkpoint.json``: which files make the current checkpoint, parsed strictly.

The pointer sits in a bucket others can write, so it is read through ``stoa.untrusted``; a pointer this trainer
did not write is a :class:`CheckpointError` naming the fix. ``stoa.trainer.checkpoint`` writes and loads the
checkpoint it names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from stoa.bucket import Bucket, ObjectNotFound
from stoa.layout import checkpoint_pointer_key
from stoa.trainer.lora import pointer_text
from stoa.untrusted import MAX_INT, BadBucketObject, check_int, field_int, field_object, load_object

FORMAT = "dcp-1"
"""The pointer's format tag."""
_FILE = re.compile(r"(?:\.metadata|__\d{1,6}_\d{1,6}\.distcp)")
_TAG = re.compile(r"s\d{10}-[0-9a-f]{8}")

MAX_POINTER_BYTES = 1 << 20
"""Longest checkpoint pointer read (a world of 1,000 ranks names about 40 KB of files)."""
MAX_FILES = 1 << 16
"""Most files a checkpoint pointer may name."""
DELETE_POINTER = "delete trainer/checkpoint.json to continue from the published weights (the optimizer state restarts)"
"""The fix a refused checkpoint names."""


class CheckpointError(BadBucketObject):
    """The named checkpoint cannot be read; the message names it and the fix (exit 13).

    The trainer stops rather than going on without it: the checkpoint holds the optimizer state and the master
    weights, and dropping them silently would change the run; deleting the pointer is the operator's choice.
    """


@dataclass(frozen=True)
class CheckpointRef:
    """The pointer ``trainer/checkpoint.json``: which files make the current checkpoint, and what it is."""

    tag: str
    version: int
    step: int
    world_size: int
    files: dict[str, int]
    """File name -> bytes."""
    kept: tuple[str, ...] = ()
    """Tags of the older checkpoints kept beside this one, newest first."""
    base: str = ""
    """A LoRA checkpoint's base model (``stoa.trainer.lora.Identity.base``); empty for full fine-tuning."""
    adapter: str = ""
    """A LoRA checkpoint's adapter (``LoraSpec.describe``); empty for full fine-tuning."""

    def to_json(self) -> bytes:
        """The pointer's bytes (``base`` and ``adapter`` only when set)."""
        lora = {"base": self.base, "adapter": self.adapter} if self.adapter else {}
        return json.dumps({"format": FORMAT, "tag": self.tag, "version": self.version, "step": self.step,
                           "world_size": self.world_size, "files": self.files, "kept": list(self.kept), **lora},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "trainer/checkpoint.json") -> CheckpointRef:
        """Parse a pointer strictly (``stoa.untrusted``: it sits in a bucket others can write).

        Args:
            data: the pointer's bytes.
            key: its key, for the message.

        Raises:
            CheckpointError: not a pointer this trainer wrote (exit 13, naming the fix).
        """
        try:
            d = load_object(data, "checkpoint pointer", max_bytes=MAX_POINTER_BYTES, max_depth=2)
            if d.get("format") != FORMAT:
                raise ValueError(f"format is not {FORMAT!r}")
            files = field_object(d, "files", max_items=MAX_FILES)
            if ".metadata" not in files:
                raise ValueError("files names no .metadata")
            for name, size in files.items():
                _match(_FILE, name, "file name")
                check_int(size, "file size")
            kept = d.get("kept", [])
            if not isinstance(kept, list) or len(kept) > 64:
                raise ValueError("kept is not a list of at most 64 tags")
            return cls(_match(_TAG, d.get("tag"), "tag"), field_int(d, "version", hi=MAX_INT),
                       field_int(d, "step", hi=MAX_INT), field_int(d, "world_size", hi=1 << 20), files,
                       tuple(_match(_TAG, t, "kept tag") for t in kept), pointer_text(d, "base"),
                       pointer_text(d, "adapter"))
        except ValueError as e:
            raise CheckpointError(key, f"is not a checkpoint pointer ({str(e)[:200]})", DELETE_POINTER) from None


def _match(pattern: re.Pattern[str], value: object, what: str) -> str:
    """``value`` if it is a string ``pattern`` matches in full, else ``ValueError``."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{what} is not {pattern.pattern!r}")
    return value


def read_pointer(bucket: Bucket, run_id: str) -> CheckpointRef | None:
    """The current sharded checkpoint's pointer, or None when the run has none.

    Raises:
        CheckpointError: the pointer is not one this trainer wrote.
    """
    try:
        return CheckpointRef.from_json(bucket.get(checkpoint_pointer_key(run_id)), checkpoint_pointer_key(run_id))
    except ObjectNotFound:
        return None
