"""Every ``stoa`` command that README.md and docs/*.md show parses with stoa's own parser; a few cheap ones run.

What counts as a documented command:

- in a fenced block tagged ``bash``/``sh``/``shell``: every ``stoa ...`` command of each shell line (continuation
  lines joined, comments, heredoc bodies and redirections dropped; ``&&``, ``;`` and ``|`` split commands;
  ``VAR=value`` prefixes skipped; ``python -m stoa`` and ``torchrun ... -m stoa --`` count too; variables the
  block assigns on a line of their own are expanded);
- in an untagged or ``console`` block (a transcript): a line that starts with ``$ stoa`` or ``stoa`` (tag an
  output block ``text`` when one of its lines starts with ``stoa``); ``text``, ``python``, ``json`` and other
  blocks hold no commands;
- in prose: an inline code span that starts with ``stoa``.

A fenced command with no placeholder syntax (``[...]``, ``{a,b}``, ``...``, ``A|B``) is parsed whole by
``stoa.cli.build_parser()`` (the bench's own parser for ``stoa bench NAME``): an unknown flag, a missing
argument, an invalid choice or a deprecated spelling fails; a trainer, worker or ``local train`` command then
resolves its configuration (values, the TOML file it names, validation). A synopsis line and an inline span are
partial, so only their flags (and ``{a,b}`` subcommands) are checked against the command they name. Values
that hold a shell variable (``"$RUN"``) are the reader's and keep their defaults. The commands in ``RUNS`` run
for real (each takes seconds). A failure names the doc, the line and the command. Doc TOML blocks and links:
``tests/test_docs_files.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest

from stoa.cli import build_parser
from stoa.cli.bench import BENCHES, bench_parser
from stoa.config import (
    ConfigError,
    DeprecatedSetting,
    LocalConfig,
    TrainerConfig,
    WorkerConfig,
    load_config,
    overrides_from_args,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
SHELL_TAGS = ("bash", "sh", "shell")
TRANSCRIPT_TAGS = ("", "console")  # other tags (text, python, json, toml) hold no commands
INLINE = re.compile(r"`((?:\$ )?stoa [^`]+)`")
ASSIGNMENT = re.compile(r"""^(?:export\s+)?([A-Za-z_]\w*)=(?:"([^"]*)"|'([^']*)'|(\S*))\s*$""")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
OPERATORS = {"&&", "||", ";", "|", "(", ")", "&", ";;"}
REDIRECTS = {">", ">>", "<", "<<", ">&", "<&", "&>"}
PLACEHOLDER = re.compile(r"\[|\]|\{|\}|\.\.\.|(?<=\w)\|(?=\w)")


class Command(NamedTuple):
    """One documented ``stoa`` command.

    Args:
        doc: the doc's path relative to the repository root.
        line: the 1-based line it starts on.
        text: the command as written (continuation lines joined).
        argv: the arguments after ``stoa``.
        partial: a synopsis or inline span: check its flags only.
        error: why the line could not be split as a shell would (an unclosed quote), else empty.
    """

    doc: str
    line: int
    text: str
    argv: list[str]
    partial: bool
    error: str = ""

    def where(self) -> str:
        """``doc:line: text``, the head of every failure message."""
        return f"{self.doc}:{self.line}: {self.text}"


# The configuration each command resolves: (command, local subcommand) -> config class.
CONFIGS = {("trainer", None): TrainerConfig, ("worker", None): WorkerConfig, ("local", "train"): LocalConfig}

# Doc commands that run for real here: (the command exactly as a doc writes it, a line its output must contain).
RUNS = [
    ("stoa worker --print-tier", "groups in flight:"),
    ("stoa local train --config examples/qwen3-0.6b-arithmetic.toml --dry-run --available-memory-gb 16", "fits"),
    ("stoa local smoke --model tiny", "smoke: ok"),
]


