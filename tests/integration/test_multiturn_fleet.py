"""The real trainer (in this process) and a worker process on multi-turn tasks over a local bucket, tiny model.

Workers upload schema-2 records; the trainer replays them with its own tools, trains on them and logs the
episode figures; a record whose observation was tampered with is rejected as ``observation`` and counted. On
the built-in ``search`` task the trainer builds the index and uploads it; the worker downloads it by fingerprint.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.contract import RunContract
from stoa.layout import contract_key, rollout_key
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks import get_task, parse_task_spec
from stoa.tokenize import TextCodec
from stoa.trainer.loop import run_trainer
from tests.envs.fakes import honest_sample
from tests.integration.conftest import train_rows, wait_for

WALK = "walk:size=3,max_turns=3,max_total_tokens=128"
SEARCH = "search:entities=40,max_turns=2,max_total_tokens=192,topk=1,max_doc_chars=80"


def trainer_cfg(bucket: str, run: str, task: str, steps: int, **kw) -> TrainerConfig:
    base = dict(bucket=bucket, run=run, model="tiny", task=task, n_samples=2, groups_per_step=2, max_new_tokens=20,
                lr=1e-2, eval_n=0, kl_beta=0.0, max_wait_seconds=120, poll_seconds=0.2, anchor_every=100,
                steps=steps, status_seconds=1.0)
    return TrainerConfig(**{**base, **kw}).validate()


def start_worker(procs, bucket: str, run: str):
    return procs.start("w0", "worker", "--bucket", bucket, "--run", run, "--name", "w0", "--engine", "torch",
                       "--threads", "1", "--groups-in-flight", "2", "--poll-seconds", "0.2", "--wait-seconds", "120")


def episode(env, tools, codec, turns: Sequence[str], lp: float = -0.7) -> Sample:
    """A sample recorded the way the engines' driver records it: each turn, then its observation."""
    return honest_sample(turns, codec, tools, env=env, lp=lp)


def tampered(s: Sample, codec) -> Sample:
    """The sample with one echo token of its first observation replaced (roles and digests kept)."""
    at = int(np.flatnonzero(s.role_array() == ROLE_ECHO)[0])
    other = codec.encode_text("9")[0]
    tokens = s.tokens.copy()
    tokens[at] = other if tokens[at] != other else codec.encode_text("8")[0]
    return Sample(tokens, s.logprobs, s.reward, s.finish_reason, roles=s.roles, turn_starts=s.turn_starts,
                  calls=s.calls, digests=s.digests, end_reason=s.end_reason)


def with_policy_logprobs(samples: list[Sample], prompt: np.ndarray, model_dir: Path) -> list[Sample]:
    """The samples with the v1 policy's own logprobs on their action tokens (what an honest engine records, so
    the step's recompute check passes them at lag 0)."""
    import torch

    from stoa.trainer.policy import Policy

    pol = Policy(model_dir, torch.device("cpu"), trainable=False)
    with torch.no_grad():
        lp = pol.group_logprobs(prompt, [s.tokens for s in samples], max(s.tokens.size for s in samples)).numpy()
    for i, s in enumerate(samples):
        act = s.role_array() == ROLE_ACTION
        s.logprobs = np.where(act, lp[i, : s.tokens.size], 0.0).astype(np.float32)
    return samples


def inject(bucket_url: str, run: str, codec, model_dir: Path, prompt_id: str, turns: Sequence[str],
           make_tools: Callable, errors: list[BaseException]) -> None:
    """Once the contract exists: write an honest hand-made record (worker ``scripted``) and the same record
    with a tampered observation (worker ``forger``), both at v1."""
    try:
        bucket = open_bucket(bucket_url)
        wait_for(lambda: bucket.exists(contract_key(run)), 120, "the contract")
        contract = RunContract.from_json(bucket.get(contract_key(run)))
        task: Any = get_task(contract.task_id, **contract.task_spec)
        tools = make_tools(task, bucket, contract)
        prompt = task.get(prompt_id)
        ptoks = np.array(codec.encode_prompt(prompt.messages), np.int32)
        honest = with_policy_logprobs([episode(task.make_env(prompt, 0), tools, codec, turns)
                                       for _ in range(contract.n_samples)], ptoks, model_dir)
        for worker, samples in (("scripted", honest), ("forger", [tampered(honest[0], codec), *honest[1:]])):
            rec = RolloutRecord(worker, 0, 1, contract.fingerprint(), contract.task_id, prompt_id, ptoks, samples)
            bucket.put_create(rollout_key(run, 1, worker, 0), rec.encode())
    except BaseException as e:  # noqa: BLE001 - re-raised by the test
        errors.append(e)


def walk_turns(task, prompt_id: str) -> list[str]:
    """The moves from the prompt's start to its goal, then the answer."""
    start, goal = task.problem(prompt_id)
    move = "<move>right</move>" if goal > start else "<move>left</move>"
    return [move] * abs(goal - start) + ["<answer>done</answer>"]


