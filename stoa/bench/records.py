"""Valid records of a run on the tiny model, as the fleet benchmarks (``stoa bench fleet``, ``flood``, ``--mix``)
upload them: the run's contract and task, records with rendered prompts and distinct content, and the simulated
clock of ``flood`` and ``--mix``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.bucket import Bucket
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import rollout_key
from stoa.models import resolve_model
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks import get_task
from stoa.tasks.multiturn import is_multiturn
from stoa.tokenize import TextCodec

if TYPE_CHECKING:
    from stoa.tasks.base import Task

EPOCH = 1.7e9
"""Wall time of the simulation's second 0 (the status stores wall times)."""


class Clock:
    """The simulation's clock: monotonic seconds; ``wall`` adds ``EPOCH``."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        """Simulated wall time."""
        return EPOCH + self.t


class RecordMaker:
    """Builds valid records of the run: prompt tokens rendered from the task, distinct content per record.

    Args:
        contract: the run contract.
        task: the run's task.
        codec: the model's codec.
    """

    TEXTS = ("aeiou", "xyz ab", "hello there", "oui", "aaa eee", "qq")

    def __init__(self, contract: RunContract, task: Task, codec: TextCodec) -> None:
        self.contract, self.task, self.codec = contract, task, codec
        self.fingerprint = contract.fingerprint()
        self.prompts: dict[str, tuple[Any, np.ndarray]] = {}
        self.tokens = [np.array(codec.tok.encode(t, add_special_tokens=False), np.int32) for t in self.TEXTS]

    def put(self, bucket: Bucket, worker: int, seq: int, version: int, uid: int, generate_s: float = 0.0) -> None:
        """Upload worker ``worker``'s record ``seq`` sampled at ``version``.

        Args:
            bucket: where it lands.
            worker: the worker's index (id ``w<5 digits>``).
            seq: its sequence number.
            version: the policy version it was sampled with.
            uid: a number no other record of the run has (below 2**24): it sets the logprobs.
            generate_s: the seconds the worker reports it spent on the group (0: none reported).
        """

        prompt_id = f"train:{(worker * 7919 + seq) % 997}"
        if prompt_id not in self.prompts:
            prompt = self.task.get(prompt_id)
            self.prompts[prompt_id] = (prompt, np.array(self.codec.encode_prompt(prompt.messages), np.int32))
        prompt, prompt_tokens = self.prompts[prompt_id]
        samples = []
        for i in range(self.contract.n_samples):
            j = (uid + i) % len(self.TEXTS)
            lp = -1.0 - ((uid >> (12 * i)) % 4096) / 4096  # a 1/4096 grid is exact in float32
            samples.append(Sample(self.tokens[j], np.full(self.tokens[j].size, lp, np.float32),
                                  float(self.task.reward(prompt, self.TEXTS[j])), "length"))
        rec = RolloutRecord(f"w{worker:05d}", seq, version, self.fingerprint, self.task.id, prompt_id,
                            prompt_tokens, samples, timings={"generate_s": generate_s} if generate_s else {})
        bucket.put_create(rollout_key(self.contract.run_id, version, rec.worker_id, seq), rec.encode())


@dataclass(frozen=True)
class Run:
    """What every scenario shares: the run contract, its task and the model's codec."""

    contract: RunContract
    task: Task
    codec: TextCodec


def make_run(task_id: str, n_samples: int = 2, max_new_tokens: int = 16) -> Run:
    """The contract of a run on the tiny model with a single-turn task.

    Args:
        task_id: the task (``toy`` or ``arithmetic``).
        n_samples: samples per group.
        max_new_tokens: the completion cap.
    """

    codec, task = TextCodec(resolve_model("tiny")), get_task(task_id)
    if is_multiturn(task):
        raise ValueError(f"--task {task_id}: pick a single-turn task (toy, arithmetic)")
    contract = RunContract(
        run_id="fleet", model=ModelSpec("llama", "c", "t", vocab_size=len(codec.tok), eos_token_ids=codec.eos_ids),
        n_samples=n_samples, plane="bf16", task_id=task.id, task_spec=task.spec(),
        reward_version=task.reward_version, sampling=SamplingSpec(1.0, 1.0, max_new_tokens))
    return Run(contract, task, codec)