def shell_words(line: str) -> list[str]:
    """Split one shell line into words and operators, comments dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def line_commands(doc: str, number: int, text: str, partial: bool, variables: dict[str, str] | None = None
                  ) -> list[Command]:
    """The ``stoa`` commands of one shell line; each is partial when ``partial`` or when it holds placeholder
    syntax. A line that does not split as a shell would is one failing command."""
    try:
        words = shell_words(expand(text, variables or {}))
    except ValueError as e:
        return [Command(doc, number, text.strip(), [], partial, f"the shell cannot split it: {e}")]
    return [Command(doc, number, text.strip(), argv, partial or bool(PLACEHOLDER.search(" ".join(argv))))
            for argv in stoa_argv(words)]


def stoa_argv(words: list[str]) -> list[list[str]]:
    """The argument lists of every ``stoa`` command in one shell line's words."""
    found, segment = [], []
    for word in [*words, ";"]:
        if word not in OPERATORS:
            segment.append(word)
            continue
        while segment and "=" in segment[0] and re.match(r"^[A-Za-z_]\w*=", segment[0]):
            segment = segment[1:]
        segment = [w for i, w in enumerate(segment) if w not in REDIRECTS and (i == 0 or segment[i - 1]
                                                                                  not in REDIRECTS)]
        if segment and segment[0] == "stoa":
            found.append(segment[1:])
        elif "-m" in segment and segment.index("-m") + 1 < len(segment) and segment[segment.index("-m") + 1] == "stoa":
            rest = segment[segment.index("-m") + 2:]
            found.append(rest[1:] if rest[:1] == ["--"] else rest)
        segment = []
    return found


def logical_lines(lines: list[str], start: int) -> list[tuple[int, str]]:
    """Join backslash continuations and drop heredoc bodies; (1-based line number, text) pairs."""
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        number, text = start + i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        out.append((number, text))
        heredoc = HEREDOC.search(text)
        i += 1
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
    return out


def expand(text: str, variables: dict[str, str]) -> str:
    """Replace ``$NAME``/``${NAME}`` of the variables a block assigned (others stay as written)."""
    def sub(m: re.Match[str]) -> str:
        return variables.get(m.group(1) or m.group(2), m.group(0))
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", sub, text)


def shell_block(doc: str, lines: list[str], start: int) -> list[Command]:
    """The ``stoa`` commands of a bash block whose first line is line ``start`` of ``doc``."""
    commands, variables = [], {}
    for number, text in logical_lines(lines, start):
        assigned = ASSIGNMENT.match(text.strip())
        if assigned:
            variables[assigned.group(1)] = next(g for g in assigned.groups()[1:] if g is not None)
            continue
        commands += line_commands(doc, number, text, False, variables)
    return commands


def other_block(doc: str, lines: list[str], start: int) -> list[Command]:
    """The ``$ stoa``/``stoa`` lines of a transcript or untagged block (output lines are not commands)."""
    commands, variables = [], {}
    for number, text in logical_lines(lines, start):
        line = text.strip().removeprefix("$ ")
        assigned = ASSIGNMENT.match(line)
        if assigned:
            variables[assigned.group(1)] = next(g for g in assigned.groups()[1:] if g is not None)
        elif line.startswith("stoa ") or re.match(r"^(?:[A-Z_]+=\S+ )+stoa ", line):
            commands += line_commands(doc, number, line, False, variables)
    return commands


def doc_commands(path: Path) -> list[Command]:
    """Every documented ``stoa`` command of one Markdown file: fenced blocks, then inline spans."""
    doc = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            commands += [c for m in INLINE.finditer(lines[i])
                         for c in line_commands(doc, i + 1, m.group(1).removeprefix("$ "), True)]
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        if fence.group(1) in SHELL_TAGS:
            commands += shell_block(doc, lines[i + 1:end], i + 2)
        elif fence.group(1) in TRANSCRIPT_TAGS:
            commands += other_block(doc, lines[i + 1:end], i + 2)
        i = end + 1
    return commands


def resolve(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser | None, list[str]]:
    """The parser of the (sub)command ``argv`` names and the arguments after its name.

    Returns ``(None, rest)`` for a benchmark that parses its own flags, and the deepest parser reached when a
    word is not a command (``{a,b}`` alternatives, a placeholder).
    """
    while argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and argv[0] in subs[0].choices:
            parser, argv = subs[0].choices[argv[0]], argv[1:]
        elif parser.prog.endswith(" bench") and argv[0] in BENCHES:
            return bench_parser(argv[0]), argv[1:]
        else:
            break
    return parser, argv


