"""Trainer start-up: the run contract, resuming a run from it, the model files workers need, and evaluation."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from safetensors.numpy import save_file

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound, open_bucket
from stoa.config import TrainerConfig
from stoa.config.base import ConfigError
from stoa.contract import (
    ContractMismatch,
    ModelSpec,
    RunContract,
    SamplingSpec,
    canonical_json,
    digest_hex,
    download_model_files,
    upload_model_files,
)
from stoa.engines import engine_from_model
from stoa.episodes.evaluation import evaluate_heldout
from stoa.layout import contract_key
from stoa.models import default_cache_dir, model_fingerprint, resolve_model
from stoa.tasks import get_task, parse_task_spec, task_class, task_name
from stoa.tasks.base import Task
from stoa.tasks.code import task_code
from stoa.tasks.data import TaskData, TaskFile, file_options, localize_options, portable_task_data, upload_task_files
from stoa.tasks.multiturn import is_multiturn
from stoa.tokenize import TextCodec
from stoa.trainer.lease import Lease
from stoa.trainer.resume import Change, changes_line, legacy_line, merge, read_stored, store
from stoa.weights.adapter import AdapterSpec, fetch_base
from stoa.weights.planes import state_to_f32
from stoa.weights.sync import WeightSync


def build_contract(cfg: TrainerConfig, model_dir: Path, task: Task, codec: TextCodec, vocab_size: int,
                   retriever: Mapping[str, Any] | None = None, task_data: TaskData | None = None,
                   adapter: AdapterSpec | None = None) -> RunContract:
    """Assemble the run contract from the resolved config, model and task.

    The task's spec goes in portable: each file option names its ``bucket:<sha256>/<name>`` copy, never the
    trainer's local path (``stoa.tasks.data``), so the contract is the same on every machine.

    Args:
        cfg: resolved trainer config.
        model_dir: the base model directory.
        task: the task.
        codec: the model's tokenizer.
        vocab_size: embedding rows of the model.
        retriever: a search task's index (``fingerprint``), from ``stoa.episodes.task_tools.open_task_tools``.
        task_data: ``portable_task_data(task)`` when the caller already has it (its files go to
            :func:`ensure_contract`); computed here otherwise.
        adapter: a LoRA run's adapter plane (``stoa.weights.adapter``); None for full fine-tuning.
    """

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
        task_id=task_name(task),
        task_spec=(task_data or portable_task_data(task)).spec,
        task_code=tuple(code.to_dict() for code in task_code(task)),
        reward_version=task.reward_version,
        sampling=SamplingSpec(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens),
        staleness_bound=cfg.staleness_bound,
        reuse_cap=cfg.reuse_cap,
        algorithm=algo.to_dict(),
        retriever=dict(retriever or {}),
        adapter=adapter.to_dict() if adapter is not None else {},
        created_at=time.time(),
    )


def ensure_contract(bucket: Bucket, contract: RunContract, model_dir: Path | None = None,
                    task_files: tuple[TaskFile, ...] = (), config: TrainerConfig | None = None) -> RunContract:
    """Write the contract create-only, or verify the existing one matches (restart).

    A new run gets its model files, task data files and stored settings first and the contract last, so a
    worker that sees the contract finds the files (and a run with a contract has its settings); a restart checks
    the contract before touching the files.

    Args:
        bucket: the run's bucket.
        contract: the contract this trainer would write.
        model_dir: the base model directory whose config and tokenizer files workers download.
        task_files: the files the task's options name (``portable_task_data(task).files``).
        config: the trainer's resolved settings to store (``stoa.trainer.resume.store``); None stores nothing.

    Raises:
        ContractMismatch: the run exists with different settings (or model files); names the fields.
    """
    key = contract_key(contract.run_id)
    if not bucket.exists(key):
        if model_dir is not None:
            upload_model_files(bucket, contract.run_id, model_dir)
        upload_task_files(bucket, contract.run_id, task_files)
        if config is not None:
            store(bucket, config, run_exists=False)
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
        upload_task_files(bucket, contract.run_id, task_files)
        if config is not None:
            store(bucket, config, run_exists=True)
        return existing


def contract_settings(contract: RunContract) -> dict[str, Any]:
    """The plain config values a run's contract fixes (task, algorithm and model are handled apart).

    Args:
        contract: the run's contract.
    """
    return {"n_samples": contract.n_samples, "plane": contract.plane,
            "temperature": contract.sampling.temperature, "top_p": contract.sampling.top_p,
            "max_new_tokens": contract.sampling.max_new_tokens, "staleness_bound": contract.staleness_bound,
            "reuse_cap": contract.reuse_cap}


def _contradiction(run_id: str, name: str, run_value: Any, place: str, value: Any) -> ContractMismatch:
    return ContractMismatch([name], f"run {run_id!r} has {run_value}, {place} says {value}; leave {place} out "
                                    "to resume with the run's settings, or start a new --run")


class Resumed(NamedTuple):
    """What a trainer command resolves against the bucket (``resume_plan``)."""

    cfg: TrainerConfig
    exists: bool
    """Whether the run is already in the bucket (its contract is)."""
    stored: bool
    """Whether the run has stored trainer settings (False: new, or created by an older stoa)."""
    changes: list[Change]
    """Stored settings this restart changes."""

    def notes(self) -> list[str]:
        """The lines a restart reports (none for a new run): the changes, or the older run's warning."""
        if not self.exists:
            return []
        return [changes_line(self.cfg.run, self.changes) if self.stored else legacy_line(self.cfg.run)]


