"""A config's text forms: command-line flags generated from the fields, and TOML for ``--dry-run``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from stoa.config.base import BaseConfig, ConfigError
from stoa.config.loading import field_type


def add_config_flags(parser: argparse.ArgumentParser, cls: type[BaseConfig],
                     skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per config field (default ``None`` so unset flags don't override TOML/env).

    Deprecated aliases (``cls.ALIASES``) get their old flag too, marked deprecated.

    Args:
        parser: the argparse parser to extend.
        cls: the config dataclass.
        skip: field names to leave out (with their aliases).
    """
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        t = field_type(cls, f.name)
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.name in cls.ENV_VARS:
            help_text += f" (env {cls.ENV_VARS[f.name]})"
        if f.default is not dataclasses.MISSING:
            help_text += f" [default: {f.default!r}]"
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
    for old, new in cls.ALIASES.items():
        if new not in skip:
            parser.add_argument("--" + old.replace("_", "-"), dest=old, type=str, default=None,
                                metavar=new.upper(), help=f"deprecated: use --{new.replace('_', '-')}")


def overrides_from_args(args: argparse.Namespace, cls: type[BaseConfig]) -> dict[str, Any]:
    """Collect the config fields (and deprecated aliases) set on the command line.

    Args:
        args: parsed arguments.
        cls: the config dataclass whose fields to collect.
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
    return out


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
