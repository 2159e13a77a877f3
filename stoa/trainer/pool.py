"""Rollout intake: list new records inside the staleness window, validate, score, filter, count reuse.

Records of a multi-turn task are replayed with the trainer's own tools (``stoa.episodes.replay``) before their
rewards are recomputed from the replayed episode text; tools that cannot answer leave the record unread, to
be retried on the next refresh like a bucket outage.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from stoa.bucket import Bucket, BucketError, ObjectInfo
from stoa.contract import RunContract
from stoa.envs.base import Environment, ToolResult, Tools, ToolUnavailable
from stoa.episodes.replay import Replayed, replay_group, unreplayed
from stoa.identity import IdentityBook
from stoa.layout import parse_rollout_key, rollout_version_prefix
from stoa.rollouts.episode import EpisodeLimits, ToolCall
from stoa.rollouts.records import MAX_RECORD_BYTES, RecordRejected, RolloutRecord, validate_record
from stoa.schemas.journal import PoolUse
from stoa.tasks.base import Prompt, RewardError, Task
from stoa.tasks.multiturn import MultiTurnTask, episode_limits, is_multiturn
from stoa.tasks.scoring import score_group
from stoa.telemetry.cost import WorkerReports
from stoa.tokenize import TextCodec

log = logging.getLogger(__name__)

FETCH_THREADS = 16
"""Concurrent requests of one refresh: LISTs (one per version of the window), then GETs of new records."""
FETCH_BATCH = 64
"""New records fetched before they are checked: bounds the bytes held at once to FETCH_BATCH x MAX_RECORD_BYTES."""
REPLAY_VERSIONS = 64
"""Versions a taken record's samples are remembered for: the same samples and logprobs relabelled to another version
inside this horizon are a ``replayed`` rejection (journaled: a restarted trainer still refuses them)."""


@dataclass
class Entry:
    """A validated group waiting to be trained on."""

    key: str
    record: RolloutRecord
    rewards: np.ndarray  # [n] float32, recomputed by the trainer
    uses: int = 0
    content_id: str = ""  # the reuse cap counts this, not the key (copies share it)
    replayed: list[Replayed] | None = None
    """Multi-turn tasks: one ``Replayed`` per sample (episode text, turn of each token, anchor states); None
    for single-turn tasks."""
    signer: str = ""
    """The worker key that signed the record (hex; empty in a run without worker keys)."""


@dataclass
class PoolStats:
    """Counters since the last ``drain_stats`` call."""

    accepted: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    dropped_stale: int = 0
    reward_mismatch: int = 0
    filtered: int = 0
    skipped_uniform: int = 0
    """Groups whose rewards all agreed, dropped before training (``take(skip_uniform=True)``)."""
    tokens: int = 0
    replay_s: float = 0.0
    """Seconds spent replaying multi-turn records (tool calls included)."""
    tool_calls: int = 0
    """Tool calls the replays sent to the trainer's tools."""
    unreplayed: int = 0
    """Multi-turn records taken with the observations the worker recorded (``replay = false``)."""


class WorkerGate(Protocol):
    """What the pool asks of worker quarantine (``stoa.trainer.quarantine``)."""

    def observe(self, worker_id: str, accepted: bool) -> None: ...

    def is_quarantined(self, worker_id: str) -> bool: ...


