"""Rollout intake: list new records inside the staleness window, validate, score, filter, count reuse."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.bucket import Bucket, BucketError
from stoa.records import RecordRejected, RolloutRecord, RunContract, rollout_version_prefix, validate_record
from stoa.tasks.base import Task
from stoa.tokenize import TextCodec

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """A validated group waiting to be trained on."""

    key: str
    record: RolloutRecord
    rewards: np.ndarray  # [n] float32, recomputed by the trainer
    uses: int = 0


@dataclass
class PoolStats:
    """Counters since the last ``drain_stats`` call."""

    accepted: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    dropped_stale: int = 0
    reward_mismatch: int = 0
    filtered: int = 0
    tokens: int = 0


class RecordPool:
    """Holds usable groups; everything read from the bucket is untrusted.

    Args:
        bucket: the run's bucket.
        contract: the run contract records must match.
        task: the task, to regenerate prompts and recompute rewards.
        codec: tokenizer, to check prompt tokens and decode completions.
        staleness_bound: max ``current - policy_version`` of a usable record.
        reuse_cap: max optimizer steps a record may feed.
    """

    def __init__(self, bucket: Bucket, contract: RunContract, task: Task, codec: TextCodec, *,
                 staleness_bound: int, reuse_cap: int):
        self.bucket, self.contract, self.task, self.codec = bucket, contract, task, codec
        self.staleness_bound, self.reuse_cap = staleness_bound, reuse_cap
        self.entries: dict[str, Entry] = {}
        self.uses: dict[str, int] = {}  # every key ever taken (pruned to the window), persisted
        self.seen: set[str] = set()  # keys already read (accepted or rejected), pruned to the window
        self.stats = PoolStats()

    def state(self) -> dict[str, Any]:
        """JSON-able state for the trainer journal (reuse counts of keys inside the window)."""
        return {"uses": dict(self.uses)}

    def restore(self, state: dict[str, Any]) -> None:
        """Restore reuse counts from a journal.

        Args:
            state: what ``state()`` returned.
        """
        self.uses = {str(k): int(v) for k, v in state.get("uses", {}).items()}

    def refresh(self, current_version: int) -> int:
        """List and ingest records of the versions inside the window; return how many were accepted.

        Args:
            current_version: the trainer's current policy version.
        """
        low = max(1, current_version - self.staleness_bound)
        for key in [k for k, e in self.entries.items() if e.record.policy_version < low]:
            del self.entries[key]
            self.stats.dropped_stale += 1
        self.uses = {k: v for k, v in self.uses.items() if _version_of(k) >= low}
        self.seen = {k for k in self.seen if _version_of(k) >= low}
        accepted = 0
        # Keys sort by worker, not arrival, so a start-after cursor would skip late records of
        # early-sorting workers; each version inside the window is listed whole instead (cost grows
        # with the window, never with history).
        for v in range(low, current_version + 1):
            prefix = rollout_version_prefix(self.contract.run_id, v)
            for info in self.bucket.list(prefix):
                if info.key in self.seen or self.uses.get(info.key, 0) >= self.reuse_cap:
                    continue
                self.seen.add(info.key)
                accepted += self._ingest(info.key, v, current_version)
        return accepted

    def _ingest(self, key: str, version: int, current_version: int) -> int:
        try:
            data = self.bucket.get(key)
        except BucketError as e:
            log.warning("could not read %s: %s", key, e)
            self.seen.discard(key)  # retry on the next refresh
            return 0
        try:
            rec = RolloutRecord.decode(data)
            validate_record(rec, self.contract, current_version=current_version)
            if rec.policy_version != version:
                raise RecordRejected("version", f"stored under v{version} but claims v{rec.policy_version}")
            prompt = self.task.get(rec.prompt_id)
            if self.codec.encode_prompt(prompt.messages) != rec.prompt_tokens.tolist():
                raise RecordRejected("prompt", f"prompt tokens do not render {rec.prompt_id}")
        except (RecordRejected, KeyError, ValueError) as e:
            reason = e.reason if isinstance(e, RecordRejected) else "prompt"
            self.stats.rejected[reason] += 1
            log.warning("rejected %s: %s", key, e)
            return 0
        rewards = np.array([self.task.reward(prompt, self.codec.decode(s.tokens.tolist())) for s in rec.samples],
                           dtype=np.float32)
        claimed = np.array([s.reward for s in rec.samples], dtype=np.float32)
        if not np.allclose(rewards, claimed, atol=1e-6):
            self.stats.reward_mismatch += 1
        self.entries[key] = Entry(key, rec, rewards, self.uses.get(key, 0))
        self.stats.accepted += 1
        self.stats.tokens += sum(int(s.tokens.size) for s in rec.samples)
        return 1

    def available(self) -> int:
        """Number of groups that can still be used."""
        return sum(1 for e in self.entries.values() if e.uses < self.reuse_cap)

    def take(self, count: int, keep: Callable[[np.ndarray], bool] | None = None) -> list[Entry]:
        """Take up to ``count`` groups: least used first, then freshest; charge one use each.

        Args:
            count: groups wanted.
            keep: the algorithm's group filter on a group's rewards [n]; groups it rejects are
                dropped from the pool (counted as ``filtered``) and not charged.
        """
        ranked = sorted((e for e in self.entries.values() if e.uses < self.reuse_cap),
                        key=lambda e: (e.uses, -e.record.policy_version, e.key))
        pool = []
        for e in ranked:
            if len(pool) == count:
                break
            if keep is not None and not keep(e.rewards):
                del self.entries[e.key]
                self.stats.filtered += 1
                continue
            pool.append(e)
        for e in pool:
            e.uses += 1
            self.uses[e.key] = e.uses
            if e.uses >= self.reuse_cap:
                del self.entries[e.key]
        return pool

    def drain_stats(self) -> PoolStats:
        """Return and reset the counters."""
        s, self.stats = self.stats, PoolStats()
        return s


def _version_of(key: str) -> int:
    part = key.rsplit("/", 2)[-2]
    return int(part[1:]) if part.startswith("v") and part[1:].isdigit() else 0
