"""A config's text forms: command-line flags generated from the fields (in option groups, ``FLAG_GROUPS``),
TOML for ``--dry-run``, the help formatter every ``stoa`` command uses (one default style, no
reStructuredText markup), and deprecated flag spellings that still work (``deprecated_flag``)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from stoa.config.base import BaseConfig, ConfigError
from stoa.config.loading import DeprecatedSetting, field_type, knows, unknown_setting


class FlagGroup(NamedTuple):
    """One option group of a command's help.

    Args:
        key: the group's short name.
        title: its heading in ``--help``.
        names: its fields, in the order they are listed.
        prefixes: field-name prefixes that belong here too (fields added later land without an edit).
    """

    key: str
    title: str
    names: tuple[str, ...]
    prefixes: tuple[str, ...] = ()


FLAG_GROUPS: tuple[FlagGroup, ...] = (
    FlagGroup("model", "model", ("model", "dtype", "compute_weights", "device", "threads", "engine", "backend",
                                 "quant_bits", "quant_group_size", "torch_base", "lora_rank", "lora_alpha",
                                 "lora_targets", "lora_base_plane")),
    FlagGroup("task", "task and evaluation", ("task", "retriever", "replay", "max_prompt_tokens", "eval_every",
                                              "eval_n", "eval_k"), ("eval_",)),
    FlagGroup("sampling", "sampling", ("n_samples", "groups_per_step", "max_new_tokens", "temperature", "top_p",
                                       "seed", "groups_in_flight", "episode_queue", "max_groups")),
    FlagGroup("optimizer", "optimizer and objective", ("algorithm", "algo", "kl_beta", "lr", "weight_decay",
                                                       "grad_clip", "micro_batch", "gradient_checkpointing",
                                                       "steps", "skip_uniform_groups", "old_logprobs",
                                                       "shared_prefix", "cold_start"), ("cold_start",)),
    FlagGroup("fleet", "fleet: bucket, run, weights and pacing", (
        "bucket", "run", "name", "plane", "staleness_bound", "reuse_cap", "anchor_every", "keep_versions",
        "keep_rollout_versions", "backpressure", "pacing", "poll_seconds", "wait_seconds", "max_wait_seconds",
        "status_seconds", "trainer_stale_seconds", "lease_ttl_seconds", "bucket_retry_seconds",
        "exit_on_outage", "sign_weights", "run_key", "run_key_pub", "worker_keys", "worker_key")),
    FlagGroup("quarantine", "quarantine of disagreeing workers", ("quarantine",), ("quarantine_",)),
    FlagGroup("checkpoints", "checkpoints, outputs and logs", ("checkpoint_every", "keep_checkpoints", "output_dir",
                                                              "resume", "report_to", "log_dir"),
              ("checkpoint_", "metrics_")),
    FlagGroup("advanced", "advanced", ("preflight", "available_memory_gb")),
)
"""The option groups of ``stoa trainer``/``worker``/``local train`` help, in this order; a field no group
names or prefixes goes to the last one."""


def flag_group(name: str) -> FlagGroup:
    """The option group of a config field (the last group for a field no group names).

    Args:
        name: a config field name.
    """
    for group in FLAG_GROUPS:
        if name in group.names:
            return group
    for group in FLAG_GROUPS:
        if name.startswith(group.prefixes) and group.prefixes:
            return group
    return FLAG_GROUPS[-1]


class DeprecatedFlag(argparse.Action):
    """A former spelling of a flag: stores into the current flag's destination and warns (``DeprecatedSetting``,
    one line on the command line)."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str = "", **kwargs: Any):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is deprecated: use {self.new} (same meaning)", DeprecatedSetting,
                      stacklevel=2)
        setattr(namespace, self.dest, values)


