"""The run's stored trainer configuration (``runs/<run>/config.json``) and how a restart merges it.

A new run stores its resolved ``TrainerConfig`` (all but ``TrainerConfig.NOT_STORED``) before its contract. A
restart takes every stored setting it was not given; a given setting that differs is refused naming both values
(``ContractMismatch``, exit 3), unless it is one of ``TrainerConfig.MAY_CHANGE``, which this trainer then uses
and reports as one line. The settings the contract fixes (group size, plane, sampling, staleness, reuse cap,
task, algorithm) are resolved from the contract first (``stoa.trainer.setup.resume_config``), so they are
skipped here. A run created before configurations were stored has none: it resumes as before, with one warning.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound
from stoa.config import ConfigError, TrainerConfig
from stoa.config.loading import coerce
from stoa.contract import ContractMismatch, canonical_json
from stoa.layout import trainer_config_key
from stoa.schemas import BadSchemaObject
from stoa.schemas.control import StoredConfig

CONTRACT_FIELDS = frozenset({"n_samples", "plane", "temperature", "top_p", "max_new_tokens", "staleness_bound",
                             "reuse_cap", "task", "algorithm", "algo", "kl_beta"})
"""Settings the run contract fixes; ``resume_config`` resolves them from the contract before the stored config."""


class Change(NamedTuple):
    """A stored setting this restart changes (one of ``TrainerConfig.MAY_CHANGE``)."""

    name: str
    run_value: Any
    value: Any
    place: str

    def describe(self) -> str:
        """``steps 30 -> 60 (--steps)``."""
        return f"{self.name} {self.run_value!r} -> {self.value!r} ({self.place})"


class Merged(NamedTuple):
    """A restart's configuration: the stored settings with the given ones, and what changed."""

    cfg: TrainerConfig
    changes: list[Change]


def stored_settings(cfg: TrainerConfig) -> dict[str, Any]:
    """The settings of ``cfg`` that go to the bucket: every field but ``TrainerConfig.NOT_STORED``.

    Args:
        cfg: the resolved config.
    """
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in cfg.NOT_STORED}


def config_bytes(cfg: TrainerConfig) -> bytes:
    """The stored object for ``cfg``: format tag, time and settings, as JSON.

    Args:
        cfg: the resolved config.
    """
    return StoredConfig(stored_settings(cfg), time.time()).to_json()


def parse_config(data: bytes, run_id: str) -> dict[str, Any]:
    """The stored settings, each coerced to its field's type; settings this stoa does not know are dropped.

    Args:
        data: the object's bytes (the bucket is shared: parsed by ``stoa.untrusted``, at most 1 MiB).
        run_id: the run, named in errors.

    Raises:
        ConfigError: not a stored configuration, or a value of the wrong type.
    """

    try:
        settings = StoredConfig.parse(data, trainer_config_key(run_id)).settings
    except BadSchemaObject:
        raise ConfigError("config", f"{trainer_config_key(run_id)} is not a stored trainer configuration; "
                                    "restore it or delete it (the run then resumes from its contract alone)") from None
    fields = {f.name: f for f in dataclasses.fields(TrainerConfig) if f.name not in TrainerConfig.NOT_STORED}
    where = trainer_config_key(run_id)
    return {k: v if v is None and fields[k].default is None else coerce(TrainerConfig, k, v, where)
            for k, v in settings.items() if k in fields}


def read_stored(bucket: Bucket, run_id: str) -> dict[str, Any] | None:
    """The run's stored settings, or None for a run created before they were stored.

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    try:
        return parse_config(bucket.get(trainer_config_key(run_id)), run_id)
    except ObjectNotFound:
        return None


def store(bucket: Bucket, cfg: TrainerConfig, *, run_exists: bool) -> None:
    """Store ``cfg`` for its run: before the contract of a new run, create-only once the run exists.

    A new run's object may be overwritten (a trainer that died before writing the contract left it: the run
    was never created); an existing run keeps the one it has, and an older run without one gets it now.

    Args:
        bucket: the run's bucket (the lease-fenced one).
        cfg: the resolved config.
        run_exists: whether the run's contract is already in the bucket.
    """
    key = trainer_config_key(cfg.run)
    if not run_exists:
        bucket.put(key, config_bytes(cfg))
        return
    try:
        bucket.put_create(key, config_bytes(cfg))
    except ObjectExists:
        pass


def merge(cfg: TrainerConfig, stored: Mapping[str, Any], given: Mapping[str, str]) -> Merged:
    """``cfg`` with every stored setting it was not given; a given one must agree unless it may change.

    Args:
        cfg: the config from defaults, TOML, env and flags (contract settings already resolved).
        stored: the run's stored settings (``read_stored``).
        given: field -> where the user gave it (``--lr``, ``STOA_RUN``, ``lr in run.toml``).

    Returns:
        the merged config (validated) and the changed settings, in field order.

    Raises:
        ContractMismatch: a given setting that may not change differs from the run's; names both values.
    """
    values: dict[str, Any] = {}
    changes: list[Change] = []
    for name, run_value in stored.items():
        if name in CONTRACT_FIELDS:
            continue
        mine = getattr(cfg, name)
        if name not in given or canonical_json(mine) == canonical_json(run_value):
            values[name] = run_value
        elif name in cfg.MAY_CHANGE:
            changes.append(Change(name, run_value, mine, given[name]))
        else:
            raise ContractMismatch([name], f"run {cfg.run!r} has {run_value!r}, {given[name]} says {mine!r}; "
                                           f"leave {given[name]} out to resume with the run's settings, or "
                                           "start a new --run")
    return Merged(dataclasses.replace(cfg, **values).validate(), changes)


def changes_line(run_id: str, changes: list[Change]) -> str:
    """The one line a restart logs: the settings it changes, or that it keeps them all.

    Args:
        run_id: the run.
        changes: ``merge``'s.
    """
    if not changes:
        return f"[trainer] run {run_id!r}: resuming with its stored settings"
    return (f"[trainer] run {run_id!r}: resuming with its stored settings, changed: "
            + ", ".join(c.describe() for c in changes))


def legacy_line(run_id: str) -> str:
    """The warning for a run without stored settings (created by an older stoa)."""
    return (f"[trainer] warning: run {run_id!r} has no stored trainer settings (an older stoa started it): the "
            "contract's settings are used and the rest come from this command (lr, groups_per_step, steps...); "
            "they are stored now for the next restart")
