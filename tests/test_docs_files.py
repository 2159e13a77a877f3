"""The TOML blocks of README.md and docs/*.md load as stoa configurations; every relative link resolves."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import NamedTuple

from stoa.config import ConfigError, DeprecatedSetting, LocalConfig, TrainerConfig, WorkerConfig, load_config
from tests.test_docs import DOCS, ROOT

SECTIONS = {"trainer": TrainerConfig, "worker": WorkerConfig, "local": LocalConfig}


class TomlBlock(NamedTuple):
    """A fenced ``toml`` block of a doc: where it starts and its text."""

    doc: str
    line: int
    text: str


def toml_blocks() -> list[TomlBlock]:
    """Every fenced ``toml`` block of README.md and docs/*.md (but a plugin's own ``# pyproject.toml``)."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.rstrip() == "```toml"]
        for i in starts:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if not lines[i + 1].startswith("# pyproject.toml"):  # another tool's file, not a stoa configuration
                found.append(TomlBlock(str(path.relative_to(ROOT)), i + 1, "\n".join(lines[i + 1:end]) + "\n"))
    return found


def check_toml(block: TomlBlock, tmp: Path) -> str | None:
    """Load a doc's TOML block as each command whose section it has would (a flat file as the trainer)."""
    path = tmp / "doc.toml"
    path.write_text(block.text)
    names = [name for name in SECTIONS if re.search(rf"^\[{name}[\].]", block.text, re.MULTILINE)] or ["trainer"]
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecatedSetting)
                load_config(SECTIONS[name], toml_path=path, env={})
        except (ConfigError, DeprecatedSetting) as e:
            return f"{block.doc}:{block.line}: the TOML block, read as [{name}]\n  {type(e).__name__}: {e}"
    return None


def test_every_documented_toml_file_loads(tmp_path):
    """Every ``toml`` block loads as the configuration of each command whose section it has."""
    blocks = toml_blocks()
    assert blocks, "no doc shows a TOML block any more (docs/coming-from-trl.md has one)"
    problems = [p for p in (check_toml(b, tmp_path) for b in blocks) if p]
    assert not problems, "\n".join(problems)


def test_a_wrong_toml_key_fails(tmp_path):
    """A TRL name where stoa's belongs is reported with the doc and line."""
    problem = check_toml(TomlBlock("docs/x.md", 3, '[trainer]\nlearning_rate = 1e-6\n'), tmp_path)
    assert problem is not None and problem.startswith("docs/x.md:3: the TOML block, read as [trainer]")


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced blocks)."""
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def test_every_doc_link_resolves():
    """Every relative link of README.md and docs/*.md names a file that exists and, with #anchor, a heading."""
    problems = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                linked = (path.parent / file).resolve() if file else path
                if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not problems, "links that do not resolve:\n" + "\n".join(problems)
