"""Attacks the trainer's intake answers, run through the real ``RecordPool`` (``stoa.trainer.pool``) on a local bucket:
prompt swaps, replayed and copied records, rewards claimed higher than the verifier gives, a lie written under an
older version, and forged multi-turn records (the real ``SearchTask`` replayed with ``SearchTools`` over a BM25
index). Each attack writes its records after an honest one, then one refresh reads them all; a real
``Quarantine`` with the trainer's defaults is the pool's gate. Imports no torch."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.envs.base import Environment, Tools, observation_tokens
from stoa.layout import rollout_key
from stoa.retrieval.base import Doc
from stoa.retrieval.bm25 import BM25Index
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks import SearchTask, get_task
from stoa.tasks.base import Task
from stoa.tokenize import TextCodec
from stoa.trainer.pool import RecordPool
from stoa.trainer.quarantine import Quarantine
from stoa.trainer.recompute_check import RecomputeCheck

RUN, VERSION = "r", 2
GOLD_DOC = "Laitouk Guild was founded in 1947 by weavers."


@dataclass(frozen=True)
class IntakeRow:
    """One intake attack.

    Args:
        attack: label.
        detector: what answered it (the rejection reason, or what neutralised it).
        written: the liar's records written.
        rejected: of them, rejected at intake.
        trained: of them, left in the pool to train.
        first: 1-based index of the first rejected liar record (0: none).
        quarantined: whether the liar's worker id ended quarantined.
        note: what the row means.
    """

    attack: str
    detector: str
    written: int
    rejected: int
    trained: int
    first: int
    quarantined: bool
    note: str


class Rig:
    """A run on a local bucket: a contract, a task, and records written as ``worker``.

    Args:
        model_dir: the model (its tokenizer renders prompts).
        task: the run's task.
        tools: the trainer's tools (multi-turn tasks).
        max_new_tokens: the contract's.
    """

    def __init__(self, model_dir: Path, task: Task, tools: Tools | None = None, max_new_tokens: int = 256):
        self.dir = tempfile.TemporaryDirectory(prefix="stoa-verify-")
        self.bucket = open_bucket(str(Path(self.dir.name) / "b"))
        self.codec, self.task, self.tools = TextCodec(model_dir), task, tools
        self.contract = RunContract(
            run_id=RUN, model=ModelSpec("llama", "c", "t", vocab_size=len(self.codec.tok),
                                        eos_token_ids=self.codec.eos_ids),
            n_samples=2, plane="bf16", task_id=task.id, task_spec=task.spec(), reward_version=task.reward_version,
            sampling=SamplingSpec(1.0, 1.0, max_new_tokens))
        d = TrainerConfig()
        self.gate = Quarantine(enabled=True, disagreement=d.quarantine_disagreement,
                               reject_rate=d.quarantine_reject_rate, min_records=d.quarantine_min_records)
        self.pool = RecordPool(self.bucket, self.contract, task, self.codec, staleness_bound=3, reuse_cap=2,
                               gate=self.gate, tools=tools)
        self.seq = 0

    def record(self, samples: list[Sample], prompt_id: str = "train:3", worker: str = "honest",
               version: int = VERSION) -> RolloutRecord:
        """A well-formed record of ``samples`` (rendered prompt, distinct logprobs per record)."""
        self.seq += 1
        prompt = self.task.get(prompt_id)
        lp = -0.5 - self.seq / 1024
        samples = [replace(s, logprobs=np.where(s.role_array() == ROLE_ACTION, lp, 0.0).astype(np.float32))
                   for s in samples]
        return RolloutRecord(worker, self.seq, version, self.contract.fingerprint(), self.task.id, prompt_id,
                             np.array(self.codec.encode_prompt(prompt.messages), np.int32), samples)

    def put(self, rec: RolloutRecord) -> str:
        """Write ``rec`` under its own key (worker, seq, version)."""
        key = rollout_key(RUN, rec.policy_version, rec.worker_id, rec.seq)
        self.bucket.put_create(key, rec.encode())
        return key

    def text_sample(self, text: str, reward: float) -> Sample:
        """A single-turn sample of ``text``."""
        toks = np.array(self.codec.tok.encode(text, add_special_tokens=False), np.int32)
        return Sample(toks, np.full(toks.size, -0.5, np.float32), reward, "stop")

    def episode(self, turns: list[str], reward: float = 0.0, env: Environment | None = None) -> Sample:
        """A multi-turn sample recorded as the engines' driver records it, with the trainer's tools."""
        assert self.tools is not None
        env = env or self.task.make_env(self.task.get("train:3"), 0)  # type: ignore[attr-defined]
        tokens: list[int] = []
        roles: list[int] = []
        sample = Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), reward, "stop", end_reason="stop")
        for k, text in enumerate(turns):
            sample.turn_starts.append(len(tokens))
            ids = self.codec.encode_text(text)
            tokens, roles = tokens + ids, roles + [ROLE_ACTION] * len(ids)
            call = env.parse(self.codec.decode(ids))
            if call is None or k == len(turns) - 1:
                break
            result = self.tools.run([call])[0]
            obs_ids, obs_roles = observation_tokens(env.observe(call, result), self.codec)
            tokens, roles = tokens + obs_ids, roles + obs_roles
            sample.calls.append(call)
            sample.digests.append(result.digest)
        return replace(sample, tokens=np.array(tokens, np.int32), roles=np.array(roles, np.uint8),
                       logprobs=np.zeros(len(tokens), np.float32))

    def run(self, attack: str, liars: list[RolloutRecord], note: str, current: int = VERSION) -> IntakeRow:
        """Write ``liars``, refresh once at version ``current`` and tell what intake did with the liars' records."""
        written = len([self.put(r) for r in liars])
        before = set(self.pool.entries)
        self.pool.refresh(current)
        stats = self.pool.drain_stats()
        liar_ids = {r.worker_id for r in liars}
        trained = sum(1 for c in set(self.pool.entries) - before if self.pool.entries[c].record.worker_id in liar_ids)
        rejected = sum(stats.rejected.values())
        reasons = ", ".join(f"{k} x{v}" for k, v in sorted(stats.rejected.items()))
        detector = reasons or ("reward re-scored (rollout/reward_mismatch)" if stats.reward_mismatch else "none")
        return IntakeRow(attack, detector, written, rejected, trained, 1 if rejected else 0,
                         any(self.gate.is_quarantined(w) for w in liar_ids), note)

    def honest_samples(self) -> list[Sample]:
        """An honest group for this rig's task."""
        if self.tools is not None:
            return [self.episode(["<search> Laitouk Guild founded </search>", "<answer> 1947 </answer>"], 1.0),
                    self.episode(["<answer> 1950 </answer>"], 0.0)]
        prompt = self.task.get("train:3")
        return [self.text_sample(prompt.answer, 1.0), self.text_sample("7", 0.0)]


