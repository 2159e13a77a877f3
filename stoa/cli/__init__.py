"""The ``stoa`` command line: one module per command, each with ``register(subparsers)``.

A user error (bad flag or setting, unreachable bucket, another trainer on the run, ...) prints one line
naming the problem and the fix and exits with the code of its kind (``EXIT_CODES``); a traceback is printed
only with ``--debug`` or ``STOA_DEBUG=1``. Anything else is a bug: exit 1 with its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import NamedTuple

from stoa import __version__
from stoa.cli.parser import StoaParser, check_log_level, command_listing, one_line_deprecations
from stoa.config.loading import DeprecatedSetting
from stoa.config.names import foreign_hint
from stoa.config.text import HelpFormatter, RawHelpFormatter

COMMANDS = ("trainer", "worker", "quickstart", "model", "bench", "local-e2e", "local", "export", "retriever",
            "join-card", "join", "status", "plot", "audit", "eval", "runs", "task", "worker-key")

EXIT_CODES: dict[int, str] = {
    0: "done",
    1: "unexpected failure (a bug: the traceback is printed)",
    2: "invalid flag, setting, config file, bucket URL, model or task name",
    3: "the run's contract disagrees with this command's settings or model",
    4: "bucket unreachable, access denied, or an object missing",
    5: "timed out waiting (for the run, its weights or the bucket)",
    6: "another trainer holds the run (stoa trainer --take-over once its heartbeat is stale)",
    7: "this trainer lost the run to another one; it stopped without writing",
    8: "export refused",
    9: "bucket credentials missing or unsafe",
    10: "published weights unusable (e.g. another trainer moved the pointer)",
    11: "the model could not be fetched",
    12: "no such run in the bucket (stoa runs --bucket B lists them)",
    13: "an object in the bucket is malformed and nothing can go on without it (restore it or start a new run)",
    14: "a task plugin does not import or is not a task (docs/tasks.md#your-own-task)",
    15: "a task's reward function has the wrong signature or returns the wrong number or kind of rewards",
    16: "this machine's task plugin code is missing or differs from the run's (the message names the pip install)",
    130: "interrupted",
}


class UserError(NamedTuple):
    """How one kind of user error is reported.

    Args:
        cls: ``module:Class`` of the exception (subclasses match too; the first matching row wins).
        code: the exit code (a key of ``EXIT_CODES``).
        line: the one-line message from the exception.
    """

    cls: str
    code: int
    line: Callable[[BaseException], str]


def _weights_line(e: BaseException) -> str:
    if getattr(e, "reason", "") == "pointer_conflict":
        return ("another trainer moved the pointer of this run (two trainers on one run); stop the other "
                "trainer, then start this one again to resume from the published version")
    return f"weights error {e}; the worker retries by itself, check that the trainer is running"


USER_ERRORS: tuple[UserError, ...] = (
    UserError("stoa.config.base:ConfigError", 2, lambda e: f"invalid setting {e}"),
    UserError("stoa.bucket.url:BucketURLError", 2, str),
    UserError("stoa.models.registry:UnknownModel", 2, str),
    UserError("stoa.retrieval.bm25:BadIndex", 2, lambda e: f"retriever index: {e}"),
    UserError("stoa.retrieval.corpus:CorpusError", 2, lambda e: f"corpus: {e}"),
    UserError("stoa.tasks.base:TaskDataError", 2, lambda e: f"task data: {e}"),
    UserError("stoa.tasks.base:RewardFunctionError", 15, lambda e: f"reward function: {e}"),
    UserError("stoa.tasks.base:TaskPluginError", 14, lambda e: f"task plugin: {e}"),
    UserError("stoa.tasks.base:RewardError", 15, lambda e: f"reward function: {e}"),
    UserError("stoa.tasks.code:TaskCodeMismatch", 16, lambda e: f"task code: {e}"),
    UserError("stoa.bench.checkout:BenchScriptMissing", 2, str),
    UserError("stoa.contract:ContractMismatch", 3, str),
    UserError("stoa.contract:RunNotFound", 12, str),
    UserError("stoa.untrusted:BadBucketObject", 13, str),
    UserError("stoa.bucket.credentials:CredentialsError", 9, lambda e: f"bucket credentials: {e}"),
    UserError("stoa.bucket.base:BucketError", 4, lambda e: f"bucket error: {e}"),
    UserError("builtins:TimeoutError", 5, str),
    UserError("stoa.envs.base:ToolUnavailable", 5, lambda e: f"tools unavailable: {e}"),
    UserError("stoa.trainer.lease:LeaseHeld", 6, str),
    UserError("stoa.trainer.lease:LeaseLost", 7, str),
    UserError("stoa.models.hf_dir:ExportError", 8, lambda e: f"export: {e}"),
    UserError("stoa.weights.errors:WeightsError", 10, _weights_line),
    UserError("stoa.models.registry:ModelFetchError", 11, str),
)


DESCRIPTION = "RL post-training with disposable rollout workers."
"""The first line of ``stoa --help``; the commands by group follow it."""


def epilog() -> str:
    """The exit codes and the debug switch, for ``stoa --help``."""
    codes = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"exit codes:\n{codes}\n\n--debug (or STOA_DEBUG=1) prints the traceback of an error too."


def user_error(error: BaseException) -> UserError | None:
    """The first row of ``USER_ERRORS`` that ``error`` is an instance of; None for a bug.

    Args:
        error: the exception a command raised.
    """
    for row in USER_ERRORS:
        module, _, name = row.cls.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # a module that optional parts of stoa leave out
            continue
        if isinstance(error, cls):
            return row
    return None


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every command registered, one help style, and the global flags
    (``--log-level``, ``--debug``) accepted before or after the command."""

    parser = StoaParser(prog="stoa", description=DESCRIPTION, epilog=epilog(), formatter_class=RawHelpFormatter)
    parser.add_argument("--version", action="version", version=f"stoa {__version__}",
                        help="print the version and exit")
    _global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="one of the commands listed above "
                                "(stoa COMMAND --help for its flags)")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"stoa.cli.{name.replace('-', '_')}").register(sub)
    parser.description = f"{DESCRIPTION}\n\n{command_listing(sub)}"
    sub._choices_actions = []  # listed by group in the description instead
    for sub_parser in _subparsers(parser):
        sub_parser.formatter_class = HelpFormatter
        _global_flags(sub_parser, top=False)
    return parser


