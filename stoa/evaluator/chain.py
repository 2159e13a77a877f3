"""Verified intermediate versions: the state hash of every version between the evaluator's held weights and the
pointer, bound to the pointer by re-applying the patch chain (each patch checks its base hash, and the last
result must equal the pointer's hash). With those hashes :class:`WeightSync` reaches each intermediate version
and verifies it like a pointer's. No torch or mlx."""

from __future__ import annotations

import dataclasses

from stoa.bucket import ObjectNotFound
from stoa.layout import anchor_prefix, patch_key, pointer_key
from stoa.weights.anchor import load_manifest
from stoa.weights.errors import PatchError, SyncError, WeightsError
from stoa.weights.planes import State
from stoa.weights.pointer import MANIFEST_NAME, Pointer, complete, list_anchors, list_patches
from stoa.weights.pulse import apply_patch
from stoa.weights.sync import MAX_MANIFEST_BYTES, WeightSync

_PATCH_SLACK = 16 << 20


class ChainRefused(Exception):
    """An object on the way from the held weights to the pointer could not be trusted (or is missing).

    Args:
        key: the object refused (the pointer's key when the chain ends at another hash).
        error: why.
    """

    def __init__(self, key: str, error: WeightsError) -> None:
        super().__init__(f"{key}: {error}")
        self.key, self.error = key, error


def patch_cap(state: State) -> int:
    """Largest patch that can be honest for ``state`` (every element changed, plus slack); larger ones are
    refused unread.

    Args:
        state: the state the patch applies to.
    """
    return _PATCH_SLACK + 2 * sum(int(a.size) * (4 + a.dtype.itemsize) for a in state.values())


def at_version(pointer: Pointer, version: int, state_hash: str) -> Pointer:
    """A pointer-shaped target for an earlier version whose hash is known (to hand to ``WeightSync.sync``).

    Args:
        pointer: the run's real pointer.
        version: the earlier version.
        state_hash: its verified (or to-be-verified) state hash.
    """
    return dataclasses.replace(pointer, version=version, anchor_version=min(pointer.anchor_version, version),
                               state_hash=state_hash, etag=None)


def rebase(sync: WeightSync, first: int, pointer: Pointer) -> None:
    """Make the held weights a base at or below ``first``: kept when already there, else the newest complete
    anchor at or below ``first`` (verified against its own manifest; :func:`chain_hashes` then binds it to the
    pointer). Without such an anchor the held weights stay as they are.

    Args:
        sync: the evaluator's weight sync.
        first: the first version to evaluate.
        pointer: the run's pointer.
    """
    if sync.version is not None and sync.state is not None and sync.version <= first:
        return
    anchors = {v: o for v, o in list_anchors(sync.bucket, sync.run_id).items() if complete(o) and v <= first}
    if not anchors:
        return
    a = max(anchors)
    key = anchor_prefix(sync.run_id, a) + MANIFEST_NAME
    if anchors[a][MANIFEST_NAME] > MAX_MANIFEST_BYTES:
        raise ChainRefused(key, SyncError("oversize", f"manifest listed at {anchors[a][MANIFEST_NAME]} bytes"))
    try:
        manifest = load_manifest(sync.bucket.get(key))
    except WeightsError as e:
        raise ChainRefused(key, e) from None
    sync.sync(at_version(pointer, a, str(manifest["state_hash"])))


def chain_hashes(sync: WeightSync, pointer: Pointer) -> dict[int, str]:
    """The state hash of every version from the held one to the pointer's, by applying each patch to a copy of
    the held weights (base hash checked by every patch, the last result checked against the pointer).

    Args:
        sync: the evaluator's weight sync (holding verified weights at or below the pointer).
        pointer: the run's pointer.

    Raises:
        ChainRefused: a patch is missing, oversize or damaged, or the chain ends at another hash.
    """
    if sync.state is None or sync.version is None or sync.state_hash is None or sync.version > pointer.version:
        raise ChainRefused(pointer_key(sync.run_id), SyncError("unavailable", "no held weights below the pointer"))
    state, version, s_hash = sync.state, sync.version, sync.state_hash
    hashes, owned, cap = {version: s_hash}, False, patch_cap(state)
    sizes = list_patches(sync.bucket, sync.run_id, after=version)
    for v in range(version + 1, pointer.version + 1):
        key = patch_key(sync.run_id, v)
        try:
            if v not in sizes:
                raise SyncError("unavailable", "patch missing")
            if sizes[v] > cap:
                raise PatchError("oversize", f"listed at {sizes[v]} bytes, more than any honest patch")
            state, info = apply_patch(state, sync.bucket.get(key), run_id=sync.run_id, expected_from_version=version,
                                      plane=sync.plane, expected_from_hash=s_hash, inplace=owned)
        except ObjectNotFound:
            raise ChainRefused(key, SyncError("unavailable", "patch vanished")) from None
        except WeightsError as e:
            raise ChainRefused(key, e) from None
        version, s_hash, owned = v, info.state_hash, True
        hashes[v] = s_hash
    if s_hash != pointer.state_hash:
        raise ChainRefused(pointer_key(sync.run_id), SyncError(
            "pointer_mismatch", f"patches reach v{version} {s_hash}, pointer says {pointer.state_hash}"))
    return hashes
