"""The worker side of the weight plane: poll the pointer, catch up through verified patches or anchors."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stoa.bucket import Bucket, BucketError, ObjectNotFound
from stoa.layout import anchor_prefix, patch_key, pointer_key
from stoa.weights.anchor import FILE_NAME, MAX_MANIFEST_BYTES, check_manifest, decode_anchor, load_manifest
from stoa.weights.errors import AnchorError, PatchError, SyncError, WeightsError
from stoa.weights.planes import State, check_plane
from stoa.weights.pointer import MANIFEST_NAME, Pointer, complete, list_anchors, list_patches
from stoa.weights.pulse import apply_patch

__all__ = ["MAX_MANIFEST_BYTES", "Refusal", "WeightSync", "chain_to"]
_PATCH_SLACK = 16 << 20


@dataclass(frozen=True)
class Refusal:
    """One object a sync refused to trust.

    Args:
        key: the object refused; for a chain that verifies but disagrees with the pointer, the pointer key.
        reason: machine-readable cause (the ``WeightsError`` reason, e.g. ``checksum``, ``pointer_mismatch``).
        detail: human-readable explanation.
        plan: the plan it was part of: ``patches`` or ``anchor@v<k>``.
    """

    key: str
    reason: str
    detail: str
    plan: str


@dataclass
class _Plan:
    path: str
    anchor: int | None
    patches: list[int]
    nbytes: int
    sizes: dict[int, int] = field(default_factory=dict)  # patch version -> listed size
    anchor_sizes: dict[str, int] = field(default_factory=dict)  # object name -> listed size

    @property
    def label(self) -> str:
        return self.path if self.anchor is None else f"{self.path}@v{self.anchor}"


class _Refused(Exception):
    """Internal: a plan stopped at an object it could not trust."""

    def __init__(self, key: str, error: WeightsError) -> None:
        super().__init__(str(error))
        self.key = key
        self.error = error


def _patch_cap(state: State) -> int:
    """Largest patch that can be honest for ``state``: every element changed, plus generous slack."""
    return _PATCH_SLACK + 2 * sum(int(a.size) * (4 + a.dtype.itemsize) for a in state.values())


def chain_to(start: int, top: int, patches: Mapping[int, int]) -> list[int] | None:
    """The patch versions ``start + 1 .. top`` when every one is listed, else None; walks only what is listed.

    ``top`` comes from the pointer, which anyone with bucket access can write: the walk stops at the first
    missing patch, so it takes at most ``len(patches)`` steps and never sizes anything by ``top``.

    Args:
        start: the version held (or an anchor's).
        top: the pointer's version.
        patches: the listed patches (version -> size).
    """
    need: list[int] = []
    v = start
    while v < top and v + 1 in patches:
        v += 1
        need.append(v)
    return need if v == top else None


class WeightSync:
    """The worker side: poll the pointer cheaply and catch up to verified weights.

    ``state`` and ``version`` always hold the last verified weights (or None before the first sync).
    Returned states are never modified afterwards; each sync builds a new one. ``refusals`` lists the
    objects the last sync refused (also when a fallback plan then succeeded).

    Args:
        bucket: the bucket.
        run_id: the run to follow.
        plane: the plane to follow.
        max_attempts: how often a sync re-reads the pointer when objects vanish under it (retention).
        run_key: the run's public key (hex, from the contract, pinned by the caller): every pointer read from
            the bucket (:meth:`poll`, or a sync without a target) must carry its signature, else it is refused
            (``unsigned``, ``malformed_signature``, ``bad_signature``), as is a signed pointer older than one
            already seen (``rollback``), and the held weights stay. "" follows an unsigned run.
        check: called on every state that verified, before it is adopted; a ``WeightsError`` it raises refuses
            that plan like a damaged object (the adapter plane's rank and shape checks, ``stoa.weights.adapter``).
    """

    def __init__(self, bucket: Bucket, run_id: str, plane: str, *, max_attempts: int = 3,
                 run_key: str = "", check: Callable[[State], None] | None = None) -> None:
        self.bucket = bucket
        self.run_id = run_id
        self.plane = check_plane(plane)
        self.run_key = run_key
        self.newest_signed: int | None = None
        """The highest version of a pointer whose signature verified (a signed run never goes back)."""
        self.max_attempts = max_attempts
        self.check = check
        self.version: int | None = None
        self.state: State | None = None
        self.state_hash: str | None = None
        self.pointer: Pointer | None = None
        self.metrics: dict[str, Any] = {}
        self.refusals: list[Refusal] = []
        self.totals: dict[str, float] = {"syncs": 0, "bytes": 0, "seconds": 0.0, "fallbacks": 0, "failures": 0}

    @property
    def last_metrics(self) -> dict[str, Any]:
        """Alias of ``metrics``: what the last sync did (path, bytes, seconds, versions_applied, ...)."""
        return self.metrics

    def _check_pointer(self, p: Pointer) -> Pointer:
        if p.run_id != self.run_id:
            raise SyncError("wrong_run", f"current.json is for run {p.run_id!r}, not {self.run_id!r}")
        if p.plane != self.plane:
            raise SyncError("wrong_plane", f"current.json is plane {p.plane!r}, worker follows {self.plane!r}")
        return p

    def _accept(self, p: Pointer) -> Pointer:
        """A pointer read from the bucket: the run and plane, and on a signed run its signature and version."""
        self._check_pointer(p)
        if not self.run_key:
            return p
        p.check_signature(self.run_key)
        if self.newest_signed is not None and p.version < self.newest_signed:
            raise SyncError("rollback", f"current.json names v{p.version}, signed, but this client already saw the "
                                        f"signed v{self.newest_signed}: an old pointer was put back")
        self.newest_signed = p.version
        return p

    def poll(self) -> Pointer | None:
        """Conditional GET of the pointer; returns it while the local verified weights are not at it.

        Cheap when nothing changed (the bucket answers from the etag). Returns None when the worker is
        current or the run has no pointer yet; after a failed sync it keeps returning the pointer, so a
        ``if (p := sync.poll()): sync.sync(p)`` loop retries. A malformed pointer raises ``SyncError``.
        """
        etag = self.pointer.etag if self.pointer is not None else None
        try:
            got = self.bucket.get_if_changed(pointer_key(self.run_id), etag)
        except ObjectNotFound:
            return None
        if got is not None:
            self.pointer = self._accept(Pointer.from_json(got[0], got[1]))
        p = self.pointer
        if p is None or (p.version == self.version and p.state_hash == self.state_hash):
            return None
        return p

    def _read_pointer(self) -> Pointer:
        try:
            data, etag = self.bucket.get_with_etag(pointer_key(self.run_id))
        except ObjectNotFound:
            raise SyncError("no_pointer", f"no {pointer_key(self.run_id)} yet") from None
        self.pointer = self._accept(Pointer.from_json(data, etag))
        return self.pointer

    def _plans(self, target: Pointer) -> list[_Plan]:
        local = self.version if self.state is not None else None
        listed = list_anchors(self.bucket, self.run_id)
        anchors = {v: o for v, o in listed.items() if complete(o)}
        candidates = sorted((v for v in anchors if v <= target.version), reverse=True)
        starts = candidates[:2] + ([local] if local is not None else [])
        lowest = min(starts) if starts else None
        patches = list_patches(self.bucket, self.run_id, after=lowest)
        newest = max([*listed, *patches], default=None)
        if newest is None or target.version > newest:
            raise SyncError("pointer_ahead", f"current.json names v{target.version} but the newest weights object "
                                             f"listed is {'none' if newest is None else f'v{newest}'}")

        def chain(start: int) -> list[int] | None:
            return chain_to(start, target.version, patches)

        plans = []
        if local is not None and local <= target.version and (c := chain(local)) is not None:
            plans.append(_Plan("patches", None, c, sum(patches[v] for v in c), {v: patches[v] for v in c}))
        anchor_plans = []
        for a in candidates[:2]:  # the newest anchor, and one older in case it is damaged
            c = chain(a)
            if c is not None:
                size = anchors[a][FILE_NAME] + anchors[a][MANIFEST_NAME] + sum(patches[v] for v in c)
                anchor_plans.append(_Plan("anchor", a, c, size, {v: patches[v] for v in c}, anchors[a]))
        plans.sort(key=lambda p: p.nbytes)
        # Patches first only if cheaper than the best anchor path; anchors stay as fallbacks in order.
        if plans and anchor_plans and anchor_plans[0].nbytes < plans[0].nbytes:
            return anchor_plans + plans
        return plans + anchor_plans

    def _fetch(self, key: str, counter: dict[str, Any]) -> bytes:
        data = self.bucket.get(key)
        counter["bytes"] += len(data)
        return data

    def _load_anchor(self, version: int, listed: dict[str, int], counter: dict[str, Any]) -> tuple[State, str]:
        """Fetch and verify one anchor; refuses oversize objects before reading them."""
        prefix = anchor_prefix(self.run_id, version)
        key = prefix + MANIFEST_NAME
        try:
            if listed.get(MANIFEST_NAME, 0) > MAX_MANIFEST_BYTES:
                raise AnchorError("oversize", f"listed at {listed[MANIFEST_NAME]} bytes")
            manifest = load_manifest(self._fetch(key, counter))
            check_manifest(manifest, run_id=self.run_id, version=version, plane=self.plane)
            key = prefix + FILE_NAME
            if FILE_NAME in listed and listed[FILE_NAME] != manifest["size"]:
                raise AnchorError("bad_format",
                                  f"listed at {listed[FILE_NAME]} bytes, manifest says {manifest['size']}")
            return decode_anchor(self._fetch(key, counter), manifest), str(manifest["state_hash"])
        except WeightsError as e:
            raise _Refused(key, e) from None

    def _apply(self, state: State, version: int, s_hash: str, v: int, plan: _Plan, counter: dict[str, Any],
               owned: bool) -> tuple[State, str]:
        """Fetch and apply the patch producing ``v``; refuses an oversize one unread."""
        key = patch_key(self.run_id, v)
        try:
            if plan.sizes.get(v, 0) > _patch_cap(state):
                raise PatchError("oversize", f"listed at {plan.sizes[v]} bytes, more than any honest patch")
            state, info = apply_patch(state, self._fetch(key, counter), run_id=self.run_id,
                                      expected_from_version=version, plane=self.plane,
                                      expected_from_hash=s_hash, inplace=owned)
        except WeightsError as e:
            raise _Refused(key, e) from None
        counter["versions_applied"] += 1
        return state, info.state_hash

    def _run_plan(self, plan: _Plan, target: Pointer, counter: dict[str, Any]) -> tuple[State, str]:
        if plan.anchor is not None:
            state, s_hash = self._load_anchor(plan.anchor, plan.anchor_sizes, counter)
            version, owned = plan.anchor, True
        else:
            assert self.state is not None and self.version is not None and self.state_hash is not None
            state, version, s_hash, owned = self.state, self.version, self.state_hash, False
        for v in plan.patches:
            state, s_hash = self._apply(state, version, s_hash, v, plan, counter, owned)
            version, owned = v, True  # after the first copy, later patches work in place on our own arrays
        if version != target.version or s_hash != target.state_hash:
            raise _Refused(pointer_key(self.run_id), SyncError(
                "pointer_mismatch", f"reached v{version} {s_hash}, pointer says v{target.version} {target.state_hash}"))
        if self.check is not None:
            try:
                self.check(state)
            except WeightsError as e:
                raise _Refused(pointer_key(self.run_id), e) from None
        return state, s_hash

    def sync(self, target: Pointer | None = None) -> tuple[int, State]:
        """Catch up to the pointer's version with verified weights.

        Chooses patches from the local version or the newest anchor at or before the target plus the
        patches after it, whichever lists fewer bytes; verifies every patch, anchor and the final state
        hash against the pointer; on any failure falls back to the next path (anchors last). If every
        path fails, the previous verified weights stay in place and :class:`SyncError` is raised (retry
        later). ``self.metrics`` describes the last attempt and ``self.refusals`` what it refused. A pointer
        whose version is above every patch and anchor listed (planted: the trainer writes the pointer last)
        is refused as ``pointer_ahead`` before anything is fetched; nothing is sized by its version.

        Args:
            target: the pointer to reach: from :meth:`poll`, or bound to it by the hash chain (the evaluator's
                intermediate versions); its signature is not checked again. Default: read the pointer now.

        Returns:
            (version, state) of the verified weights.
        """
        t0 = time.perf_counter()
        counter: dict[str, Any] = {"bytes": 0, "versions_applied": 0, "rejected": 0}
        errors: list[str] = []
        self.refusals = []
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
        except SyncError as e:  # pointer_ahead: nothing listed reaches the pointer's version
            self.totals["failures"] += 1
            self.refusals.append(Refusal(pointer_key(self.run_id), e.reason, e.detail, "pointer"))
            self._record(t0, counter, "failed", [*errors, str(e)], pointer)
            raise SyncError(e.reason, f"{e.detail} (keeping v{self.version})") from None
        if path == "none":
            self.totals["failures"] += 1
            self._record(t0, counter, "failed", errors, pointer)
            raise SyncError(
                "verification_failed" if counter["rejected"] else "unavailable",
                f"could not reach verified v{pointer.version} (keeping v{self.version}): " + "; ".join(errors),
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
            except _Refused as r:
                errors.append(f"{plan.label}: {r.error}")
                self.refusals.append(Refusal(r.key, r.error.reason, r.error.detail, plan.label))
                self.totals["fallbacks"] += 1
                counter["rejected"] += 1
                continue
            self.state, self.version, self.state_hash = state, pointer.version, s_hash
            return plan.path, False
        return "none", False

    def newest_verified(self, target: Pointer | None = None) -> tuple[int, State]:
        """The newest state at or below the pointer that verifies; for a trainer that lost its own copy.

        The pointer's own version when any plan reaches it (then this is :meth:`sync`); otherwise the
        newest anchor that verifies, plus the longest run of patches after it that verify. Never trusts
        an unverified object. The held state changes only when the pointer's version is reached.

        Args:
            target: the pointer (default: read it now).

        Raises:
            SyncError: no anchor at or below the pointer verifies (``verification_failed``).
            BucketError: the bucket failed (an outage, not damage: retry).
        """
        pointer = self._check_pointer(target) if target is not None else self._read_pointer()
        try:
            return self.sync(pointer)
        except SyncError as e:
            if isinstance(e.__cause__, BucketError):
                raise e.__cause__ from None
        kept = list(self.refusals)
        try:
            anchors = {v: o for v, o in list_anchors(self.bucket, self.run_id).items() if complete(o)}
            patches = list_patches(self.bucket, self.run_id)
            for a in sorted((v for v in anchors if v <= pointer.version), reverse=True):
                found = self._longest_chain(a, anchors[a], patches, pointer.version, kept)
                if found is not None:
                    return found
        finally:
            self.refusals = kept
        raise SyncError("verification_failed", f"no anchor at or below v{pointer.version} verifies")

    def _longest_chain(self, a: int, listed: dict[str, int], patches: dict[int, int], top: int,
                       refusals: list[Refusal]) -> tuple[int, State] | None:
        counter: dict[str, Any] = {"bytes": 0, "versions_applied": 0}
        plan = _Plan("anchor", a, [], 0, dict(patches), listed)
        try:
            state, s_hash = self._load_anchor(a, listed, counter)
        except (_Refused, ObjectNotFound) as r:
            if isinstance(r, _Refused):
                refusals.append(Refusal(r.key, r.error.reason, r.error.detail, plan.label))
            return None
        version = a
        while version < top and version + 1 in patches:
            try:
                state, s_hash = self._apply(state, version, s_hash, version + 1, plan, counter, True)
            except _Refused as r:
                refusals.append(Refusal(r.key, r.error.reason, r.error.detail, plan.label))
                break
            except ObjectNotFound:
                break
            version += 1
        return version, state

    def _record(self, t0: float, counter: dict[str, Any], path: str, errors: list[str], pointer: Pointer) -> None:
        seconds = time.perf_counter() - t0
        self.metrics = {
            "path": path,
            "bytes": counter["bytes"],
            "seconds": seconds,
            "versions_applied": counter["versions_applied"],
            "target_version": pointer.version,
            "version": self.version,
            "errors": errors,
            "refusals": len(self.refusals),
        }
        self.totals["syncs"] += 1
        self.totals["bytes"] += counter["bytes"]
        self.totals["seconds"] += seconds
