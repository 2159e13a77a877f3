"""The ``stoa`` argument parser's manners: did-you-mean for commands, choices and required flags, commands
listed by what people do, a checked ``--log-level``, and one-line deprecation warnings."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from stoa.config.base import ConfigError
from stoa.config.loading import DeprecatedSetting

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""What ``--log-level`` (and ``STOA_LOG_LEVEL``) accepts, in any case."""

_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$")
_REQUIRED = "the following arguments are required: "
_COMMAND_CHOICE = re.compile(r"argument (?P<what>[A-Z]+): invalid choice: '(?P<given>[^']*)'")


class CommandGroup(NamedTuple):
    """Commands ``stoa --help`` lists together.

    Args:
        title: the group's name (what people do with its commands).
        names: the commands, in the order they are listed.
    """

    title: str
    names: tuple[str, ...]


COMMAND_GROUPS: tuple[CommandGroup, ...] = (
    CommandGroup("start a run", ("quickstart", "trainer", "worker")),
    CommandGroup("fleet: more machines, run management", ("join-card", "join", "runs", "worker-key")),
    CommandGroup("watch a run", ("status", "plot", "audit", "eval")),
    CommandGroup("local mode (one machine, LoRA)", ("local", "local-e2e")),
    CommandGroup("tools", ("task", "model", "export", "retriever", "bench")),
)
"""``stoa --help``'s command listing; a name not registered in this build (``runs`` before its module lands)
is left out of the listing."""


class StoaParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line that suggests the closest command, choice or flag.

    ``stoa trainr`` names ``trainer``; ``--engine trch`` names ``torch``; a required flag reported missing
    while a near miss of it was given (``--bukcet``) names both. The usage is left to ``--help``.
    """

    _given: Sequence[str] = ()

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[Any, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:  # argparse's signature: exits 2
        hint = self._hint(message)
        command = _COMMAND_CHOICE.match(message)
        if command:  # "argument COMMAND: invalid choice: 'trainr' (choose from ...every command...)"
            message = f"unknown {command.group('what').lower()} {command.group('given')!r}"
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")

    def _hint(self, message: str) -> str:
        """The did-you-mean to add to an argparse error message ('' when nothing is close)."""
        found = _CHOICE.search(message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group("choices"))
            close = difflib.get_close_matches(found.group("given"), choices, n=1, cutoff=0.6)
            return f"; did you mean '{close[0]}'?" if close else ""
        if message.startswith(_REQUIRED):
            return self._required_hint(message[len(_REQUIRED):].split(", "))
        return ""

    def _required_hint(self, missing: list[str]) -> str:
        known = {s for action in self._actions for s in action.option_strings}
        typed = [a.split("=")[0] for a in self._given if a.startswith("--") and a.split("=")[0] not in known]
        pairs = []
        for flag in missing:
            close = difflib.get_close_matches(flag, typed, n=1, cutoff=0.6)
            if close:
                pairs.append(f"{flag} (you wrote {close[0]})")
        return f"; did you mean {' and '.join(pairs)}?" if pairs else ""


def check_log_level(level: str) -> int:
    """The ``logging`` level of a ``--log-level`` value.

    Args:
        level: e.g. ``info`` or ``WARNING``.

    Raises:
        ConfigError: (field ``log_level``) not one of ``LOG_LEVELS``.
    """

    if level.lower() not in LOG_LEVELS:
        raise ConfigError("log_level", f"{level!r} is not a logging level; use one of {', '.join(LOG_LEVELS)} "
                                       "(--debug prints tracebacks)")
    return logging.getLevelName(level.upper())


def command_listing(sub: argparse._SubParsersAction) -> str:
    """The registered commands by ``COMMAND_GROUPS``, one line each with its help, for ``stoa --help``.

    Args:
        sub: the top-level subparsers, every command registered.
    """
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    width = max(map(len, helps)) + 2
    lines = ["commands:"]
    for group in COMMAND_GROUPS:
        names = [n for n in group.names if n in helps]
        if names:
            lines.append(f"  {group.title}:")
            lines += [f"    {n:<{width}}{helps[n]}" for n in names]
    return "\n".join(lines)


def one_line_deprecations(show: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that writes a deprecated name as one line, ``stoa: warning: ...``, and hands
    every other warning to ``show``.

    Args:
        show: the ``showwarning`` in place before.
    """

    def showwarning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, DeprecatedSetting):
            print(f"stoa: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *args, **kwargs)

    return showwarning
