"""Reading a DCP checkpoint from the bucket without running code from it.

``torch.distributed.checkpoint`` unpickles a checkpoint's ``.metadata`` with plain ``pickle.load`` and its
non-tensor items (the optimizer's ``param_groups``) with ``torch.load(weights_only=False)``: either runs any
code a file asks for, and anyone with bucket credentials can write the files a checkpoint pointer names.
:func:`check_metadata` unpickles ``.metadata`` once with only the classes DCP writes there allowed (the real
load that follows reads the same bytes, so it can reach nothing else), and the planners here read non-tensor
items with ``torch.load(weights_only=True)`` (tensors, numbers, strings and containers only).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}
"""What a DCP ``.metadata`` refers to (plus any ``torch.<dtype>``); nothing here runs code when called."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name[:64]}")


def metadata_problem(path: str) -> str | None:
    """Why the DCP ``.metadata`` file at ``path`` must not be unpickled, or None when it only holds DCP metadata.

    Args:
        path: the downloaded ``.metadata`` file.
    """
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure of a hostile pickle is a refusal
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
    obj = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:  # noqa: D102
        _load_bytes(self, read_item, value)


class SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner for loading a whole checkpoint into an empty dict, with the same safe ``load_bytes``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:  # noqa: D102
        _load_bytes(self, read_item, value)