def run_fleet(procs, tmp_path: Path, tiny_dir, run: str, task: str, steps: int, prompt_id: str,
              turns: Sequence[str], make_tools: Callable, **kw) -> tuple[list[dict], dict]:
    """Trainer here, one worker process, the two hand-made records injected once the contract is written."""
    bucket = str(tmp_path / "bucket")
    errors: list[BaseException] = []
    t = threading.Thread(target=inject, args=(bucket, run, TextCodec(tiny_dir), tiny_dir, prompt_id, turns,
                                              make_tools, errors), daemon=True)
    t.start()
    worker = start_worker(procs, bucket, run)
    lines: list[str] = []
    summary = run_trainer(trainer_cfg(bucket, run, task, steps, **kw), echo=lines.append)
    t.join(timeout=30)
    assert not errors, errors
    assert summary["step"] == steps, lines
    worker.wait(timeout=60)  # the run is finished: the worker exits on its own
    return train_rows(tmp_path / "bucket" / "runs" / run / "metrics" / "trainer.jsonl"), summary


def records_of(tmp_path: Path, run: str, worker: str) -> list[RolloutRecord]:
    return [RolloutRecord.decode(p.read_bytes())
            for p in (tmp_path / "bucket" / "runs" / run / "rollouts").glob(f"v*/{worker}-*.rec")]


def assert_replayed_fleet(rows: list[dict], tmp_path: Path, run: str) -> None:
    """Schema-2 worker records accepted and replayed; the tampered record rejected as ``observation``."""
    worker = records_of(tmp_path, run, "w0")
    assert worker and all(r.schema_version == 2 for r in worker)
    assert all(s.roles is not None and s.end_reason and s.turn_starts for r in worker for s in r.samples)
    rejected = {k: v for r in rows for k, v in r.items() if k.startswith("rollout/rejected/") and v}
    assert rejected == {"rollout/rejected/observation": 1}, rejected
    assert sum(r["rollout/accepted"] for r in rows) >= 2
    assert all(r["rollout/turns_mean"] >= 1 and 0 <= r["rollout/search_rate"] <= 1 for r in rows)
    assert all(0 <= r["train/replay_share"] < 1 for r in rows)
    used = [k for r in rows for k in r["rollout/keys"]]
    assert any("/w0-" in k for k in used) and not any("forger" in k for k in used)


@pytest.mark.slow
def test_walk_fleet_trains_on_replayed_schema2_records_and_rejects_a_tampered_observation(procs, tmp_path,
                                                                                          tiny_dir):
    name, opts = parse_task_spec(WALK)
    task = get_task(name, **opts)
    rows, summary = run_fleet(procs, tmp_path, tiny_dir, "walk", WALK, 3, "train:5", walk_turns(task, "train:5"),
                              lambda t, b, c: t.make_tools(None), algorithm="gigpo",
                              algo={"echo_alpha": 0.1})
    assert_replayed_fleet(rows, tmp_path, "walk")
    assert [r["version"] for r in rows] == [2, 3, 4]
    echo = [r for r in rows if "train/echo_alpha" in r]  # steps that trained on echo tokens (the scripted record)
    assert echo and all(r["train/echo_alpha"] == 0.1 and r["train/loss_echo"] > 0 and 0 <= r["train/echo_acc"] <= 1
                        for r in echo)
    # The scripted record's moves were replayed with the trainer's local tools (one request, both samples).
    assert sum(r["rollout/tool_calls"] for r in rows) >= 2 * len(walk_turns(task, "train:5")) - 2
    print(f"\nwalk: replay share {[round(r['train/replay_share'], 4) for r in rows]}, "
          f"replay_s {[round(r['train/replay_s'], 4) for r in rows]}, step_s {summary['step_times']}")


def _searcher_tools(cache: Path) -> Callable:
    """Tools over the run's index downloaded from the bucket by the contract's fingerprint (as a worker does)."""
    def make(task, bucket, contract):
        from stoa.retrieval.travel import open_searcher

        searcher = open_searcher(bucket=bucket, run_id=contract.run_id, fingerprint=contract.retriever["fingerprint"],
                                 cache_dir=cache, note=lambda *_: None)
        return task.make_tools(searcher)
    return make


@pytest.mark.slow
def test_search_fleet_index_travels_by_fingerprint_and_records_replay(procs, tmp_path, tiny_dir, stoa_cache):
    name, opts = parse_task_spec(SEARCH)
    task: Any = get_task(name, **opts)
    question = task.world.train[0]
    turns = [f"<search>{question.text}</search>", f"<answer>{question.golds[0]}</answer>"]
    t0 = time.time()
    # The tiny random model never answers: its groups all score 0, so they are trained on, not skipped.
    rows, summary = run_fleet(procs, tmp_path, tiny_dir, "search", SEARCH, 2, "train:0", turns,
                              _searcher_tools(tmp_path / "mine"), max_new_tokens=48, skip_uniform_groups=False)
    assert_replayed_fleet(rows, tmp_path, "search")
    contract = RunContract.from_json(open_bucket(str(tmp_path / "bucket")).get(contract_key("search")))
    fp = contract.retriever["fingerprint"]
    assert (tmp_path / "mine" / fp).is_dir()  # the injected record searched the index the trainer uploaded
    assert (stoa_cache / "retriever" / fp).stat().st_mtime >= t0  # the worker downloaded it by fingerprint
    assert sum(r["rollout/tool_calls"] for r in rows) >= 2
    print(f"\nsearch: replay share {[round(r['train/replay_share'], 4) for r in rows]}, "
          f"replay_s {[round(r['train/replay_s'], 4) for r in rows]}, step_s {summary['step_times']}")
    shutil.rmtree(stoa_cache / "retriever" / fp)  # a later run in this session downloads it again
