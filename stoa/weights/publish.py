"""The trainer side of the weight plane: publish patches and anchors, the pointer last; retention (gc).

Keys come from ``stoa.layout``; the worker side (poll the pointer, verify, catch up) is ``stoa.weights.sync``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from stoa.bucket import Bucket, BucketError, ObjectExists, ObjectNotFound, PreconditionFailed
from stoa.contract import RunKeyError
from stoa.layout import anchor_prefix, patch_key, pointer_key
from stoa.untrusted import BadBucketObject
from stoa.weights.anchor import FILE_NAME, encode_anchor
from stoa.weights.errors import SyncError, WeightsError
from stoa.weights.planes import State, check_plane
from stoa.weights.pointer import MANIFEST_NAME, Pointer, complete, list_anchors, list_patches, now_iso
from stoa.weights.pulse import DEFAULT_LEVEL, encode_patch, read_patch_header
from stoa.weights.signing import RunSigner
from stoa.weights.sync import Refusal, WeightSync

DEFAULT_ANCHOR_EVERY = 20
"""Anchor cadence: a late joiner pays one anchor plus at most 19 patches (~1.2 checkpoints); the trainer
uploads ~6% of a checkpoint per version on average (measurements in docs/weights.md)."""
_POINTER_FIX = ("the trainer did not write it and does not publish after it; restore it from a backup of the "
                "bucket, or start a new --run")


@dataclass(frozen=True)
class PublishInfo:
    """What one publish wrote.

    Args:
        version: the version published.
        state_hash: its state hash.
        bytes_patch: size of the patch written (0 when none).
        bytes_anchor: size of the anchor written, file plus manifest (0 when none).
        seconds: wall time of the whole publish.
        changed: elements whose stored bits changed (0 without a patch).
        elements: elements in the state.
    """

    version: int
    state_hash: str
    bytes_patch: int
    bytes_anchor: int
    seconds: float
    changed: int = 0
    elements: int = 0


@dataclass(frozen=True)
class GcInfo:
    """What a retention pass deleted.

    Args:
        kept_anchor: the oldest anchor kept (newest anchor at or before current - keep_versions), if any.
        deleted_anchors: versions of anchors deleted.
        deleted_patches: versions of patches deleted.
    """

    kept_anchor: int | None
    deleted_anchors: list[int]
    deleted_patches: list[int]


class WeightPublisher:
    """The trainer side: publish each version as a patch (and an anchor every ``anchor_every``), pointer last.

    Args:
        bucket: the bucket.
        run_id: the run.
        plane: ``"bf16"`` or ``"int8g64"``.
        anchor_every: write an anchor at every version divisible by this (and at the first publish).
        level: zstd level for patches.
        signer: the run's private key (``stoa.weights.signing.RunSigner``): every pointer is signed, a pointer
            read back must verify against it. None publishes unsigned pointers (a run without a key).
    """

    def __init__(
        self,
        bucket: Bucket,
        run_id: str,
        plane: str,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        *,
        level: int = DEFAULT_LEVEL,
        signer: RunSigner | None = None,
    ) -> None:
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        self.bucket = bucket
        self.run_id = run_id
        self.plane = check_plane(plane)
        self.anchor_every = anchor_every
        self.level = level
        self.signer = signer
        self.run_key = signer.public_hex if signer is not None else ""
        self.forged_pointers = 0
        """Pointers not signed by the run's key that this publisher found and replaced."""
        self._prev: State | None = None
        self._prev_version: int | None = None
        self._pointer: Pointer | None = None
        self._pointer_read = False
        self.resume_error: SyncError | None = None
        """Why :meth:`resume` could not verify the published state (None when it could, or was not called)."""
        self.resume_refusals: list[Refusal] = []
        """The objects :meth:`resume` refused (each with key and reason)."""

    @property
    def pointer(self) -> Pointer | None:
        """The last pointer this publisher read or wrote."""
        return self._pointer

    def _read_pointer(self) -> Pointer | None:
        try:
            data, etag = self.bucket.get_with_etag(pointer_key(self.run_id))
        except ObjectNotFound:
            return None
        p = Pointer.from_json(data, etag)
        if p.run_id != self.run_id or p.plane != self.plane:
            raise WeightsError(
                "wrong_run" if p.run_id != self.run_id else "wrong_plane",
                f"current.json is run {p.run_id!r} plane {p.plane!r}; publisher is {self.run_id!r}/{self.plane!r}",
            )
        return p.check_signature(self.run_key)

    def _replace_forgery(self, new: Pointer) -> str | None:
        """After a lost CAS on a signed run: if the pointer now there is not signed by the run's key (someone
        with bucket access wrote it), overwrite it by CAS on its etag and return the new etag; else None."""
        if self.signer is None:
            return None
        try:
            data, etag = self.bucket.get_with_etag(pointer_key(self.run_id))
            Pointer.from_json(data, etag).check_signature(self.run_key)
        except ObjectNotFound:
            etag = None
        except SyncError:
            pass
        else:
            return None  # signed by this key: another trainer holding the key, a real conflict
        try:
            new_etag = self.bucket.cas(pointer_key(self.run_id), new.to_json(), etag)
        except PreconditionFailed:
            return None
        self.forged_pointers += 1
        return new_etag

    @property
    def published_state(self) -> State | None:
        """The verified state at the pointer's version after :meth:`resume` (None if it could not be
        verified or the run is fresh); do not modify it, the next patch is computed against it."""
        return self._prev if self._pointer is not None and self._prev_version == self._pointer.version else None

    def resume(self) -> Pointer | None:
        """After a trainer restart: load the currently published state so the next publish is a patch.

        If the published state cannot be verified (a corrupt or missing newest patch or anchor), the
        pointer is still returned, no previous state is kept, and ``resume_error`` says why: the next
        publish then writes a fresh full anchor, from which workers recover. Without calling this, the
        first publish of a process writes an anchor and no patch.

        Returns:
            The pointer found (None for a fresh run).

        Raises:
            BadBucketObject: (exit 13) current.json is malformed, or names a version above every patch and
                anchor listed: this trainer never wrote it (it writes the pointer last), and continuing would
                publish after a version nobody has, so the trainer stops with one line naming the fix.
            RunKeyError: (exit 3) on a signed run, current.json is not signed by the run's key.
            WeightsError: ``wrong_run``/``wrong_plane`` when it belongs to another run or plane.
            BucketError: the bucket failed while reading (an outage is not a corrupt state).
        """
        try:
            self._pointer = self._read_pointer()
        except SyncError as e:
            if e.reason == "bad_pointer":
                raise BadBucketObject(pointer_key(self.run_id), f"is not a weights pointer ({e.detail})",
                                      _POINTER_FIX) from None
            if self.signer is None or e.reason not in ("unsigned", "malformed_signature", "bad_signature"):
                raise
            raise RunKeyError(f"{pointer_key(self.run_id)} is not signed by the run's key ({e.detail}): someone "
                              "with write access to the bucket wrote it, and the trainer does not resume from "
                              "weights it did not publish; revoke the workers' write credentials, then restore "
                              "that object from a backup or start a new --run") from None
        self._pointer_read = True
        self._prev = self._prev_version = None
        self.resume_error = None
        if self._pointer is None:
            return None
        sync = WeightSync(self.bucket, self.run_id, self.plane, run_key=self.run_key)
        try:
            version, state = sync.sync(self._pointer)
        except SyncError as e:
            if isinstance(e.__cause__, BucketError):
                raise e.__cause__ from None
            if e.reason == "pointer_ahead":
                raise BadBucketObject(pointer_key(self.run_id), f"is ahead of the published weights ({e.detail})",
                                      _POINTER_FIX) from None
            self.resume_error = e
            self.resume_refusals = list(sync.refusals)
            return self._pointer
        self._prev, self._prev_version = state, version
        return self._pointer

    def publish(self, version: int, state: Mapping[str, np.ndarray]) -> PublishInfo:
        """Publish ``state`` as ``version``: patch (create-only), anchor if due, then the pointer by CAS.

        Retrying a publish that failed part-way is safe: objects are rewritten with identical bytes.

        Args:
            version: the new policy version; must exceed the published one.
            state: the stored bits (e.g. from ``state_from_f32``); copied, so the caller may reuse arrays.

        Raises:
            WeightsError: ``stale_version`` if ``version`` is not newer than the pointer,
                ``pointer_conflict`` if another writer moved the pointer (two trainers on one run).
        """
        t0 = time.perf_counter()
        if not self._pointer_read:
            self._pointer = self._read_pointer()
            self._pointer_read = True
        current = self._pointer
        if current is not None and version <= current.version:
            raise WeightsError("stale_version", f"version {version} <= published version {current.version}")
        snap: State = {k: np.array(v, copy=True, order="C") for k, v in state.items()}
        bytes_patch = bytes_anchor = changed = 0
        elements = sum(int(v.size) for v in snap.values())
        s_hash: str | None = None
        wrote_patch = False
        if self._prev is not None and self._prev_version == version - 1:
            patch = encode_patch(
                self._prev,
                snap,
                run_id=self.run_id,
                from_version=version - 1,
                to_version=version,
                plane=self.plane,
                level=self.level,
            )
            info = read_patch_header(patch)
            s_hash, changed = info.state_hash, info.changed
            self._put_unreferenced(patch_key(self.run_id, version), patch)
            bytes_patch, wrote_patch = len(patch), True
        anchor_version = current.anchor_version if current is not None else None
        if anchor_version is None or not wrote_patch or version % self.anchor_every == 0:
            s_hash, bytes_anchor = self._write_anchor(version, snap)
            anchor_version = version
        assert s_hash is not None
        new = Pointer(self.run_id, version, anchor_version, self.plane, s_hash, now_iso())
        if self.signer is not None:
            new = replace(new, signature=self.signer.sign(new.signed_bytes()))
        try:
            etag = self.bucket.cas(pointer_key(self.run_id), new.to_json(), current.etag if current else None)
        except PreconditionFailed:
            etag = self._replace_forgery(new)
            if etag is None:
                self._pointer_read = False
                raise WeightsError("pointer_conflict", "current.json changed under this publisher") from None
        self._pointer = Pointer(**{**asdict(new), "etag": etag})
        self._prev, self._prev_version = snap, version
        return PublishInfo(
            version, s_hash, bytes_patch, bytes_anchor, time.perf_counter() - t0, changed, elements
        )

    def _write_anchor(self, version: int, snap: State) -> tuple[str, int]:
        """Write the anchor of ``version``, file then manifest (the manifest marks it complete).

        Returns:
            (its state hash, bytes written: file plus manifest).
        """
        data, manifest = encode_anchor(snap, run_id=self.run_id, version=version, plane=self.plane)
        mbytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
        prefix = anchor_prefix(self.run_id, version)
        self._put_unreferenced(prefix + FILE_NAME, data)
        self._put_unreferenced(prefix + MANIFEST_NAME, mbytes)  # manifest last: marks the anchor complete
        return str(manifest["state_hash"]), len(data) + len(mbytes)

    def _put_unreferenced(self, key: str, data: bytes) -> None:
        # Objects for versions above the pointer are referenced by nobody yet; a left-over from a crashed
        # attempt with different content (a restarted trainer) is safe to replace.
        try:
            self.bucket.put_create(key, data)
        except ObjectExists:
            self.bucket.put(key, data)

    def gc(self, keep_versions: int) -> GcInfo:
        """Delete patches and anchors no worker inside the staleness window can still need.

        Keeps the newest complete anchor at or before ``current - keep_versions`` and everything after it;
        deletes older anchors (manifest first) and every patch up to and including that anchor's version.

        Args:
            keep_versions: the window: workers at ``current - keep_versions`` or newer must be able to
                catch up by patches, and any pointer they may hold must still resolve.
        """
        if keep_versions < 0:
            raise ValueError("keep_versions must be >= 0")
        try:
            current = self._read_pointer()
        except SyncError:
            if self.signer is None:
                raise
            current = self._pointer  # an unsigned or forged pointer never steers retention: our own last one
        if current is None:
            return GcInfo(None, [], [])
        floor = current.version - keep_versions
        anchors = list_anchors(self.bucket, self.run_id)
        keep = max((v for v, objs in anchors.items() if v <= floor and complete(objs)), default=None)
        if keep is None:
            return GcInfo(None, [], [])
        deleted_anchors = []
        for v in sorted(anchors):
            if v < keep:
                prefix = anchor_prefix(self.run_id, v)
                self.bucket.delete(prefix + MANIFEST_NAME)  # first: readers then see the anchor as absent
                self.bucket.delete_prefix(prefix)
                deleted_anchors.append(v)
        deleted_patches = []
        for v in sorted(list_patches(self.bucket, self.run_id)):
            if v <= keep:
                self.bucket.delete(patch_key(self.run_id, v))
                deleted_patches.append(v)
        return GcInfo(keep, deleted_anchors, deleted_patches)