@functools.cache
def stoa_parser() -> argparse.ArgumentParser:
    """stoa's parser, built once (parsing does not change it)."""
    return build_parser()


def known_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser``, global flags included."""
    return {s for a in parser._actions for s in a.option_strings} | {"--log-level", "--debug", "--help", "-h"}


def check_flags(cmd: Command, parser: argparse.ArgumentParser | None, rest: list[str]) -> str | None:
    """The first flag (or ``{a,b}`` subcommand) of a partial command that its command does not have; None when
    all exist."""
    if parser is None:
        return None
    alternatives = re.fullmatch(r"\{([\w,.-]+)\}", rest[0]) if rest else None
    for name in alternatives.group(1).split(",") if alternatives else []:
        if resolve(parser, [name])[0] is parser:
            return f"{cmd.where()}\n  {parser.prog} has no command {name}"
    flags = known_flags(parser)
    for word in rest:
        flag = re.sub(r"[\[\]{}(),]|=.*$", "", word)
        if re.match(r"^--?[A-Za-z]", flag) and flag not in flags:
            return f"{cmd.where()}\n  {parser.prog} has no flag {flag}"
    return None


def check_parse(cmd: Command) -> str | None:
    """Parse a whole command as ``stoa`` would; the failure, or None. A deprecated spelling that parsing warns
    about (a warning, or a line on stderr that says deprecated) fails too: the docs show the current one."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args, unknown = stoa_parser().parse_known_args(cmd.argv)
            if unknown:
                return f"{cmd.where()}\n  unrecognized arguments: {' '.join(unknown)}"
            if getattr(args, "command", None) == "bench":
                bench = bench_parser(args.bench)
                if bench is not None:
                    bench.parse_args(args.args)
    except SystemExit as e:
        if e.code:
            return f"{cmd.where()}\n  {err.getvalue().strip().splitlines()[-1]}"
        return None
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    deprecated += [line for line in err.getvalue().splitlines() if "deprecat" in line.lower()]
    if deprecated:
        return f"{cmd.where()}\n  deprecated: {deprecated[0]}"
    return check_config(cmd, args)


def check_config(cmd: Command, args: argparse.Namespace) -> str | None:
    """Resolve a trainer, worker or local train command's configuration as the command would (flag values,
    the TOML file it names, validation); a deprecated spelling fails too, so the docs show the current one.
    A value that holds a shell variable (``"$RUN"``) is the reader's to fill in, so it keeps its default."""
    cls = CONFIGS.get((args.command, getattr(args, "local_command", None)))
    if cls is None:
        return None
    toml = getattr(args, "config", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecatedSetting)
            overrides = {k: v for k, v in overrides_from_args(args, cls).items() if "$" not in str(v)}
            load_config(cls, toml_path=toml and ROOT / toml, overrides=overrides, env={})
    except (ConfigError, DeprecatedSetting) as e:
        missing = re.search(r"no such file: (\S+?);", str(e))
        if missing and _doc_writes(cmd.doc, missing.group(1)):  # a file an earlier block of the doc makes
            return None
        return f"{cmd.where()}\n  {type(e).__name__}: {e}"
    return None


def _doc_writes(doc: str, name: str) -> bool:
    """Whether a block of ``doc`` writes the file ``name`` (``open("name", "w")`` or ``> name``)."""
    text = (ROOT / doc).read_text()
    return f'open("{name}", "w")' in text or f"> {name}" in text


def check(cmd: Command) -> str | None:
    """The problem of one documented command, or None."""
    if cmd.error:
        return f"{cmd.where()}\n  {cmd.error}"
    if not cmd.argv:
        return f"{cmd.where()}\n  no command after stoa"
    if cmd.partial:
        return check_flags(cmd, *resolve(stoa_parser(), cmd.argv))
    return check_parse(cmd)


ALL = [c for path in DOCS for c in doc_commands(path)]