def resume_config(cfg: TrainerConfig, given: Mapping[str, str], echo=print) -> TrainerConfig:
    """``resume_plan``'s config, its notes echoed.

    Args:
        cfg: the config from defaults, TOML, env and flags.
        given: field -> where the user gave it; defaults are absent.
        echo: where notes go.
    """
    plan = resume_plan(cfg, given, echo)
    for line in plan.notes():
        echo(line)
    return plan.cfg


def resume_plan(cfg: TrainerConfig, given: Mapping[str, str], echo=print) -> Resumed:
    """On an existing run, take every contract setting and every stored setting from the run.

    ``stoa trainer --bucket B --run R`` then resumes without repeating flags: the contract fixes what workers
    agree on (a given one must agree with it), the stored settings (``stoa.trainer.resume``) the rest (a given
    one must agree unless ``TrainerConfig.MAY_CHANGE`` lists it). ``--model`` is optional: given, its
    fingerprints must match the contract; left out, the model of the run's last trainer (recorded in its lease)
    is used when it resolves here with matching fingerprints, else the model is rebuilt from the bucket's model
    files and the published weights (the checkpoint, if any, is loaded over them).

    Args:
        cfg: the config from defaults, TOML, env and flags.
        given: field -> where the user gave it (``--n-samples``, ``STOA_N_SAMPLES``, ...); defaults are absent.
        echo: where notes on the model go.

    Returns:
        ``cfg`` unchanged for a new run, else ``cfg`` with the run's settings, and the changes.

    Raises:
        ContractMismatch: a given setting contradicts the run; the message shows both values.
    """
    bucket = open_bucket(cfg.bucket)
    try:
        contract = RunContract.from_json(bucket.get(contract_key(cfg.run)))
    except ObjectNotFound:
        return Resumed(cfg, False, False, [])
    values: dict[str, Any] = {}
    for name, run_value in contract_settings(contract).items():
        if name in given and getattr(cfg, name) != run_value:
            raise _contradiction(cfg.run, name, run_value, given[name], getattr(cfg, name))
        values[name] = run_value
    values["task"] = _resume_task(cfg, given, contract, bucket)
    cfg = dataclasses.replace(cfg, **values)
    cfg = dataclasses.replace(cfg, **_resume_algorithm(cfg, given, contract))
    stored = read_stored(bucket, cfg.run)
    merged = merge(cfg, stored or {}, given)
    cfg = dataclasses.replace(merged.cfg, model=_resume_model(merged.cfg, given, contract, bucket, echo))
    return Resumed(cfg.validate(), True, stored is not None, merged.changes)