def _global_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Add ``--log-level`` and ``--debug``; after a command they override the top-level values only when
    given (``SUPPRESS``)."""
    level = os.environ.get("STOA_LOG_LEVEL", "WARNING")
    debug = os.environ.get("STOA_DEBUG", "") not in ("", "0")
    parser.add_argument("--log-level", default=level if top else argparse.SUPPRESS,
                        help="Python logging level for library messages (env STOA_LOG_LEVEL) "
                             f"[default: {level!r}]")
    parser.add_argument("--debug", action="store_true", default=debug if top else argparse.SUPPRESS,
                        help="print the traceback of an error too (env STOA_DEBUG=1)")


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser below ``parser`` (``local train`` too), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_parser in dict.fromkeys(action.choices.values()):  # aliases share one parser
                found += [sub_parser, *_subparsers(sub_parser)]
    return found


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command that ``args`` ran, e.g. ``stoa local train``'s.

    Args:
        parser: the top-level parser.
        args: what it parsed.
    """
    for action in parser._actions:
        chosen = getattr(args, action.dest, None)
        if isinstance(action, argparse._SubParsersAction) and chosen in action.choices:
            return command_parser(action.choices[chosen], args)
    return parser


def unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's message for unknown arguments, with the closest flag of the command when there is one.

    Args:
        parser: the command's parser.
        unknown: the arguments it did not recognize.
    """

    flags = [s for action in parser._actions if action.help is not argparse.SUPPRESS  # not deprecated ones
             for s in action.option_strings if s.startswith("--")]
    typed = [a.split("=")[0] for a in unknown if a.startswith("--")]
    known = {f[2:].replace("-", "_") for f in flags}
    foreign = next((h for h in (foreign_hint(a, known, flag=True) for a in typed) if h), "")
    close = [difflib.get_close_matches(a, flags, n=1) for a in typed]
    hint = foreign or next((f"; did you mean {c[0]}?" for c in close if c), "")
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stoa`` script; returns the exit code (``EXIT_CODES``).

    Args:
        argv: arguments (default ``sys.argv[1:]``).
    """

    parser = build_parser()
    with warnings.catch_warnings():
        warnings.simplefilter("default", DeprecatedSetting)
        warnings.showwarning = one_line_deprecations(warnings.showwarning)
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            command = command_parser(parser, args)
            command.error(unrecognized(command, unknown))
        return _run(args, check_log_level)


def _run(args: argparse.Namespace, check_log_level: Callable[[str], int]) -> int:
    """Run the parsed command; a user error is one line and its exit code (``USER_ERRORS``).

    Args:
        args: what the parser returned.
        check_log_level: ``--log-level``'s check (``stoa.cli.parser``).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        level = check_log_level(args.log_level)
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("stoa: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        row = user_error(e)
        if row is None:
            raise
        if args.debug:
            traceback.print_exc()
        print(f"stoa: {row.line(e)}", file=sys.stderr)
        return row.code