def lag_dodge_dropped() -> int:
    """Groups the recompute check drops among four samples that lie by 3 nats a token, written at lag 1."""
    check = RecomputeCheck(np.arange(4), np.ones(4, np.int64))
    check.judge(np.arange(4), np.full((4, 8), -3.0), np.zeros((4, 8)), np.ones((4, 8)))
    return len(check.rejected)


def searcher() -> Tools:
    """The search task's own tools over a small BM25 index (the trainer's retriever)."""
    docs = [Doc("1", "Laitouk Guild", GOLD_DOC), Doc("2", "Weaving", "Weaving is the craft of making cloth."),
            Doc("3", "Guilds", "A guild is an association of artisans.")]
    return SearchTask().make_tools(BM25Index.build(docs))


def task_of(name: str) -> Task:
    """``arithmetic`` or ``search``."""
    return SearchTask() if name == "search" else get_task(name)

def _liar(rig: Rig, rec: RolloutRecord, **change) -> RolloutRecord:
    """A copy of ``rec`` as worker ``liar`` (fresh seq) with ``change`` applied."""
    out = RolloutRecord.decode(rec.encode())
    rig.seq += 1
    out.worker_id, out.seq = "liar", rig.seq
    for k, v in change.items():
        setattr(out, k, v)
    return out


def _honest(rig: Rig) -> RolloutRecord:
    """An honest record, written and read (so the pool holds it)."""
    rec = rig.record(rig.honest_samples())
    rig.put(rec)
    rig.pool.refresh(VERSION)
    rig.pool.drain_stats()
    return rec


def single_turn(model_dir: Path) -> list[IntakeRow]:
    """The single-turn intake attacks (arithmetic task)."""
    rows = []
    rig = Rig(model_dir, task_of("arithmetic"))
    rows.append(rig.run("control: an honest record", [rig.record(rig.honest_samples(), worker="liar")],
                        "the checks pass honest records"))
    swap = rig.record(rig.honest_samples(), worker="liar")
    swap.prompt_tokens = np.array(rig.codec.encode_prompt(rig.task.get("train:4").messages), np.int32)
    rows.append(rig.run("prompt swap (tokens of another prompt)", [swap], "the prompt is re-rendered from its id"))
    rec = _honest(rig)
    same = RolloutRecord.decode(rec.encode())
    same.seq += 500
    rows.append(rig.run("replayed record, the same worker's new key", [same], "content id, not key, is counted"))
    rows.append(rig.run("replayed record under another identity", [_liar(rig, rec)],
                        "worker id is not in the content id"))
    newer = _liar(rig, rec, policy_version=VERSION + 1)
    rows.append(rig.run("replayed record relabelled to a newer version", [newer],
                        "the same samples and logprobs, claimed at the next version", current=VERSION + 1))
    nudged = _liar(rig, rec)
    nudged.samples[0].logprobs[0] = np.nextafter(nudged.samples[0].logprobs[0], np.float32(0))
    rows.append(rig.run("copy with one logprob moved 1 ulp", [nudged], "a new content id; logprobs still honest"))
    wrong = rig.record([rig.text_sample("7", 1.0), rig.text_sample("8", 1.0)], worker="liar")
    rows.append(rig.run("rewards claimed higher than the verifier's", [wrong],
                        "trained with the trainer's rewards (0, 0); not rejected, not held against the worker"))
    dodge = rig.record(rig.honest_samples(), worker="liar", version=VERSION - 1)
    row = rig.run("a lie written under version current - 1 (lag dodge)", [dodge],
                  f"the per-sample recompute check judges lag 0 only: it drops {lag_dodge_dropped()} of 4 samples "
                  "lying by 3 nats a token at lag 1; the sequential test judges lagged records over the fleet "
                  "(the lagged rows)")
    rows.append(row)
    rig.dir.cleanup()
    return rows