def deprecated_flag(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept ``old`` as a hidden, deprecated spelling of the existing flag ``new`` (same type and choices).

    Args:
        parser: the parser that has ``new``.
        old: the former flag, e.g. ``--n``.
        new: the current flag, e.g. ``--eval-n``.
    """
    action = parser._option_string_actions[new]
    same: dict[str, Any] = {k: getattr(action, k) for k in ("type", "choices", "nargs", "metavar")
                            if getattr(action, k) is not None}
    parser.add_argument(old, dest=action.dest, action=DeprecatedFlag, new=new, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS, **same)

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"`([^`]+)`")
_PAREN_DEFAULT = re.compile(r"\s*\(default:?\s+((?:[^()]|\([^()]*\))*)\)")


def plain_text(text: str) -> str:
    """Help text without reStructuredText markup: ``x``, `x` and :func:`x` become x.

    Args:
        text: a description, epilog or help string (often a module docstring).
    """
    return _INTERPRETED.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text)))


def bracket_default(text: str) -> str:
    """Help text with a written-out default in the one style: "(default: X)" or "(default X)" moves to
    the end as "[default: X]".

    Args:
        text: a flag's help.
    """
    found = _PAREN_DEFAULT.search(text)
    if not found or "[default:" in text:
        return text
    rest = (text[:found.start()] + text[found.end():]).rstrip()
    return f"{rest} [default: {found.group(1).strip()}]"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with one style: markup stripped, and ``[default: X]`` (X as Python writes it)
    added to an option's help when it has a default worth showing and the help does not show it."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = bracket_default(plain_text(action.help or ""))
        default = action.default
        shown = "[default:" in text or "%(default)" in text
        positional_required = not action.option_strings and action.nargs not in ("?", "*")
        if shown or positional_required or default is None or default is argparse.SUPPRESS:
            return text
        if isinstance(default, bool) or default == []:
            return text
        return f"{text} [default: %(default)r]"


class RawHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``HelpFormatter`` that keeps the description's and epilog's line breaks (tables such as exit codes)."""


SHORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""Former dtype spellings of some benches -> the config's values (``DTYPES``)."""


def dtype_value(text: str) -> str:
    """An argparse ``type`` for a dtype flag: the config's spelling, with ``fp32``/``bf16`` still read (warning).

    Args:
        text: the flag's value.
    """
    if text in SHORT_DTYPES:
        warnings.warn(f"dtype {text!r} is deprecated: use {SHORT_DTYPES[text]!r} (same meaning)", DeprecatedSetting,
                      stacklevel=2)
        return SHORT_DTYPES[text]
    return text


def add_config_flags(parser: argparse.ArgumentParser, cls: type[BaseConfig],
                     skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per config field (default ``None`` so unset flags don't override TOML/env), in the
    option groups of ``FLAG_GROUPS``, and ``--set KEY=VALUE`` for any of them by its config name.

    Deprecated aliases (``cls.ALIASES``) get their old flag too, hidden from the help, warning when used.

    Args:
        parser: the argparse parser to extend.
        cls: the config dataclass.
        skip: field names to leave out (with their aliases).
    """
    if parser.usage is None:  # every flag in the usage line would be forty lines
        parser.usage = "%(prog)s [--config FILE] [--dry-run] [--set KEY=VALUE ...] [--FLAG VALUE ...]"
    parser.add_argument("--set", dest="set_", action="append", default=None, metavar="KEY=VALUE",
                        help="any setting by its config name (as in a TOML file), e.g. --set lr=1e-4 or --set "
                             "algo.eps_high=0.3 (repeatable)")
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    groups = {g.key: parser.add_argument_group(g.title) for g in FLAG_GROUPS
              if any(flag_group(f.name) is g for f in fields)}
    order = {name: i for i, name in enumerate(n for g in FLAG_GROUPS for n in g.names)}
    for f in sorted(fields, key=lambda f: (FLAG_GROUPS.index(flag_group(f.name)), order.get(f.name, len(order)))):
        _add_field_flag(groups[flag_group(f.name).key], cls, f)
    for old, new in cls.ALIASES.items():
        if new not in skip:
            parser.add_argument("--" + old.replace("_", "-"), dest=old, type=str, default=None,
                                metavar=new.upper(), help=argparse.SUPPRESS)


def _add_field_flag(parser: Any, cls: type[BaseConfig], f: dataclasses.Field) -> None:
    """Add one field's flag (to its option group): a string flag, ``--x/--no-x`` or repeatable ``KEY=VALUE``."""
    t = field_type(cls, f.name)
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    if f.name in cls.ENV_VARS:
        help_text += f" (env {cls.ENV_VARS[f.name]})"
    help_text = bracket_default(help_text)  # a default described in words wins over its literal value
    if "[default:" not in help_text:
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        help_text += " [default: none]" if default == {} else f" [default: {default!r}]"
    help_text = help_text.replace("%", "%%")  # argparse formats help with %
    if t is dict:
        parser.add_argument(flag, dest=f.name, action="append", metavar="KEY=VALUE", default=None,
                            help=help_text.replace("TOML table", "repeatable; TOML table"))
    elif t is bool:
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                            help=help_text)
    else:
        parser.add_argument(flag, dest=f.name, type=str, default=None, metavar=f.name.upper(),
                            help=help_text)


def overrides_from_args(args: argparse.Namespace, cls: type[BaseConfig]) -> dict[str, Any]:
    """Collect the config fields (and deprecated aliases) set on the command line, ``--set KEY=VALUE`` too.

    Args:
        args: parsed arguments.
        cls: the config dataclass whose fields to collect.

    Raises:
        ConfigError: a malformed item, an unknown key (with the closest name), or a setting given both as
            its flag and with ``--set``.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if field_type(cls, f.name) is dict:
            d: dict[str, Any] = {}
            for item in v:
                if "=" not in item:
                    raise ConfigError(f.name, f"expected KEY=VALUE, got {item!r}")
                k, val = item.split("=", 1)
                d[k.strip()] = parse_scalar(val.strip())
            v = d
        out[f.name] = v
    for old in cls.ALIASES:
        if getattr(args, old, None) is not None:
            out[old] = getattr(args, old)
    for item in getattr(args, "set_", None) or []:
        _put_set(out, cls, item)
    return out


def _put_set(out: dict[str, Any], cls: type[BaseConfig], item: str) -> None:
    """Add one ``--set KEY=VALUE`` (``algo.KNOB=VALUE`` for an [algo] knob) to the flags' overrides."""
    key, eq, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or not key:
        raise ConfigError("set", f"expected KEY=VALUE, got {item!r}")
    field, dot, knob = key.partition(".")
    if not knows(cls, field) or (dot and field_type(cls, field) is not dict):
        raise unknown_setting(cls, key, "given with --set")
    if dot:
        table = out.setdefault(field, {})
        if knob in table:
            raise ConfigError(f"{field}.{knob}", f"given twice, as --{field} {knob}=... and as --set {key}; keep one")
        table[knob] = parse_scalar(value.strip())
    elif field in out:
        raise ConfigError(field, f"given twice, as --{field.replace('_', '-')} and as --set {key}; keep one")
    else:
        out[field] = value.strip()


def parse_scalar(s: str) -> Any:
    """Read a flag's ``KEY=VALUE`` value: bool, none, int, float, else the string.

    Args:
        s: the text after ``=``.
    """
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def config_to_toml(cfg: Any) -> str:
    """Render a resolved config as TOML text (for ``--dry-run``); it loads back to the same config.

    Args:
        cfg: a config dataclass instance.
    """
    lines, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None:
            lines.append(f"# {f.name} = (unset: {f.metadata.get('help', '')})")
            continue
        if isinstance(v, dict):
            tables.append((f.name, v))
            continue
        lines.append(f"{f.name} = {_toml_value(v)}")
    for name, d in tables:
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(d.items())]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if v is None:
        return '"none"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
