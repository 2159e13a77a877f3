"""A config's text forms: command-line flags generated from the fields, TOML for ``--dry-run``, and the
help formatter every ``stoa`` command uses (one default style, no reStructuredText markup)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from stoa.config.base import BaseConfig, ConfigError
from stoa.config.loading import field_type

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
        help_text = bracket_default(help_text)  # a default described in words wins over its literal value
        if f.default is not dataclasses.MISSING and "[default:" not in help_text:
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