def multi_turn(model_dir: Path) -> list[IntakeRow]:
    """The multi-turn forgeries (search task, replayed with the trainer's BM25 ``SearchTools``)."""
    rig = Rig(model_dir, task_of("search"), searcher())
    honest = rig.honest_samples()
    rows = [rig.run("control: an honest search episode", [rig.record(honest, worker="liar")],
                    "replayed with the trainer's tools, rewarded from the replay")]
    forged = _observe(rig, honest[0], "Laitouk Guild was founded in 1850 by weavers.")
    rows.append(rig.run("observation other than the tool's (honest digest)", [_group(rig, forged, honest)],
                    "the trainer runs the call itself"))
    appended = _append_doc(rig, honest[0], "\n<information>Doc 9(Title: Laitouk) Founded in 1850.</information>\n")
    rows.append(rig.run("a document appended after the real observation", [_group(rig, appended, honest)],
                        "the whole observation run must equal the replay"))
    digest = replace(honest[0], digests=["0" * len(honest[0].digests[0])])
    rows.append(rig.run("forged result digest", [_group(rig, digest, honest)], "digests are recomputed"))
    no_call = _uncalled(rig, honest[0])
    rows.append(rig.run("an observation after a turn that makes no call", [_group(rig, no_call, honest)],
                        "a turn an observation follows must end at a stop string and parse to the call"))
    merged = rig.episode(["<search> Laitouk Guild founded </search>\n\n<information>Doc 1(Title: Laitouk Guild) "
                          "Founded in 1947.</information>\n\n<answer> 1947 </answer>"], 1.0)
    rows.append(rig.run("a document written as the model's own turn", [_group(rig, merged, honest)],
                        "the driver would have stopped at </search>"))
    rig.dir.cleanup()
    return rows


def _group(rig: Rig, liar: Sample, honest: list[Sample]) -> RolloutRecord:
    return rig.record([liar, honest[1]], worker="liar")


def _observe(rig: Rig, s: Sample, text: str) -> Sample:
    """``s`` with its first observation's document text replaced by ``text`` (calls and digests kept)."""
    a, b = s.turn_starts[0], s.turn_starts[1]
    roles = s.role_array()
    first_echo = a + int(np.flatnonzero(roles[a:b] == ROLE_ECHO)[0])
    last_echo = a + int(np.flatnonzero(roles[a:b] == ROLE_ECHO)[-1]) + 1
    ids = rig.codec.encode_text(text)
    return _splice(s, first_echo, last_echo, ids, [ROLE_ECHO] * len(ids))


def _append_doc(rig: Rig, s: Sample, text: str) -> Sample:
    """``s`` with ``text`` (echo tokens) after its first observation."""
    ids = rig.codec.encode_text(text)
    return _splice(s, s.turn_starts[1], s.turn_starts[1], ids, [ROLE_ECHO] * len(ids))


def _uncalled(rig: Rig, s: Sample) -> Sample:
    """``s`` with its first turn's search replaced by a sentence that calls nothing (observation, call kept)."""
    a = s.turn_starts[0]
    b = a + int(np.flatnonzero(s.role_array()[a:] != ROLE_ACTION)[0])
    ids = rig.codec.encode_text("I already know this one.")
    return _splice(s, a, b, ids, [ROLE_ACTION] * len(ids))


def _splice(s: Sample, a: int, b: int, ids: list[int], roles: list[int]) -> Sample:
    """``s`` with tokens ``[a, b)`` replaced by ``ids`` (``roles``); later turn starts shifted."""
    shift = len(ids) - (b - a)
    tokens = np.concatenate([s.tokens[:a], np.array(ids, np.int32), s.tokens[b:]]).astype(np.int32)
    role_arr = np.concatenate([s.role_array()[:a], np.array(roles, np.uint8), s.role_array()[b:]]).astype(np.uint8)
    starts = [t + shift if t >= b else t for t in s.turn_starts]
    return replace(s, tokens=tokens, roles=role_arr, logprobs=np.zeros(tokens.size, np.float32), turn_starts=starts)


def intake_rows(model_dir: Path) -> list[IntakeRow]:
    """Every intake attack's row."""
    return single_turn(model_dir) + multi_turn(model_dir)


def table(rows: list[IntakeRow]) -> list[str]:
    """Markdown table of the rows."""
    lines = ["| attack | detector | liar records rejected | trained | worker quarantined | note |",
             "| --- | --- | ---: | ---: | --- | --- |"]
    lines += [f"| {r.attack} | {r.detector} | {r.rejected}/{r.written} | {r.trained} | "
              f"{'yes' if r.quarantined else 'no'} | {r.note} |" for r in rows]
    return lines
