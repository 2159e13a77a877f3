"""Build a config from layers: dataclass defaults, a TOML file, ``STOA_*`` environment, then flags.

A later layer overrides an earlier one. Within one layer a setting may be given once: a deprecated alias
and its new name together, or a key both at the top of a file and in the command's section, is an error
naming both places; so is a field together with its ``[algo]`` knob, in any layers (``ALGO_TWINS``).

A TOML file is flat (every key is this command's) or sectioned: ``[trainer]``, ``[worker]`` and ``[local]``
hold each command's keys, and top-level keys are shared (a top-level key only another command knows is
skipped). Unknown keys are refused with the closest known name (TRL's and verl's names get ours,
``stoa.config.names``), and so is an unknown choice (engine, plane, algorithm, dtype, ...). A deprecated
environment variable (``DRL_RUN``) still works and warns.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from stoa.algorithms.base import ALGORITHM_NAMES, AlgoConfig
from stoa.config.base import (
    BACKENDS,
    DTYPES,
    ENGINES,
    OLD_LOGPROBS,
    PLANES,
    SECTIONS,
    TORCH_BASE,
    TRACKERS,
    BaseConfig,
    ConfigError,
)
from stoa.config.names import ENV_ALIASES, foreign_hint
from stoa.config.training import TrainingConfig, twin_clash, twin_error

C = TypeVar("C", bound=BaseConfig)


class DeprecatedSetting(FutureWarning):
    """A setting was given by its deprecated name; the message names the new one."""


@dataclass(frozen=True)
class Source:
    """Where a layer's values came from, to name a value's place in errors and warnings.

    Args:
        kind: 'file', 'env' or 'flags'.
        name: the file path or the environment variable ('' for flags).
        section: the TOML section ('' for top-level keys).
    """

    kind: str
    name: str = ""
    section: str = ""

    def place(self, key: str) -> str:
        """How ``key`` was written: ``--n-samples``, ``STOA_N_SAMPLES``, ``[local] n_samples in run.toml``."""
        if self.kind == "flags":
            return "--" + key.replace("_", "-")
        if self.kind == "env":
            return self.name
        return f"[{self.section}] {key} in {self.name}" if self.section else f"{key} in {self.name}"

    def renamed(self, old: str, new: str) -> str:
        """The warning for a deprecated name: ``--group-size is deprecated: use --n-samples``."""
        if self.kind == "flags":
            return f"{self.place(old)} is deprecated: use {self.place(new)} (same meaning)"
        return f"{self.place(old)} is deprecated: rename it {new} (same meaning)"

    def knob_place(self, knob: str) -> str:
        """How an ``[algo]`` knob was written: ``--algo kl_beta=...``, ``[local.algo] kl_beta in f.toml``."""
        if self.kind == "file":
            return f"[{self.section + '.' if self.section else ''}algo] {knob} in {self.name}"
        return f"--algo {knob}=..."


@dataclass(frozen=True)
class Given:
    """One setting as given: its coerced value, the key as written (maybe an alias) and its source."""

    value: Any
    key: str
    source: Source

    @property
    def place(self) -> str:
        """Where it was given, as the user wrote it."""
        return self.source.place(self.key)


Layer = dict[str, Given]
"""Field name -> how a layer gives it."""


def load_config(
    cls: type[C],
    *,
    toml_path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> C:
    """Build a config from defaults, a TOML file, ``STOA_*`` env vars and overrides, then validate.

    Args:
        cls: ``TrainerConfig``, ``WorkerConfig`` or ``LocalConfig``.
        toml_path: optional TOML file, flat or sectioned; unknown keys are refused, naming them.
        overrides: values from CLI flags (``None`` values are ignored); deprecated aliases are accepted.
        env: environment mapping (default ``os.environ``); only ``cls.ENV_VARS`` are read.

    Raises:
        ConfigError: naming the field (and, for a value given twice, both places).
    """
    env = os.environ if env is None else env
    given: Layer = {}
    for layer in (toml_layer(cls, toml_path), env_layer(cls, env), flag_layer(cls, overrides or {})):
        given.update(layer)
    cfg = cls(**{name: g.value for name, g in given.items()})
    if isinstance(cfg, TrainingConfig):
        clash = twin_clash(cfg)
        if clash is not None:
            field_place = given[clash.name].place if clash.name in given else f"the '{clash.name}' default"
            raise twin_error(clash, field_place, given["algo"].source.knob_place(clash.knob))
    try:
        return cfg.validate()  # type: ignore[return-value]
    except ConfigError as e:
        raise with_choice_hint(e, getattr(cfg, e.field, None)) from None


def choices_of(field_name: str) -> tuple[str, ...]:
    """The allowed values of a choice field, as text (empty for a field that is not a choice).

    Args:
        field_name: a config field name, e.g. ``engine``.
    """

    table = {"engine": ENGINES, "plane": PLANES, "dtype": DTYPES, "algorithm": tuple(ALGORITHM_NAMES),
             "backend": BACKENDS, "torch_base": TORCH_BASE, "old_logprobs": OLD_LOGPROBS,
             "report_to": TRACKERS}
    return tuple(map(str, table.get(field_name, ())))


def with_choice_hint(error: ConfigError, value: Any) -> ConfigError:
    """``error`` with "; did you mean 'X'?" added when ``value`` is a near miss of the field's choices.

    Args:
        error: the validation error (its ``field`` names the setting).
        value: the value the setting was given.
    """
    choices = choices_of(error.field)
    if not isinstance(value, str) or not choices or value in choices or "did you mean" in str(error):
        return error
    close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.6)
    if not close:
        return error
    message = str(error).split(": ", 1)[1] if ": " in str(error) else str(error)
    return ConfigError(error.field, f"{message}; did you mean '{close[0]}'?")


def toml_layer(cls: type[BaseConfig], toml_path: str | Path | None) -> Layer:
    """The settings a TOML file gives ``cls``: every key of a flat file, or the shared keys plus its section.

    Args:
        cls: the config class reading the file.
        toml_path: the file (None or empty: no settings).

    Raises:
        ConfigError: the file is missing or not TOML, or a key is unknown (with the closest known name).
    """
    if not toml_path:
        return {}
    data = read_toml(toml_path)
    path = str(toml_path)
    layer: Layer = {}
    sections = {k: v for k, v in data.items() if k in SECTIONS and isinstance(v, dict)}
    for key, value in data.items():
        if key in sections:
            continue
        name = _canonical(key)
        if knows(cls, name):
            put(cls, layer, name, value, Source("file", path))
        elif not (sections and any(knows(other, name) for other in SECTIONS.values())):
            raise unknown_setting(cls, key, f"in {path}", shared=bool(sections))
    for section, table in sections.items():
        owner = SECTIONS[section]
        for key, value in table.items():
            name = _canonical(key)
            if not knows(owner, name):
                raise unknown_setting(owner, key, f"in [{section}] of {path}")
            if owner is cls:
                put(cls, layer, name, value, Source("file", path, section))
    return layer


def env_layer(cls: type[BaseConfig], env: Mapping[str, str]) -> Layer:
    """The settings ``cls.ENV_VARS`` give (empty variables are ignored); a deprecated name of a variable
    (``ENV_ALIASES``: ``DRL_RUN`` for ``STOA_RUN``) counts when the new one is unset, with a warning.

    Args:
        cls: the config class.
        env: the environment mapping.
    """
    layer: Layer = {}
    for name, var in cls.ENV_VARS.items():
        given = var if env.get(var) else next((old for old, new in ENV_ALIASES.items() if new == var
                                               and env.get(old)), "")
        if not given:
            continue
        if given != var:
            warnings.warn(f"{given} is deprecated: use {var} (same meaning)", DeprecatedSetting, stacklevel=2)
        put(cls, layer, name, env[given], Source("env", given))
    return layer


def flag_layer(cls: type[BaseConfig], overrides: Mapping[str, Any]) -> Layer:
    """The settings given on the command line (or by a caller); ``None`` means not given.

    Args:
        cls: the config class.
        overrides: field or alias -> value.
    """
    layer: Layer = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if not knows(cls, key):
            raise unknown_setting(cls, key, "")
        put(cls, layer, key, value, Source("flags"))
    return layer


def put(cls: type[BaseConfig], layer: Layer, key: str, value: Any, source: Source) -> None:
    """Add one setting to a layer: resolve a deprecated alias (warning once), coerce, refuse a repeat.

    Args:
        cls: the config class.
        layer: the layer being built.
        key: the field name or a deprecated alias of one.
        value: the raw value (TOML value, env string or flag string).
        source: where it came from.
    """
    name = cls.ALIASES.get(key, key)
    if name != key:
        warnings.warn(source.renamed(key, name), DeprecatedSetting, stacklevel=3)
    if name in layer:
        first = layer[name]
        keep = name if key != first.key else "one"
        raise ConfigError(name, f"given twice, as {first.place} and as {source.place(key)}; keep {keep}")
    layer[name] = Given(coerce(cls, name, value, source.place(key)), key, source)


def knows(cls: type[BaseConfig], key: str) -> bool:
    """Whether ``key`` is a field of ``cls`` or a deprecated alias of one.

    Args:
        cls: the config class.
        key: a setting name.
    """
    return key in field_names(cls) or key in cls.ALIASES


def field_names(cls: type[BaseConfig]) -> list[str]:
    """The field names of a config class, in order.

    Args:
        cls: the config class.
    """
    return [f.name for f in dataclasses.fields(cls)]


def algo_knobs() -> set[str]:
    """The knobs of the ``algo`` table (``stoa.algorithms.AlgoConfig``'s fields but its name)."""
    return {f.name for f in dataclasses.fields(AlgoConfig)} - {"name"}


def unknown_setting(cls: type[BaseConfig], key: str, where: str, *, shared: bool = False) -> ConfigError:
    """The error for an unknown key, with the closest known name or the command that has it.

    Args:
        cls: the config class the key was read for.
        key: the key as written.
        where: e.g. 'in run.toml' or 'in [worker] of run.toml' ('' for a flag).
        shared: a top-level key of a sectioned file (every command's names count).
    """
    pool = [cls, *SECTIONS.values()] if shared else [cls]
    names = {n: n for c in pool for n in field_names(c)}
    names.update({old: new for c in pool for old, new in c.ALIASES.items()})
    candidates = [*names, *SECTIONS] if shared else list(names)
    close = difflib.get_close_matches(_canonical(key), candidates, n=1)
    hint = foreign_hint(key, set(names))  # another tool's name first: 'beta' is close to no field of ours
    if not hint and "algo" in names and (knob := _canonical(key)) in algo_knobs():
        hint = f"; it is an algorithm knob: algo.{knob} (--set algo.{knob}=V, or {knob} in the [algo] table)"
    if not hint and close:
        hint = f"; did you mean '{names.get(close[0], close[0])}'?"
    elif not hint and (owners := sorted(s for s, c in SECTIONS.items() if c is not cls and knows(c, _canonical(key)))):
        sections = " and ".join(f"[{o}]" for o in owners)
        hint = f"; it belongs to {sections} (a shared file takes it there or at the top level)"
    return ConfigError(key, f"unknown setting{' ' + where if where else ''}{hint}")


def read_toml(toml_path: str | Path) -> dict[str, Any]:
    """Parse a TOML file.

    Args:
        toml_path: the file.

    Raises:
        ConfigError: (field 'config') the file is missing, a directory, unreadable or not valid TOML.
    """
    p = Path(toml_path)
    if p.is_dir():
        raise ConfigError("config", f"{toml_path} is a directory; give the path of a TOML file")
    if not p.is_file():
        raise ConfigError("config", f"file not found: {toml_path}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("config", f"cannot read {toml_path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"{toml_path} is not valid TOML: {e}") from None


def _canonical(key: str) -> str:
    return key.replace("-", "_")


def field_type(cls: type, name: str) -> type:
    """The runtime type of a field (``float | None`` -> ``float``, ``dict[str, Any]`` -> ``dict``).

    Args:
        cls: the config class.
        name: the field name.
    """
    t = typing.get_type_hints(cls)[name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def coerce(cls: type, name: str, value: Any, place: str = "") -> Any:
    """Convert a raw value (TOML, env string, flag string) to the field's type.

    Args:
        cls: the config class.
        name: the field name.
        value: the raw value.
        place: where it was given, named in the error.

    Raises:
        ConfigError: the value does not convert.
    """
    f = {x.name: x for x in dataclasses.fields(cls)}[name]
    t = field_type(cls, name)
    try:
        return _convert(t, value, f.metadata.get("join"))
    except (TypeError, ValueError):
        source = f" ({place})" if place else ""
        raise ConfigError(name, f"expected {t.__name__}, got {value!r}{source}") from None


def _convert(t: type, value: Any, join: str | None) -> Any:
    if t is bool:
        if isinstance(value, str):
            low = value.lower()
            if low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return low in ("1", "true", "yes", "on")
            raise ValueError(value)
        return bool(value)
    if t is dict:
        if not isinstance(value, dict):
            raise ValueError(value)
        return dict(value)
    if t is str and join and isinstance(value, list):
        return join.join(str(x) for x in value)
    if t is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return t(value)