def check_replay(replay: bool, task: Task) -> str:
    """Refuse ``replay`` settings the task cannot honour; the line to print when the run trusts its workers.

    A multi-turn task whose tools are not deterministic declares ``deterministic_tools = False``: replaying them
    would reject honest records, so such a run must say ``replay = false`` itself, never by default.

    Args:
        replay: the ``replay`` setting.
        task: the run's task.

    Raises:
        ConfigError: ``replay = false`` for a single-turn task, or ``replay = true`` for tools that cannot be
            replayed.
    """
    multi = is_multiturn(task)
    if not replay and not multi:
        raise ConfigError("replay", f"task {task.id!r} has no tool calls to replay; leave replay out")
    if replay and multi and getattr(task, "deterministic_tools", True) is False:
        raise ConfigError("replay", f"task {task.id!r} declares tools that are not deterministic, which the trainer "
                                    "cannot replay; set replay = false (--set replay=false), a weaker trust level "
                                    "(docs/tasks.md#tools-that-cannot-be-replayed)")
    if not replay:
        return ("replay = false: the trainer takes the observations workers recorded without re-running a tool "
                "(rollout/unreplayed counts them)")
    return ""


def _resume_task(cfg: TrainerConfig, given: Mapping[str, str], contract: RunContract, bucket: Bucket) -> str:
    """The run's task spec string; a given ``--task`` must build the contract's task (compared portably)."""

    if "task" in given:
        name, opts = parse_task_spec(cfg.task)
        task = get_task(name, **localize_options(bucket, cfg.run, name, opts))
        spec = portable_task_data(task).spec
        if task_name(task) != contract.task_id or canonical_json(spec) != canonical_json(contract.task_spec):
            raise _contradiction(contract.run_id, "task", f"{contract.task_id} {dict(contract.task_spec)}",
                                 given["task"], f"{task.id} {spec}")
        return cfg.task
    try:  # a task with file options has no data-free default (gsm8k's would load the hub)
        default = {} if file_options(contract.task_id) else get_task(contract.task_id).spec()
    except ValueError:
        default = {}
    opts = getattr(task_class(contract.task_id), "OPTIONS", {})
    items = [f"{k}={one}" for k, v in contract.task_spec.items() if k in opts and default.get(k) != v
             for one in (v if isinstance(v, list) else [v])]  # a repeatable option, once per value
    if any("," in item for item in items):
        raise ContractMismatch(["task"], f"run {contract.run_id!r} has a task option with a comma; give --task "
                                         "as the run was started")
    return contract.task_id + (":" + ",".join(items) if items else "")


def _resume_algorithm(cfg: TrainerConfig, given: Mapping[str, str], contract: RunContract) -> dict[str, Any]:
    run_algo = dict(contract.algorithm)
    places = [given[n] for n in ("algorithm", "algo", "kl_beta") if n in given]
    if places:
        mine = cfg.algo_config().to_dict()
        for k in sorted(set(mine) | set(run_algo), key=lambda k: (k != "name", k)):  # the name first
            if canonical_json(mine.get(k)) != canonical_json(run_algo.get(k)):
                raise _contradiction(contract.run_id, f"algorithm.{k}", run_algo.get(k), " and ".join(places),
                                     mine.get(k))
        return {}
    knobs = {k: v for k, v in run_algo.items() if k not in ("name", "kl_beta", "temperature", "max_tokens")}
    return {"algorithm": run_algo.get("name", cfg.algorithm), "algo": knobs, "kl_beta": run_algo.get("kl_beta")}


