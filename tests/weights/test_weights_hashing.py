"""Hashes cover names, dtype, shape and bytes, and do not depend on dict order or memory layout."""

from __future__ import annotations

import numpy as np

from stoa.weights.hashing import (
    HASH_PREFIX,
    state_hash,
    state_hash_from_tensor_hashes,
    tensor_hash,
    tensor_hashes,
)


def test_tensor_hash_covers_dtype_shape_and_bytes() -> None:
    a = np.arange(12, dtype=np.uint16)
    h = tensor_hash(a)
    assert h.startswith(HASH_PREFIX) and len(h) == len(HASH_PREFIX) + 32
    assert h == tensor_hash(a.copy())
    assert h != tensor_hash(a.reshape(3, 4))
    assert h != tensor_hash(a.view(np.int16))
    assert tensor_hash(a.view(np.uint32)) != tensor_hash(a.view(np.uint32).reshape(2, 3))
    b = a.copy()
    b[5] ^= 1
    assert h != tensor_hash(b)
    assert tensor_hash(np.zeros(0, np.uint16)) != tensor_hash(np.zeros(0, np.uint32))


def test_tensor_hash_ignores_memory_layout() -> None:
    a = np.arange(64, dtype=np.uint16).reshape(8, 8)
    t = a.T
    assert tensor_hash(t) == tensor_hash(np.ascontiguousarray(t))
    assert tensor_hash(a.astype(">u2")) == tensor_hash(a)


def test_state_hash_is_order_free_and_name_sensitive() -> None:
    s1 = {"a": np.arange(4, dtype=np.uint16), "b": np.ones((2, 2), np.uint32)}
    s2 = {"b": s1["b"].copy(), "a": s1["a"].copy()}
    assert state_hash(s1) == state_hash(s2)
    assert state_hash(s1) == state_hash_from_tensor_hashes(tensor_hashes(s1))
    assert state_hash(s1) != state_hash({"a": s1["a"], "c": s1["b"]})
    assert state_hash(s1) != state_hash({"a": s1["a"]})
    # moving bytes between tensors changes the hash even though the concatenation is the same
    x = {"a": np.arange(4, dtype=np.uint16), "b": np.arange(4, 8, dtype=np.uint16)}
    y = {"a": np.arange(3, dtype=np.uint16), "b": np.arange(3, 8, dtype=np.uint16)}
    assert state_hash(x) != state_hash(y)
