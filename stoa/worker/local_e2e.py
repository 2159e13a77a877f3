"""`stoa local-e2e`: sample, score, upload, read back and validate records on this machine, then clean up."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from stoa.bucket import BucketError, open_bucket
from stoa.config import WorkerConfig
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import contract_key, rollout_key, rollouts_prefix
from stoa.models import model_fingerprint, resolve_model
from stoa.rollouts.records import RecordRejected, RolloutRecord, Sample, validate_record
from stoa.tasks import get_task, parse_task_spec
from stoa.tasks.scoring import score_group
from stoa.tokenize import TextCodec
from stoa.worker import loop
from stoa.worker.loop import default_engine

if TYPE_CHECKING:
    from stoa.engines import Completion, GenStats
    from stoa.tasks import Task

PREFIX_ROOT = "local-e2e"
"""Records go under ``local-e2e/<random>/`` of the bucket and are deleted at the end."""


def _probe(bucket: Any, prefix: str, url: str) -> None:
    """Fail early, before any generation, when the bucket cannot be listed."""

    try:
        next(iter(bucket.list(prefix)), None)
    except (BucketError, OSError) as e:
        raise RuntimeError(f"bucket {url!r} is unreachable or refused access ({type(e).__name__}: {e}); "
                           "nothing was written") from e


def run_local_e2e(
    groups: int = 3,
    samples: int = 4,
    tokens: int = 256,
    *,
    engine: str = "auto",
    model: str | None = None,
    bucket_url: str | None = None,
    task: str = "arithmetic",
    seed: int = 0,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Generate ``groups`` x ``samples`` completions here, score them, and round-trip them through a bucket.

    Builds an in-memory run contract for the model and task, writes one ``RolloutRecord`` per group
    (plus the contract) under a fresh ``local-e2e/<random>/`` prefix, lists and reads them back,
    validates each with the trainer's ``validate_record``, prints a summary and deletes the prefix (also
    when anything fails). Weights come from the model directory, not from a run.

    Args:
        groups: prompt groups.
        samples: completions per group (n).
        tokens: max new tokens per completion.
        engine: ``auto`` (mlx on Apple silicon, else torch), ``torch`` or ``mlx``.
        model: model name or directory (default: env ``MODEL``, else ``tiny``).
        bucket_url: bucket URL (directory, ``file://``, ``s3://``, ``r2://``); default: a temporary
            directory removed afterwards.
        task: task spec, e.g. ``arithmetic`` or ``gsm8k:path=FILE``.
        seed: prompt sampling seed (and MLX sampling seed).
        echo: where the summary lines go.

    Returns:
        the summary: counts, tokens/s, reward mean, record bytes, validation result, prefix and cleanup.

    Raises:
        ValueError: on non-positive sizes or an unknown engine/task.
        RuntimeError: when the bucket is unreachable (nothing is written then) or a record fails
            validation (the prefix is still deleted).
    """
    engine_name, the_task = _check(groups, samples, tokens, engine, task)
    tag = secrets.token_hex(4)
    prefix = f"{PREFIX_ROOT}/{tag}/"
    bucket, url, tmp_root = _open(bucket_url, prefix)
    summary: dict[str, Any] = {"bucket": url, "prefix": prefix, "engine": engine_name}
    try:
        trial = _Trial(bucket, prefix, f"local-e2e-{tag}", the_task, seed)
        model_dir, eng, codec, contract = _set_up(trial, engine_name, model, samples, tokens)
        gen = _generate(trial, eng, codec, engine_name, groups, samples, tokens)
        sent, rewards = _upload(trial, contract, codec, gen)
        back = _read_back(trial, contract, sent, groups)
        summary.update(model=str(model_dir), groups=groups, samples=samples, max_new_tokens=tokens,
                       **_figures(gen, rewards, back))
        _report(summary, the_task.id, back, echo)
        if back.problems:
            raise RuntimeError(f"local-e2e: records failed the round trip: {'; '.join(back.problems)}")
        return summary
    finally:
        _cleanup(bucket, prefix, summary, echo)
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)


@dataclass(frozen=True)
class _Trial:
    """One check's place and inputs: the bucket, its fresh prefix, the run (and worker) id, task and seed."""

    bucket: Any
    prefix: str
    run_id: str
    task: Task
    seed: int