def _fingerprint_diff(model: str, spec: ModelSpec) -> list[str] | None:
    """The contract's model fields ``model`` disagrees on; ``None`` when it does not resolve here."""

    try:
        fp = model_fingerprint(resolve_model(model))
    except Exception:  # noqa: BLE001 - any failure to resolve means "not usable here"
        return None
    return [f for f in ("architecture", "config_hash", "tokenizer_hash") if getattr(fp, f) != getattr(spec, f)]


def _resume_model(cfg: TrainerConfig, given: Mapping[str, str], contract: RunContract, bucket: Bucket,
                  echo) -> str:

    spec = contract.model
    if "model" in given:
        diff = _fingerprint_diff(cfg.model, spec)
        if diff:
            raise ContractMismatch([f"model.{f}" for f in diff], f"run {contract.run_id!r} was started with another "
                                   f"model ({spec.architecture}, config {spec.config_hash[:12]}, tokenizer "
                                   f"{spec.tokenizer_hash[:12]}) than {given['model']} {cfg.model}; leave "
                                   "--model out to use the run's model")
        return cfg.model
    last, _ = Lease(bucket, cfg.run).read()
    if last is not None and last.model and _fingerprint_diff(last.model, spec) == []:
        echo(f"[trainer] run {cfg.run!r}: model {last.model} (as its last trainer)")
        return last.model
    if (cfg.kl_beta or 0) > 0:
        raise ContractMismatch(["model"], f"run {cfg.run!r} has kl_beta {cfg.kl_beta}: its reference is the base "
                                          "model, whose weights the bucket does not keep; pass --model with it")
    dest = model_from_bucket(bucket, cfg.run, contract.plane, run_key=contract.run_key, adapter=contract.adapter_spec)
    echo(f"[trainer] run {cfg.run!r}: model rebuilt from the bucket's model files and published weights in {dest}")
    return str(dest)


def model_from_bucket(bucket: Bucket, run_id: str, plane: str, dest: Path | None = None, run_key: str = "",
                      adapter: AdapterSpec | None = None) -> Path:
    """A model directory from the run's model files and its published weights (the pointer's version).

    Args:
        bucket: the run's bucket.
        run_id: the run.
        plane: the run's weight plane.
        dest: the directory to fill (default: under the stoa cache, per bucket and run).
        run_key: a signed run's public key: the pointer must carry its signature.
        adapter: a LoRA run's adapter plane: the directory gets the base it published (verified against the
            contract's hash), not the adapter versions.
    """


    if dest is None:
        dest = default_cache_dir() / "runs" / digest_hex(bucket.url.encode())[:12] / run_id / "model"
    download_model_files(bucket, run_id, dest)
    if adapter is not None:
        state = fetch_base(bucket, run_id, plane, adapter)
    else:
        _, state = WeightSync(bucket, run_id, plane, run_key=run_key).sync()
    save_file({k: np.ascontiguousarray(v) for k, v in state_to_f32(state, plane).items()},
              str(dest / "model.safetensors"))
    return dest


def evaluate(model, codec: TextCodec, task: Task, n: int, max_new_tokens: int, batch: int = 32, *,
             tools: Any = None, k: int = 1) -> dict[str, float]:
    """Held-out figures of the trainer's torch HF model (``stoa.episodes.evaluation.evaluate_heldout``): greedy
    accuracy, or for a multi-turn task EM, cover-EM, search rate and pass@k.

    Args:
        model: an HF causal LM (left in train mode afterwards if it was).
        codec: tokenizer.
        task: the task.
        n: number of held-out prompts.
        max_new_tokens: length cap (of each model turn in an episode).
        batch: prompts decoded together.
        tools: a multi-turn task's tools (None: single-turn).
        k: sampled episodes per prompt for pass@k (multi-turn; 1: greedy only).
    """

    was_training = model.training
    try:
        return evaluate_heldout(engine_from_model(model), codec, task, n, max_new_tokens, tools=tools, k=k,
                                batch=batch)
    finally:
        model.train(was_training)


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