class RecordPool:
    """Holds usable groups; everything read from the bucket is untrusted.

    Only keys of the exact record pattern of this run are read (others are rejected as ``key`` once),
    objects the listing reports as oversize are never fetched, and a record's content id (not its
    key) is what the reuse cap counts: the same content under another key is a ``duplicate``, the same samples
    and logprobs relabelled to another version (``REPLAY_VERSIONS``) a ``replayed`` rejection.

    Args:
        bucket: the run's bucket.
        contract: the run contract records must match.
        task: the task, to regenerate prompts and recompute rewards.
        codec: tokenizer, to check prompt tokens and decode completions.
        staleness_bound: max ``current - policy_version`` of a usable record.
        reuse_cap: max optimizer steps a record may feed.
        gate: worker quarantine; records of a quarantined worker are skipped (``quarantined``).
        tools: the trainer's own tools (``task.make_tools(searcher)``); required for a multi-turn task, whose
            records are replayed with them.
        replay: False takes a multi-turn record's observations as recorded, without tools (``replay = false``).
        identities: the run's worker keys (``worker_keys``): every record must be signed by a valid, unrevoked
            identity of the worker it names, checked before anything else is read; a key revoked since drops
            its waiting groups at the next refresh. None: a run without worker keys.

    Raises:
        ValueError: a multi-turn task without ``tools``.
    """

    def __init__(self, bucket: Bucket, contract: RunContract, task: Task, codec: TextCodec, *,
                 staleness_bound: int, reuse_cap: int, gate: WorkerGate | None = None, tools: Tools | None = None,
                 replay: bool = True, identities: IdentityBook | None = None):
        self.bucket, self.contract, self.task, self.codec = bucket, contract, task, codec
        self.identities = identities
        self.staleness_bound, self.reuse_cap, self.gate = staleness_bound, reuse_cap, gate
        self.limits: EpisodeLimits | None = None
        self.tools: _CountingTools | None = None
        self.make_env: Callable[[Prompt, int], Environment] | None = None
        self.replay = replay
        if is_multiturn(task):
            if tools is None and replay:
                raise ValueError(f"tools: the multi-turn task {task.id!r} needs the trainer's tools "
                                 "(task.make_tools(searcher)) to replay records")
            multi = cast(MultiTurnTask, task)
            self.limits = episode_limits(multi, contract.sampling.max_new_tokens)
            self.tools = _CountingTools(tools) if tools is not None else None
            self.make_env = multi.make_env
        self.tools_down = False  # the trainer's tools failed; warned once until a replay succeeds
        self.entries: dict[str, Entry] = {}  # by content id
        self.uses: dict[str, _Use] = {}  # every content id taken, pruned to the window, journaled
        self.replays: dict[str, _Use] = {}  # version-free content id -> the accepted record's version and key
        self.seen: dict[str, int] = {}  # key -> listed version: read once (accepted or rejected)
        self.stats = PoolStats()
        self.reports = WorkerReports()  # the bucket requests workers say they made (``cost/*``)

    def state(self) -> dict[str, Any]:
        """JSON-able state for the trainer journal: per content id inside the window, its version, use
        count and the key it was taken under; per replay id inside ``REPLAY_VERSIONS``, the same."""
        def rows(uses: dict[str, _Use]) -> dict[str, list[Any]]:
            return {c: PoolUse(u.version, u.count, u.key).to_json() for c, u in uses.items()}

        return {"records": rows(self.uses), **({"replays": rows(self.replays)} if self.replays else {})}

    def restore(self, state: dict[str, Any]) -> None:
        """Restore use counts from a journal; malformed entries are ignored.

        Args:
            state: what ``state()`` returned.
        """
        for name, into in (("records", self.uses), ("replays", self.replays)):
            rows = state.get(name, {}) if isinstance(state, dict) else {}
            for cid, row in (rows.items() if isinstance(rows, dict) else ()):
                if (use := PoolUse.parse(row)) is not None:
                    into[str(cid)] = _Use(use.version, use.count, use.key)

    def refresh(self, current_version: int) -> int:
        """List and ingest records of the versions inside the window; return how many were accepted.

        A listing that fails (bucket outage) ends this refresh early; the next one lists again.

        Args:
            current_version: the trainer's current policy version.
        """
        low = max(1, current_version - self.staleness_bound)
        if self.identities is not None:
            self._apply_revocations()
        for cid in [c for c, e in self.entries.items() if e.record.policy_version < low]:
            del self.entries[cid]
            self.stats.dropped_stale += 1
        self.uses = {c: u for c, u in self.uses.items() if u.version >= low}
        self.seen = {k: v for k, v in self.seen.items() if v >= low}
        self.replays = {r: u for r, u in self.replays.items() if u.version > current_version - REPLAY_VERSIONS}
        accepted = 0
        # Keys sort by worker, not arrival, so a start-after cursor would skip late records of
        # early-sorting workers; each version inside the window is listed whole instead (cost grows
        # with the window, never with history). The versions are listed concurrently, and new records
        # fetched FETCH_THREADS at a time, FETCH_BATCH per batch, then checked one by one in listing order.
        new = [(v, info) for v, infos in self._list_window(low, current_version)
               for info in infos if info.key not in self.seen]
        try:
            for start in range(0, len(new), FETCH_BATCH):
                batch = new[start:start + FETCH_BATCH]
                fetched = self._fetch([info.key for v, info in batch if self._fetchable(info, v)])
                for v, info in batch:
                    self.seen[info.key] = v
                    accepted += self._ingest(info, v, current_version, fetched.get(info.key))
        except ToolUnavailable as e:
            if not self.tools_down:
                log.warning("the trainer's tools cannot replay records, retrying on the next poll: %s", e)
            self.tools_down = True
        return accepted

    def _apply_revocations(self) -> None:
        """Read new identities and revocations; drop waiting groups whose signing key is now revoked."""
        assert self.identities is not None
        self.identities.refresh()
        for cid in [c for c, e in self.entries.items() if e.signer in self.identities.revoked]:
            self._reject(self.entries.pop(cid).key, None, "revoked", "its worker key was revoked while it waited")

    def _list_window(self, low: int, high: int) -> list[tuple[int, list[ObjectInfo]]]:
        """List the record prefixes of versions ``low..high`` concurrently; a listing that fails (bucket
        outage) is left out with a warning, and listed again on the next poll."""
        versions = range(low, high + 1)
        if not versions:
            return []
        with ThreadPoolExecutor(min(FETCH_THREADS, len(versions))) as ex:
            futures = [(v, ex.submit(lambda p: list(self.bucket.list(p)),
                                     rollout_version_prefix(self.contract.run_id, v))) for v in versions]
        listed = []
        for v, future in futures:
            try:
                listed.append((v, future.result()))
            except BucketError as e:
                log.warning("listing records of v%d failed, retrying on the next poll: %s", v, e)
        return listed

    def _fetchable(self, info: ObjectInfo, version: int) -> bool:
        """Whether ``_ingest`` would read this listed object (its key, size and worker admit it)."""
        parsed = parse_rollout_key(self.contract.run_id, info.key)
        return (parsed is not None and parsed.version == version and info.size <= MAX_RECORD_BYTES
                and not (self.gate is not None and self.gate.is_quarantined(parsed.worker_id)))

    def _fetch(self, keys: list[str]) -> dict[str, bytes | BucketError]:
        """GET ``keys`` concurrently; a failed read maps to its error."""
        if len(keys) <= 1:
            return {k: self._get(k) for k in keys}
        with ThreadPoolExecutor(min(FETCH_THREADS, len(keys))) as ex:
            return dict(zip(keys, ex.map(self._get, keys), strict=True))

    def _get(self, key: str) -> bytes | BucketError:
        try:
            return self.bucket.get(key)
        except BucketError as e:
            return e

    def _reject(self, key: str, worker: str | None, reason: str, detail: Any) -> int:
        self.stats.rejected[reason] += 1
        # Duplicates (and replays) are not held against a worker: a collapsed policy makes honest identical groups,
        # and anyone can copy a worker's records under its id.
        # Nor is a reward function that fails: the trainer's own code (an honest worker's text may trip it).
        if (worker is not None and self.gate is not None and reason not in ("quarantined", "duplicate", "replayed")
                and not reason.startswith("reward_")):
            self.gate.observe(worker, accepted=False)
        log.warning("rejected %.200r: %s: %.300s", key, reason, detail)  # bounded: a listed key may be any length
        return 0

    def _ingest(self, info: ObjectInfo, version: int, current_version: int,
                fetched: bytes | BucketError | None = None) -> int:
        parsed = parse_rollout_key(self.contract.run_id, info.key)
        if parsed is None or parsed.version != version:
            return self._reject(info.key, None, "key", "not a record key of this run")
        if info.size > MAX_RECORD_BYTES:
            owner = parsed.worker_id if self.identities is None else None  # unsigned yet: nobody's doing
            return self._reject(info.key, owner, "oversize", f"{info.size} bytes listed")
        if self.gate is not None and self.gate.is_quarantined(parsed.worker_id):
            return self._reject(info.key, parsed.worker_id, "quarantined", parsed.worker_id)
        data = self._get(info.key) if fetched is None else fetched  # None: not prefetched
        if isinstance(data, BucketError):
            log.warning("could not read %r: %s", info.key, data)
            del self.seen[info.key]  # retry on the next refresh
            return 0
        signer = ""
        if self.identities is not None:
            try:
                signer = self.identities.check_record(info.key, parsed.worker_id, data)
            except RecordRejected as e:  # not held against the worker: without its key nobody can frame it
                return self._reject(info.key, None, e.reason, e)
        try:
            checked = self._check(data, version, current_version)
            rec, rewards = checked.record, checked.rewards
            if rec.worker_id != parsed.worker_id:  # one identity per record: the key's
                raise RecordRejected("key", f"header worker {rec.worker_id!r} under a key of {parsed.worker_id!r}")
        except RecordRejected as e:
            return self._reject(info.key, parsed.worker_id, e.reason, e)
        except ToolUnavailable:
            del self.seen[info.key]  # not the record's fault: read it again on the next refresh
            raise
        self.reports.observe(rec.worker_id, rec.timings)
        cid, prior = rec.content_id(), self.uses.get(rec.content_id())
        if prior is not None and prior.key == info.key and prior.count >= self.reuse_cap:
            return 0  # a used-up record read again after a restart: not a rejection
        if cid in self.entries or (prior is not None and prior.key != info.key):
            return self._reject(info.key, parsed.worker_id, "duplicate", f"content {cid} already taken")
        rid, first = _replay_id(rec), self.replays.get(_replay_id(rec))
        if first is not None and first.key != info.key:
            return self._reject(info.key, parsed.worker_id, "replayed",
                                f"the samples of {first.key} (v{first.version}) relabelled to v{rec.policy_version}")
        self.replays[rid] = _Use(rec.policy_version, 0, info.key)
        if self.gate is not None:
            self.gate.observe(parsed.worker_id, accepted=True)
        claimed = np.array([s.reward for s in rec.samples], dtype=np.float32)
        if not np.allclose(rewards, claimed, atol=1e-6):
            self.stats.reward_mismatch += 1
        self.entries[cid] = Entry(info.key, rec, rewards, prior.count if prior else 0, cid, checked.replayed, signer)
        self.stats.accepted += 1
        self.stats.tokens += sum(int(s.tokens.size) for s in rec.samples)
        return 1

    def _check(self, data: bytes, version: int, current_version: int) -> _Checked:
        """Decode, validate, re-render the prompt, replay (multi-turn) and recompute rewards.

        Raises ``RecordRejected``, or ``ToolUnavailable`` when the trainer's own tools cannot replay.
        """
        rec = RolloutRecord.decode(data)
        validate_record(rec, self.contract, current_version=current_version, limits=self.limits)
        if rec.policy_version != version:
            raise RecordRejected("version", f"stored under v{version} but claims v{rec.policy_version}")
        try:
            prompt = self.task.get(rec.prompt_id)
        except (KeyError, ValueError) as e:
            raise RecordRejected("prompt", str(e)) from None
        if self.codec.encode_prompt(prompt.messages) != rec.prompt_tokens.tolist():
            raise RecordRejected("prompt", f"prompt tokens do not render {rec.prompt_id}")
        replayed = None
        if self.limits is not None and self.replay:
            replayed = self._replay(rec, prompt)
        elif self.limits is not None:
            replayed = unreplayed(rec.samples, self.codec, self.limits)
            self.stats.unreplayed += 1
        texts = ([r.text for r in replayed] if replayed is not None
                 else [self.codec.decode(s.tokens.tolist()) for s in rec.samples])
        try:
            rewards = score_group(self.task, prompt, texts)
        except RewardError as e:  # the task's reward code failed on this group: this record only
            raise RecordRejected(e.reason, str(e)) from None
        return _Checked(rec, np.array(rewards, dtype=np.float32), replayed)

    def _replay(self, rec: RolloutRecord, prompt: Prompt) -> list[Replayed]:
        """Replay a multi-turn record with the trainer's tools (one request per record), timing it.

        Args:
            rec: the validated record.
            prompt: its prompt (each sample gets ``task.make_env(prompt, rec.env_seed)``).
        """
        assert self.tools is not None and self.limits is not None and self.make_env is not None
        envs = [self.make_env(prompt, rec.env_seed) for _ in rec.samples]
        t0, calls0 = time.perf_counter(), self.tools.calls
        try:
            out = replay_group(envs, rec.samples, self.tools, self.codec, self.limits, self.codec.eos_ids)
        finally:
            self.stats.replay_s += time.perf_counter() - t0
            self.stats.tool_calls += self.tools.calls - calls0
        if self.tools_down:
            log.info("the trainer's tools answer again")
            self.tools_down = False
        return out

    def available(self) -> int:
        """Number of groups that can still be used."""
        return sum(1 for e in self.entries.values() if e.uses < self.reuse_cap)

    def take(self, count: int, keep: Callable[[np.ndarray], bool] | None = None, *,
             skip_uniform: bool = False) -> list[Entry]:
        """Take up to ``count`` groups: least used first, then freshest; charge one use each.

        Args:
            count: groups wanted.
            keep: the algorithm's group filter on a group's rewards [n]; groups it rejects are
                dropped from the pool (counted as ``filtered``) and not charged.
            skip_uniform: drop groups whose rewards all agree (counted as ``skipped_uniform``, not charged):
                they carry no advantage, so no policy gradient, and never will (rewards are fixed).
        """
        ranked = sorted((e for e in self.entries.values() if e.uses < self.reuse_cap),
                        key=lambda e: (e.uses, -e.record.policy_version, e.key))
        pool = []
        for e in ranked:
            if len(pool) == count:
                break
            if self.gate is not None and self.gate.is_quarantined(e.record.worker_id):
                del self.entries[e.content_id]  # accepted before its worker was quarantined
                self.stats.rejected["quarantined"] += 1
                continue
            if skip_uniform and np.ptp(e.rewards) == 0:
                del self.entries[e.content_id]
                self.stats.skipped_uniform += 1
                continue
            if keep is not None and not keep(e.rewards):
                del self.entries[e.content_id]
                self.stats.filtered += 1
                continue
            pool.append(e)
        for e in pool:
            e.uses += 1
            self.uses[e.content_id] = _Use(e.record.policy_version, e.uses, e.key)
            if e.uses >= self.reuse_cap:
                del self.entries[e.content_id]
        return pool

    def drain_stats(self) -> PoolStats:
        """Return and reset the counters."""
        s, self.stats = self.stats, PoolStats()
        return s


class _CountingTools:
    """The trainer's tools, counting the calls sent (``PoolStats.tool_calls``)."""

    def __init__(self, tools: Tools):
        self.inner, self.calls = tools, 0

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        results = self.inner.run(calls)
        self.calls += len(calls)
        return results


@dataclass(frozen=True)
class _Checked:
    """A record that passed every check, with its recomputed rewards (and replays, multi-turn)."""

    record: RolloutRecord
    rewards: np.ndarray
    replayed: list[Replayed] | None


def _replay_id(rec: RolloutRecord) -> str:
    """``rec``'s content id with its policy version left out: equal for the same samples under any version."""
    return dataclasses.replace(rec, policy_version=0).content_id()


@dataclass(frozen=True)
class _Use:
    version: int  # the record's policy version: the entry leaves the journal with the window
    count: int
    key: str  # the key it was taken under: the same content under another key is a duplicate
