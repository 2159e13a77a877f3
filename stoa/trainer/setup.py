"""Trainer start-up: the run contract, the model files workers need, and evaluation."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from stoa.bucket import Bucket, ObjectExists
from stoa.config import TrainerConfig
from stoa.contract import ContractMismatch, ModelSpec, RunContract, SamplingSpec, upload_model_files
from stoa.engines import Engine
from stoa.layout import contract_key
from stoa.tasks.base import Task
from stoa.tokenize import TextCodec


def build_contract(cfg: TrainerConfig, model_dir: Path, task: Task, codec: TextCodec, vocab_size: int) -> RunContract:
    """Assemble the run contract from the resolved config, model and task.

    Args:
        cfg: resolved trainer config.
        model_dir: the base model directory.
        task: the task.
        codec: the model's tokenizer.
        vocab_size: embedding rows of the model.
    """
    from stoa.models import model_fingerprint

    fp = model_fingerprint(model_dir)
    algo = cfg.algo_config()
    return RunContract(
        run_id=cfg.run,
        model=ModelSpec(
            architecture=fp.architecture,
            config_hash=fp.config_hash,
            tokenizer_hash=fp.tokenizer_hash,
            vocab_size=vocab_size,
            eos_token_ids=codec.eos_ids,
        ),
        n_samples=cfg.n_samples,
        plane=cfg.plane,
        task_id=task.id,
        task_spec=dict(task.spec()),
        reward_version=task.reward_version,
        sampling=SamplingSpec(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens),
        staleness_bound=cfg.staleness_bound,
        reuse_cap=cfg.reuse_cap,
        algorithm=algo.to_dict(),
        created_at=time.time(),
    )


def ensure_contract(bucket: Bucket, contract: RunContract, model_dir: Path | None = None) -> RunContract:
    """Write the contract create-only, or verify the existing one matches (restart).

    A new run gets its model files first and the contract last, so a worker that sees the contract
    finds the files; a restart checks the contract before touching the model files.

    Args:
        bucket: the run's bucket.
        contract: the contract this trainer would write.
        model_dir: the base model directory whose config and tokenizer files workers download.

    Raises:
        ContractMismatch: the run exists with different settings (or model files); names the fields.
    """
    key = contract_key(contract.run_id)
    if not bucket.exists(key) and model_dir is not None:
        upload_model_files(bucket, contract.run_id, model_dir)
    try:
        bucket.put_create(key, contract.to_json())
        return contract
    except ObjectExists:
        existing = RunContract.from_json(bucket.get(key))
        diff = existing.mismatches(contract)
        if diff:
            raise ContractMismatch(diff, f"run {contract.run_id!r} already exists with other settings; "
                                         "use a new --run or the original settings") from None
        if model_dir is not None:
            upload_model_files(bucket, contract.run_id, model_dir)
        return existing


def evaluate(model, codec: TextCodec, task: Task, n: int, max_new_tokens: int,
             batch: int = 32) -> dict[str, float]:
    """Greedy held-out accuracy of the trainer's torch HF model (:func:`greedy_accuracy` on its engine).

    Args:
        model: an HF causal LM (left in train mode afterwards if it was).
        codec: tokenizer.
        task: the task.
        n: number of held-out prompts.
        max_new_tokens: length cap.
        batch: prompts decoded together.
    """
    from stoa.engines import engine_from_model

    was_training = model.training
    try:
        return greedy_accuracy(engine_from_model(model), codec, task, n, max_new_tokens, batch)
    finally:
        model.train(was_training)


def greedy_accuracy(engine: Engine, codec: TextCodec, task: Task, n: int, max_new_tokens: int,
                    batch: int = 32) -> dict[str, float]:
    """Greedy held-out accuracy of any engine on the task's first ``n`` held-out prompts.

    Args:
        engine: the engine to decode with (one completion per prompt, argmax, the task's EOS).
        codec: tokenizer.
        task: the task.
        n: number of held-out prompts.
        max_new_tokens: length cap.
        batch: prompts decoded together.

    Returns:
        ``accuracy``, ``n`` (prompts), ``seconds`` and ``tokens_per_s``.
    """
    prompts = task.heldout(n)
    correct, t0, new_tokens = 0, time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        groups, st = engine.generate([codec.encode_prompt(p.messages) for p in chunk], 1,
                                     max_new_tokens=max_new_tokens, eos_ids=codec.eos_ids, greedy=True)
        new_tokens += st.new_tokens
        correct += sum(task.is_correct(p, codec.decode(g[0].tokens))
                       for p, g in zip(chunk, groups, strict=True))
    dt = time.perf_counter() - t0
    return {"accuracy": correct / max(len(prompts), 1), "n": float(len(prompts)), "seconds": dt,
            "tokens_per_s": new_tokens / dt if dt > 0 else 0.0}


def reward_stats(rewards: np.ndarray) -> dict[str, float]:
    """Mean, std and the fraction of groups whose rewards all agree (no learning signal).

    Args:
        rewards: [G, n] rewards.
    """
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "zero_variance_groups": float((rewards.std(axis=1) == 0).mean()),
    }
