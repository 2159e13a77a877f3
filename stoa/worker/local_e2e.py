"""`stoa local-e2e`: sample, score, upload, read back and validate records on this machine, then clean up."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import contract_key, rollout_key, rollouts_prefix
from stoa.records import RecordRejected, RolloutRecord, Sample, validate_record

PREFIX_ROOT = "local-e2e"
"""Records go under ``local-e2e/<random>/`` of the bucket and are deleted at the end."""


def _probe(bucket: Any, prefix: str, url: str) -> None:
    """Fail early, before any generation, when the bucket cannot be listed."""
    from stoa.bucket import BucketError

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
    from stoa.bucket import open_bucket
    from stoa.config import WorkerConfig
    from stoa.models import model_fingerprint, resolve_model
    from stoa.tasks import get_task, parse_task_spec
    from stoa.tokenize import TextCodec
    from stoa.worker.loop import default_engine, make_engine

    for name, value in (("groups", groups), ("samples", samples), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    engine_name = default_engine() if engine == "auto" else engine
    if engine_name not in ("torch", "mlx"):
        raise ValueError(f"engine {engine!r}: use auto, torch or mlx")
    task_name, task_opts = parse_task_spec(task)
    the_task = get_task(task_name, **task_opts)

    tag = secrets.token_hex(4)
    prefix = f"{PREFIX_ROOT}/{tag}/"
    if bucket_url:
        url, tmp_root = bucket_url, None
        bucket = open_bucket(url)
        _probe(bucket, prefix, url)
    else:
        tmp_root = tempfile.mkdtemp(prefix="stoa-local-e2e-")
        url = tmp_root
        bucket = open_bucket(url)
    summary: dict[str, Any] = {"bucket": url, "prefix": prefix, "engine": engine_name}
    try:
        model_dir = resolve_model(model or os.environ.get("MODEL") or "tiny")
        eng: Any = make_engine(engine_name, Path(model_dir), WorkerConfig())
        codec = TextCodec(model_dir)
        fp = model_fingerprint(Path(model_dir))
        run_id = f"local-e2e-{tag}"
        contract = RunContract(
            run_id=run_id,
            model=ModelSpec(architecture=fp.architecture, config_hash=fp.config_hash,
                            tokenizer_hash=fp.tokenizer_hash, vocab_size=eng.vocab_size,
                            eos_token_ids=codec.eos_ids),
            n_samples=samples, plane="bf16", task_id=the_task.id, task_spec=dict(the_task.spec()),
            reward_version=the_task.reward_version,
            sampling=SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=tokens),
            created_at=time.time(),
        )
        bucket.put_create(prefix + contract_key(run_id), contract.to_json())

        rng = np.random.default_rng(seed)
        prompts = [the_task.sample_train(rng) for _ in range(groups)]
        prompt_ids = [codec.encode_prompt(p.messages) for p in prompts]
        gen = seed if engine_name == "mlx" else None
        t0 = time.perf_counter()
        comps, st = eng.generate(prompt_ids, samples, max_new_tokens=tokens, temperature=1.0, top_p=1.0,
                                 eos_ids=codec.eos_ids, generator=gen)
        gen_s = time.perf_counter() - t0
        worker = f"local-e2e-{tag}"
        sent: dict[str, RolloutRecord] = {}
        rewards: list[float] = []
        for seq, (prompt, ids, group) in enumerate(zip(prompts, prompt_ids, comps, strict=True)):
            recs = [Sample(np.array(c.tokens, np.int32), np.array(c.logprobs, np.float32),
                           the_task.reward(prompt, codec.decode(c.tokens)), c.finish_reason) for c in group]
            rewards += [s.reward for s in recs]
            rec = RolloutRecord(worker_id=worker, seq=seq, policy_version=1,
                                contract_fingerprint=contract.fingerprint(), task_id=the_task.id,
                                prompt_id=prompt.id, prompt_tokens=np.array(ids, np.int32), samples=recs,
                                sampling={"temperature": 1.0, "top_p": 1.0},
                                timings={"generate_s": gen_s / groups}, created_at=time.time())
            key = prefix + rollout_key(run_id, 1, worker, seq)
            bucket.put_create(key, rec.encode())
            sent[key] = rec

        listed = [o for o in bucket.list(prefix + rollouts_prefix(run_id))]
        record_bytes, valid, problems = 0, 0, []
        for info in listed:
            data = bucket.get(info.key)
            record_bytes += len(data)
            try:
                back = RolloutRecord.decode(data)
                validate_record(back, contract, current_version=1)
                _same(back, sent[info.key])
                valid += 1
            except (RecordRejected, KeyError, ValueError) as e:
                problems.append(f"{info.key}: {e}")
        if len(listed) != groups:
            problems.append(f"listed {len(listed)} records under {prefix}, wrote {groups}")
        summary.update(
            model=str(model_dir), groups=groups, samples=samples, max_new_tokens=tokens,
            new_tokens=st.new_tokens, generate_s=gen_s, prefill_s=st.prefill_s, decode_s=st.decode_s,
            tokens_per_s=st.new_tokens / gen_s if gen_s else 0.0,
            reward_mean=float(np.mean(rewards)), record_bytes=record_bytes, records_valid=valid,
            validation="ok" if not problems else "; ".join(problems),
        )
        echo(f"[local-e2e] {engine_name} engine, model {model_dir}, task {the_task.id}")
        echo(f"[local-e2e] {groups} groups x {samples} samples, {st.new_tokens} new tokens in {gen_s:.2f}s "
             f"({summary['tokens_per_s']:.1f} tok/s; prefill {st.prefill_s:.2f}s, decode {st.decode_s:.2f}s)")
        echo(f"[local-e2e] reward mean {summary['reward_mean']:.3f}; {len(listed)} records, {record_bytes} bytes "
             f"under {url.rstrip('/')}/{prefix}")
        echo(f"[local-e2e] validation: {valid}/{groups} records valid" + ("" if not problems else f" - {problems}"))
        if problems:
            raise RuntimeError(f"local-e2e: records failed the round trip: {'; '.join(problems)}")
        return summary
    finally:
        _cleanup(bucket, prefix, summary, echo)
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)


def _same(back: RolloutRecord, sent: RolloutRecord) -> None:
    """Raise ValueError when a read-back record differs from what was written."""
    if back.prompt_id != sent.prompt_id or not np.array_equal(back.prompt_tokens, sent.prompt_tokens):
        raise ValueError("prompt differs after the round trip")
    for a, b in zip(back.samples, sent.samples, strict=True):
        if not (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)):
            raise ValueError("sample tokens or logprobs differ after the round trip")


def _cleanup(bucket: Any, prefix: str, summary: dict[str, Any], echo: Callable[[str], Any]) -> None:
    """Delete the run's prefix; record (and say) whether anything is left."""
    from stoa.bucket import BucketError

    try:
        bucket.delete_prefix(prefix)
        left = sum(1 for _ in bucket.list(prefix))
        summary["cleaned"] = left == 0
        if left:
            echo(f"[local-e2e] warning: {left} objects left under {prefix}")
    except (BucketError, OSError) as e:
        summary["cleaned"] = False
        echo(f"[local-e2e] warning: could not delete {prefix}: {e}")