def test_docs_show_commands():
    """The extraction finds the docs' commands (a broken extractor would pass everything)."""
    by_doc = {c.doc for c in ALL}
    assert {"README.md", "docs/fleet.md", "docs/local.md", "docs/watching.md"} <= by_doc
    assert sum(not c.partial for c in ALL) >= 20
    assert any(c.argv[:2] == ["trainer", "--nproc"] for c in ALL if not c.partial)


def test_every_documented_command_parses():
    """Every fenced command parses with stoa's parser; every flag of a synopsis or inline span exists."""
    problems = [p for p in map(check, ALL) if p]
    assert not problems, f"{len(problems)} documented command(s) do not parse:\n" + "\n".join(problems)


@pytest.mark.parametrize("text", ["stoa trainer --bukcet b --run r", "stoa status --bucket b",
                                  "stoa bench fleet --workerz 3", "stoa quickstart --task",
                                  "stoa local train --model tiny --steps three",
                                  "stoa local train --model tiny --group-size 4"])
def test_a_wrong_command_fails(text):
    """A misspelt flag, a missing argument or value, a bad type and a deprecated spelling are each reported with
    the doc line."""
    cmd = Command("docs/x.md", 7, text, shell_words(text)[1:], False)
    problem = check(cmd)
    assert problem is not None and problem.startswith("docs/x.md:7: " + text)


class _Deprecated(argparse.Action):
    """A flag that warns when parsed, as a deprecated alias may."""

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn("--old is deprecated: use --bucket", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def test_a_deprecated_flag_fails_at_parse_time(monkeypatch):
    """A flag whose parsing warns that it is deprecated is reported with the doc line."""
    parser = build_parser()
    status = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["status"]
    status.add_argument("--old", action=_Deprecated)
    monkeypatch.setattr(sys.modules[__name__], "stoa_parser", lambda: parser)
    text = "stoa status --old b --bucket b --run r"
    problem = check(Command("docs/x.md", 2, text, shell_words(text)[1:], False))
    assert problem == f"docs/x.md:2: {text}\n  deprecated: --old is deprecated: use --bucket"


def test_a_wrong_flag_in_a_synopsis_fails():
    """A synopsis (placeholders) checks each flag against the command it names."""
    good = doc_commands_of("`stoa status --bucket B --run R [--watch [SECONDS]]`")
    bad = doc_commands_of("`stoa status --bucket B --run R [--watchh [SECONDS]]`")
    assert check(good[0]) is None
    assert "has no flag --watchh" in (check(bad[0]) or "")
    assert check(doc_commands_of("`stoa bench {trainer,pulse-experts}`")[0]) is None
    assert "has no command pulze" in (check(doc_commands_of("`stoa bench {trainer,pulze}`")[0]) or "")


def doc_commands_of(markdown: str, name: str = "docs/x.md") -> list[Command]:
    """The commands of a Markdown snippet, as ``doc_commands`` finds them in a file."""
    return [c for i, line in enumerate(markdown.splitlines()) for m in INLINE.finditer(line)
            for c in line_commands(name, i + 1, m.group(1), True)]


def test_shell_block_extraction():
    """Continuations, comments, env prefixes, operators, heredocs and block variables, as a shell reads them."""
    block = ['S="--steps 2 --workers 1"', "cat > f <<'EOF'", "stoa not-a-command", "EOF",
             "X=1 stoa quickstart --model tiny \\", "    --task toy $S   # comment", "cd d && stoa status --bucket b "
             "--run r | head", "torchrun --nnodes 2 -m stoa -- trainer --run r"]
    found = shell_block("d.md", block, 10)
    assert [c.argv for c in found] == [["quickstart", "--model", "tiny", "--task", "toy", "--steps", "2",
                                        "--workers", "1"], ["status", "--bucket", "b", "--run", "r"],
                                       ["trainer", "--run", "r"]]
    assert [c.line for c in found] == [14, 16, 17]


@pytest.mark.parametrize("text,needle", RUNS)
def test_cheap_documented_commands_run(text, needle):
    """The cheap commands the docs show run here and print what they promise."""
    assert any(text in p.read_text() for p in DOCS), f"no doc shows {text!r} any more: update RUNS"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "stoa", *shlex.split(text)[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{text}\n{done.stderr[-2000:]}"
    assert needle in done.stdout + done.stderr