class _Generated(NamedTuple):
    """The sampled groups: prompts, their token ids, completions per group, engine figures and seconds."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    completions: list[list[Completion]]
    stats: GenStats
    seconds: float


class _RoundTrip(NamedTuple):
    """What reading the records back found: records listed, bytes read, records valid, and the problems."""

    listed: int
    record_bytes: int
    valid: int
    problems: list[str]


def _check(groups: int, samples: int, tokens: int, engine: str, task: str) -> tuple[str, Task]:
    """Refuse sizes below 1 and unknown engines; return the engine name and the task.

    Args:
        groups: prompt groups.
        samples: completions per group.
        tokens: max new tokens.
        engine: ``auto``, ``torch`` or ``mlx``.
        task: task spec.
    """

    for name, value in (("groups", groups), ("samples", samples), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    engine_name = default_engine() if engine == "auto" else engine
    if engine_name not in ("torch", "mlx"):
        raise ValueError(f"engine {engine!r}: use auto, torch or mlx")
    task_name, task_opts = parse_task_spec(task)
    return engine_name, get_task(task_name, **task_opts)


def _open(bucket_url: str | None, prefix: str) -> tuple[Any, str, str | None]:
    """Open the given bucket (probing it first) or a temporary directory; return it, its URL and the temp dir.

    Args:
        bucket_url: the bucket URL, or None for a temporary local directory.
        prefix: the check's prefix (the probe lists it).
    """

    if bucket_url:
        bucket = open_bucket(bucket_url)
        _probe(bucket, prefix, bucket_url)
        return bucket, bucket_url, None
    tmp_root = tempfile.mkdtemp(prefix="stoa-local-e2e-")
    return open_bucket(tmp_root), tmp_root, tmp_root


def _set_up(trial: _Trial, engine_name: str, model: str | None, samples: int,
            tokens: int) -> tuple[Path, Any, Any, RunContract]:
    """Build the engine and the run contract a trainer would write, and write the contract under the prefix.

    Returns the model directory, the engine, the text codec and the contract.

    Args:
        trial: the check's place and inputs.
        engine_name: ``torch`` or ``mlx``.
        model: model name or directory (default: env ``MODEL``, else ``tiny``).
        samples: completions per group.
        tokens: max new tokens.
    """

    model_dir = resolve_model(model or os.environ.get("MODEL") or "tiny")
    eng: Any = loop.make_engine(engine_name, model_dir, WorkerConfig())
    codec = TextCodec(model_dir)
    fp = model_fingerprint(model_dir)
    task = trial.task
    contract = RunContract(
        run_id=trial.run_id,
        model=ModelSpec(architecture=fp.architecture, config_hash=fp.config_hash,
                        tokenizer_hash=fp.tokenizer_hash, vocab_size=eng.vocab_size,
                        eos_token_ids=codec.eos_ids),
        n_samples=samples, plane="bf16", task_id=task.id, task_spec=dict(task.spec()),
        reward_version=task.reward_version,
        sampling=SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=tokens),
        created_at=time.time(),
    )
    trial.bucket.put_create(trial.prefix + contract_key(trial.run_id), contract.to_json())
    return model_dir, eng, codec, contract


def _generate(trial: _Trial, eng: Any, codec: Any, engine_name: str, groups: int, samples: int,
              tokens: int) -> _Generated:
    """Sample ``groups`` training prompts (seeded) and ``samples`` completions of each; time the generate.

    Args:
        trial: the check's place and inputs.
        eng: the engine.
        codec: the text codec (prompt rendering, EOS ids).
        engine_name: ``torch`` or ``mlx`` (MLX samples with the seed, torch with its default generator).
        groups: prompt groups.
        samples: completions per group.
        tokens: max new tokens.
    """
    rng = np.random.default_rng(trial.seed)
    prompts = [trial.task.sample_train(rng) for _ in range(groups)]
    prompt_ids = [codec.encode_prompt(p.messages) for p in prompts]
    gen = trial.seed if engine_name == "mlx" else None
    t0 = time.perf_counter()
    comps, st = eng.generate(prompt_ids, samples, max_new_tokens=tokens, temperature=1.0, top_p=1.0,
                             eos_ids=codec.eos_ids, generator=gen)
    return _Generated(prompts, prompt_ids, comps, st, time.perf_counter() - t0)


def _upload(trial: _Trial, contract: RunContract, codec: Any,
            gen: _Generated) -> tuple[dict[str, RolloutRecord], list[float]]:
    """Score each completion, write one record per group as a worker would; return them by key, and rewards.

    Args:
        trial: the check's place and inputs.
        contract: the run contract (its fingerprint goes into every record).
        codec: the text codec (decodes completions for the reward).
        gen: the sampled groups.
    """
    task, worker = trial.task, trial.run_id
    sent: dict[str, RolloutRecord] = {}
    rewards: list[float] = []
    groups = zip(gen.prompts, gen.prompt_ids, gen.completions, strict=True)
    for seq, (prompt, ids, group) in enumerate(groups):
        scores = score_group(task, prompt, [codec.decode(c.tokens) for c in group])
        recs = [Sample(np.array(c.tokens, np.int32), np.array(c.logprobs, np.float32), r, c.finish_reason)
                for c, r in zip(group, scores, strict=True)]
        rewards += [s.reward for s in recs]
        rec = RolloutRecord(worker_id=worker, seq=seq, policy_version=1,
                            contract_fingerprint=contract.fingerprint(), task_id=task.id,
                            prompt_id=prompt.id, prompt_tokens=np.array(ids, np.int32), samples=recs,
                            sampling={"temperature": 1.0, "top_p": 1.0},
                            timings={"generate_s": gen.seconds / len(gen.prompts)}, created_at=time.time())
        key = trial.prefix + rollout_key(trial.run_id, 1, worker, seq)
        trial.bucket.put_create(key, rec.encode())
        sent[key] = rec
    return sent, rewards


def _read_back(trial: _Trial, contract: RunContract, sent: dict[str, RolloutRecord],
               groups: int) -> _RoundTrip:
    """List the records under the prefix, read each back, validate it as the trainer would and compare it.

    Args:
        trial: the check's place and inputs.
        contract: the run contract.
        sent: the records written, by key.
        groups: how many were written.
    """
    listed = list(trial.bucket.list(trial.prefix + rollouts_prefix(trial.run_id)))
    record_bytes, valid, problems = 0, 0, []
    for info in listed:
        data = trial.bucket.get(info.key)
        record_bytes += len(data)
        try:
            back = RolloutRecord.decode(data)
            validate_record(back, contract, current_version=1)
            _same(back, sent[info.key])
            valid += 1
        except (RecordRejected, KeyError, ValueError) as e:
            problems.append(f"{info.key}: {e}")
    if len(listed) != groups:
        problems.append(f"listed {len(listed)} records under {trial.prefix}, wrote {groups}")
    return _RoundTrip(len(listed), record_bytes, valid, problems)


def _figures(gen: _Generated, rewards: list[float], back: _RoundTrip) -> dict[str, Any]:
    """The summary's figures: tokens and seconds, tokens/s, mean reward, record bytes and the validation.

    Args:
        gen: the sampled groups.
        rewards: every completion's reward.
        back: what reading the records back found.
    """
    st = gen.stats
    return dict(
        new_tokens=st.new_tokens, generate_s=gen.seconds, prefill_s=st.prefill_s, decode_s=st.decode_s,
        tokens_per_s=st.new_tokens / gen.seconds if gen.seconds else 0.0,
        reward_mean=float(np.mean(rewards)), record_bytes=back.record_bytes, records_valid=back.valid,
        validation="ok" if not back.problems else "; ".join(back.problems),
    )


def _report(summary: dict[str, Any], task_id: str, back: _RoundTrip, echo: Callable[[str], Any]) -> None:
    """Print the four summary lines.

    Args:
        summary: the filled-in summary.
        task_id: the task's id.
        back: what reading the records back found.
        echo: where the lines go.
    """
    s = summary
    echo(f"[local-e2e] {s['engine']} engine, model {s['model']}, task {task_id}")
    echo(f"[local-e2e] {s['groups']} groups x {s['samples']} samples, {s['new_tokens']} new tokens in "
         f"{s['generate_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s; prefill {s['prefill_s']:.2f}s, "
         f"decode {s['decode_s']:.2f}s)")
    echo(f"[local-e2e] reward mean {s['reward_mean']:.3f}; {back.listed} records, {back.record_bytes} bytes "
         f"under {s['bucket'].rstrip('/')}/{s['prefix']}")
    echo(f"[local-e2e] validation: {back.valid}/{s['groups']} records valid"
         + ("" if not back.problems else f" - {back.problems}"))


def _same(back: RolloutRecord, sent: RolloutRecord) -> None:
    """Raise ValueError when a read-back record differs from what was written."""
    if back.prompt_id != sent.prompt_id or not np.array_equal(back.prompt_tokens, sent.prompt_tokens):
        raise ValueError("prompt differs after the round trip")
    for a, b in zip(back.samples, sent.samples, strict=True):
        if not (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)):
            raise ValueError("sample tokens or logprobs differ after the round trip")


def _cleanup(bucket: Any, prefix: str, summary: dict[str, Any], echo: Callable[[str], Any]) -> None:
    """Delete the run's prefix; record (and say) whether anything is left."""

    try:
        bucket.delete_prefix(prefix)
        left = sum(1 for _ in bucket.list(prefix))
        summary["cleaned"] = left == 0
        if left:
            echo(f"[local-e2e] warning: {left} objects left under {prefix}")
    except (BucketError, OSError) as e:
        summary["cleaned"] = False
        echo(f"[local-e2e] warning: could not delete {prefix}: {e}")
