"""Weight publishing and worker sync over the bucket: patches, anchors, pointer last, retention."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from stoa.bucket import Bucket, BucketError, ObjectExists, ObjectNotFound, PreconditionFailed
from stoa.weights.anchor import FILE_NAME, check_manifest, decode_anchor, encode_anchor
from stoa.weights.errors import AnchorError, PatchError, SyncError, WeightsError
from stoa.weights.planes import State, check_plane
from stoa.weights.pulse import DEFAULT_LEVEL, apply_patch, encode_patch, read_patch_header

POINTER_SCHEMA = "stoa.weights.pointer/1"
DEFAULT_ANCHOR_EVERY = 20
"""Anchor cadence: a late joiner pays one anchor plus at most 19 patches (~1.2 checkpoints); the trainer
uploads ~6% of a checkpoint per version on average (measurements in docs/weights.md)."""
MANIFEST_NAME = "manifest.json"
_VERSION_RE = re.compile(r"v(\d{8})")


def weights_prefix(run_id: str) -> str:
    """Key prefix of a run's weight plane, ``runs/<run>/weights/``.

    Args:
        run_id: the run id.
    """
    return f"runs/{run_id}/weights/"


def pointer_key(run_id: str) -> str:
    """Key of the pointer object.

    Args:
        run_id: the run id.
    """
    return weights_prefix(run_id) + "current.json"


def patch_key(run_id: str, version: int) -> str:
    """Key of the patch from ``version - 1`` to ``version``.

    Args:
        run_id: the run id.
        version: the version the patch produces.
    """
    return weights_prefix(run_id) + f"versions/v{version:08d}.patch"


def anchor_prefix(run_id: str, version: int) -> str:
    """Key prefix of the anchor at ``version`` (holds model.safetensors and manifest.json).

    Args:
        run_id: the run id.
        version: the anchor's version.
    """
    return weights_prefix(run_id) + f"anchors/v{version:08d}/"


@dataclass(frozen=True)
class Pointer:
    """The content of ``current.json``: which version is current and where its anchor is.

    Args:
        run_id: the run.
        version: the current policy version.
        anchor_version: the newest anchor at or before ``version``.
        plane: weight plane.
        state_hash: state hash of the weights at ``version``.
        updated_at: ISO-8601 UTC time the trainer wrote it.
        schema: pointer schema id.
        etag: the bucket etag the pointer was read with (not part of the JSON).
    """

    run_id: str
    version: int
    anchor_version: int
    plane: str
    state_hash: str
    updated_at: str
    schema: str = POINTER_SCHEMA
    etag: str | None = field(default=None, compare=False)

    def to_json(self) -> bytes:
        """Serialize (without the etag)."""
        d = asdict(self)
        d.pop("etag")
        return json.dumps(d, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, etag: str | None = None) -> Pointer:
        """Parse and validate pointer JSON; raises ``SyncError("bad_pointer")`` when malformed.

        Args:
            data: the object content.
            etag: the etag it was read with.
        """
        try:
            d = json.loads(data)
            if d.get("schema") != POINTER_SCHEMA:
                raise ValueError(f"schema {d.get('schema')!r}")
            p = cls(
                run_id=d["run_id"],
                version=d["version"],
                anchor_version=d["anchor_version"],
                plane=d["plane"],
                state_hash=d["state_hash"],
                updated_at=d["updated_at"],
                etag=etag,
            )
            types_ok = (
                isinstance(p.run_id, str) and isinstance(p.plane, str) and isinstance(p.state_hash, str)
            )
            if not types_ok or not isinstance(p.version, int) or not isinstance(p.anchor_version, int):
                raise ValueError("field types")
            if not 0 <= p.anchor_version <= p.version:
                raise ValueError(f"anchor_version {p.anchor_version} outside [0, {p.version}]")
            return p
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SyncError("bad_pointer", f"current.json: {e}") from None


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


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _list_patches(bucket: Bucket, run_id: str, after: int | None = None) -> dict[int, int]:
    prefix = weights_prefix(run_id) + "versions/"
    start = patch_key(run_id, after) if after is not None else None
    out: dict[int, int] = {}
    for obj in bucket.list(prefix, start_after=start):
        name = obj.key[len(prefix) :]
        m = re.fullmatch(r"v(\d{8})\.patch", name)
        if m:
            out[int(m.group(1))] = obj.size
    return out


def _list_anchors(bucket: Bucket, run_id: str) -> dict[int, dict[str, int]]:
    """Anchor version -> {object name: size}; an anchor is complete when it has both objects."""
    prefix = weights_prefix(run_id) + "anchors/"
    out: dict[int, dict[str, int]] = {}
    for obj in bucket.list(prefix):
        parts = obj.key[len(prefix) :].split("/")
        if len(parts) == 2 and (m := re.fullmatch(r"v(\d{8})", parts[0])):
            out.setdefault(int(m.group(1)), {})[parts[1]] = obj.size
    return out


def _complete(objs: Mapping[str, int]) -> bool:
    return FILE_NAME in objs and MANIFEST_NAME in objs


class WeightPublisher:
    """The trainer side: publish each version as a patch (and an anchor every ``anchor_every``), pointer last.

    Args:
        bucket: the bucket.
        run_id: the run.
        plane: ``"bf16"`` or ``"int8g64"``.
        anchor_every: write an anchor at every version divisible by this (and at the first publish).
        level: zstd level for patches.
    """

    def __init__(
        self,
        bucket: Bucket,
        run_id: str,
        plane: str,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        *,
        level: int = DEFAULT_LEVEL,
    ) -> None:
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        self.bucket = bucket
        self.run_id = run_id
        self.plane = check_plane(plane)
        self.anchor_every = anchor_every
        self.level = level
        self._prev: State | None = None
        self._prev_version: int | None = None
        self._pointer: Pointer | None = None
        self._pointer_read = False

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
        return p

    def resume(self) -> Pointer | None:
        """After a trainer restart: load the currently published state so the next publish is a patch.

        Returns the pointer found (None for a fresh run). Without calling this, the first publish of a
        process writes an anchor and no patch.
        """
        self._pointer = self._read_pointer()
        self._pointer_read = True
        if self._pointer is None:
            return None
        sync = WeightSync(self.bucket, self.run_id, self.plane)
        version, state = sync.sync(self._pointer)
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
            data, manifest = encode_anchor(snap, run_id=self.run_id, version=version, plane=self.plane)
            mbytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
            prefix = anchor_prefix(self.run_id, version)
            self._put_unreferenced(prefix + FILE_NAME, data)
            self._put_unreferenced(prefix + MANIFEST_NAME, mbytes)  # manifest last: marks the anchor complete
            s_hash = manifest["state_hash"]
            bytes_anchor = len(data) + len(mbytes)
            anchor_version = version
        assert s_hash is not None
        new = Pointer(self.run_id, version, anchor_version, self.plane, s_hash, _now())
        try:
            etag = self.bucket.cas(pointer_key(self.run_id), new.to_json(), current.etag if current else None)
        except PreconditionFailed:
            self._pointer_read = False
            raise WeightsError("pointer_conflict", "current.json changed under this publisher") from None
        self._pointer = Pointer(**{**asdict(new), "etag": etag})
        self._prev, self._prev_version = snap, version
        return PublishInfo(
            version, s_hash, bytes_patch, bytes_anchor, time.perf_counter() - t0, changed, elements
        )

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
        current = self._read_pointer()
        if current is None:
            return GcInfo(None, [], [])
        floor = current.version - keep_versions
        anchors = _list_anchors(self.bucket, self.run_id)
        keep = max((v for v, objs in anchors.items() if v <= floor and _complete(objs)), default=None)
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
        for v in sorted(_list_patches(self.bucket, self.run_id)):
            if v <= keep:
                self.bucket.delete(patch_key(self.run_id, v))
                deleted_patches.append(v)
        return GcInfo(keep, deleted_anchors, deleted_patches)


@dataclass
class _Plan:
    path: str
    anchor: int | None
    patches: list[int]
    nbytes: int


class WeightSync:
    """The worker side: poll the pointer cheaply and catch up to verified weights.

    ``state`` and ``version`` always hold the last verified weights (or None before the first sync).
    Returned states are never modified afterwards; each sync builds a new one.

    Args:
        bucket: the bucket.
        run_id: the run to follow.
        plane: the plane to follow.
        max_attempts: how often a sync re-reads the pointer when objects vanish under it (retention).
    """

    def __init__(self, bucket: Bucket, run_id: str, plane: str, *, max_attempts: int = 3) -> None:
        self.bucket = bucket
        self.run_id = run_id
        self.plane = check_plane(plane)
        self.max_attempts = max_attempts
        self.version: int | None = None
        self.state: State | None = None
        self.state_hash: str | None = None
        self.pointer: Pointer | None = None
        self.metrics: dict[str, Any] = {}
        self.totals: dict[str, float] = {
            "syncs": 0,
            "bytes": 0,
            "seconds": 0.0,
            "fallbacks": 0,
            "failures": 0,
        }

    @property
    def last_metrics(self) -> dict[str, Any]:
        """Alias of ``metrics``: what the last sync did (path, bytes, seconds, versions_applied, ...)."""
        return self.metrics

    def _check_pointer(self, p: Pointer) -> Pointer:
        if p.run_id != self.run_id:
            raise SyncError("wrong_run", f"current.json is for run {p.run_id!r}, not {self.run_id!r}")
        if p.plane != self.plane:
            raise SyncError(
                "wrong_plane", f"current.json is plane {p.plane!r}, worker follows {self.plane!r}"
            )
        return p

    def poll(self) -> Pointer | None:
        """Conditional GET of the pointer; returns it while the local verified weights are not at it.

        Cheap when nothing changed (the bucket answers from the etag). Returns None when the worker is
        current or the run has no pointer yet; after a failed sync it keeps returning the pointer, so a
        ``if (p := sync.poll()): sync.sync(p)`` loop retries.
        """
        etag = self.pointer.etag if self.pointer is not None else None
        try:
            got = self.bucket.get_if_changed(pointer_key(self.run_id), etag)
        except ObjectNotFound:
            return None
        if got is not None:
            self.pointer = self._check_pointer(Pointer.from_json(got[0], got[1]))
        p = self.pointer
        if p is None or (p.version == self.version and p.state_hash == self.state_hash):
            return None
        return p

    def _read_pointer(self) -> Pointer:
        try:
            data, etag = self.bucket.get_with_etag(pointer_key(self.run_id))
        except ObjectNotFound:
            raise SyncError("no_pointer", f"no {pointer_key(self.run_id)} yet") from None
        self.pointer = self._check_pointer(Pointer.from_json(data, etag))
        return self.pointer

    def _plans(self, target: Pointer) -> list[_Plan]:
        local = self.version if self.state is not None else None
        anchors = {v: o for v, o in _list_anchors(self.bucket, self.run_id).items() if _complete(o)}
        candidates = sorted((v for v in anchors if v <= target.version), reverse=True)
        starts = candidates[:2] + ([local] if local is not None else [])
        lowest = min(starts) if starts else None
        patches = _list_patches(self.bucket, self.run_id, after=lowest)

        def chain(start: int) -> list[int] | None:
            need = list(range(start + 1, target.version + 1))
            return need if all(v in patches for v in need) else None

        plans = []
        if local is not None and local <= target.version and (c := chain(local)) is not None:
            plans.append(_Plan("patches", None, c, sum(patches[v] for v in c)))
        anchor_plans = []
        for a in candidates[:2]:  # the newest anchor, and one older in case it is damaged
            c = chain(a)
            if c is not None:
                size = anchors[a][FILE_NAME] + anchors[a][MANIFEST_NAME] + sum(patches[v] for v in c)
                anchor_plans.append(_Plan("anchor", a, c, size))
        plans.sort(key=lambda p: p.nbytes)
        # Patches first only if cheaper than the best anchor path; anchors stay as fallbacks in order.
        if plans and anchor_plans and anchor_plans[0].nbytes < plans[0].nbytes:
            return anchor_plans + plans
        return plans + anchor_plans

    def _fetch(self, key: str, counter: dict[str, Any]) -> bytes:
        data = self.bucket.get(key)
        counter["bytes"] += len(data)
        return data

    def _run_plan(self, plan: _Plan, target: Pointer, counter: dict[str, Any]) -> tuple[State, str]:
        if plan.anchor is not None:
            prefix = anchor_prefix(self.run_id, plan.anchor)
            manifest = json.loads(self._fetch(prefix + MANIFEST_NAME, counter))
            check_manifest(manifest, run_id=self.run_id, version=plan.anchor, plane=self.plane)
            state = decode_anchor(self._fetch(prefix + FILE_NAME, counter), manifest)
            version, s_hash, owned = plan.anchor, str(manifest["state_hash"]), True
        else:
            assert self.state is not None and self.version is not None and self.state_hash is not None
            state, version, s_hash, owned = self.state, self.version, self.state_hash, False
        for v in plan.patches:
            patch = self._fetch(patch_key(self.run_id, v), counter)
            state, info = apply_patch(
                state,
                patch,
                run_id=self.run_id,
                expected_from_version=version,
                plane=self.plane,
                expected_from_hash=s_hash,
                inplace=owned,
            )
            owned = True  # after the first copy, later patches can work in place on our own arrays
            version, s_hash = info.to_version, info.state_hash
            counter["versions_applied"] += 1
        if version != target.version or s_hash != target.state_hash:
            raise SyncError(
                "verification_failed",
                f"reached v{version} {s_hash}, pointer says v{target.version} {target.state_hash}",
            )
        return state, s_hash

    def sync(self, target: Pointer | None = None) -> tuple[int, State]:
        """Catch up to the pointer's version with verified weights.

        Chooses patches from the local version or the newest anchor at or before the target plus the
        patches after it, whichever lists fewer bytes; verifies every patch, anchor and the final state
        hash against the pointer; on any failure falls back to the next path (anchors last). If every
        path fails, the previous verified weights stay in place and :class:`SyncError` is raised (retry
        later). ``self.metrics`` describes the last attempt.

        Args:
            target: the pointer to reach (e.g. from :meth:`poll`); default: read the pointer now.

        Returns:
            (version, state) of the verified weights.
        """
        t0 = time.perf_counter()
        counter: dict[str, Any] = {"bytes": 0, "versions_applied": 0, "rejected": 0}
        errors: list[str] = []
        path = "none"
        pointer = self._check_pointer(target) if target is not None else self._read_pointer()
        try:
            for attempt in range(self.max_attempts):
                if attempt:
                    pointer = self._read_pointer()
                if self.version == pointer.version and self.state_hash == pointer.state_hash:
                    path = "current"
                    break
                path, vanished = self._try_plans(self._plans(pointer), pointer, counter, errors)
                if path != "none" or not vanished:
                    break
        except BucketError as e:
            self.totals["failures"] += 1
            self._record(t0, counter, "failed", [*errors, f"bucket: {e}"], pointer)
            raise SyncError("unavailable", f"bucket error during sync (keeping v{self.version}): {e}") from e
        if path == "none":
            self.totals["failures"] += 1
            self._record(t0, counter, "failed", errors, pointer)
            raise SyncError(
                "verification_failed" if counter["rejected"] else "unavailable",
                f"could not reach verified v{pointer.version} (keeping v{self.version}): "
                + "; ".join(errors),
            )
        self._record(t0, counter, path, errors, pointer)
        assert self.state is not None and self.version is not None
        return self.version, self.state

    def _try_plans(
        self, plans: list[_Plan], pointer: Pointer, counter: dict[str, Any], errors: list[str]
    ) -> tuple[str, bool]:
        """Run plans in order until one verifies; returns (path taken or "none", whether objects vanished)."""
        if not plans:
            errors.append(f"no complete chain of objects to v{pointer.version}")
            return "none", True  # e.g. retention ran between our pointer read and the listing
        for plan in plans:
            try:
                state, s_hash = self._run_plan(plan, pointer, counter)
            except ObjectNotFound as e:  # retention removed something under us: re-read the pointer
                errors.append(f"{plan.path}: object vanished: {e}")
                return "none", True
            except (PatchError, AnchorError, SyncError, ValueError) as e:
                errors.append(f"{plan.path}{'' if plan.anchor is None else f'@v{plan.anchor}'}: {e}")
                self.totals["fallbacks"] += 1
                counter["rejected"] += 1
                continue
            self.state, self.version, self.state_hash = state, pointer.version, s_hash
            return plan.path, False
        return "none", False

    def _record(
        self, t0: float, counter: dict[str, Any], path: str, errors: list[str], pointer: Pointer
    ) -> None:
        seconds = time.perf_counter() - t0
        self.metrics = {
            "path": path,
            "bytes": counter["bytes"],
            "seconds": seconds,
            "versions_applied": counter["versions_applied"],
            "target_version": pointer.version,
            "version": self.version,
            "errors": errors,
        }
        self.totals["syncs"] += 1
        self.totals["bytes"] += counter["bytes"]
        self.totals["seconds"] += seconds
