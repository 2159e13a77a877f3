"""Your own data and reward functions, TRL-shaped: ``--task dataset:path=FILE,reward=module:fn``.

The data is a jsonl or parquet file (or a directory holding ``train.jsonl`` and ``test.jsonl``, or ``.parquet``;
or ``hf=owner/name``, a hub dataset through the optional ``datasets`` package) with a prompt column (default
``prompt``): a string, or a list of chat messages ``{"role", "content"}`` as TRL's conversational format. An
answer column (default ``answer``, used when present) is optional. Every column but the prompt reaches the reward
functions as keyword lists, as TRL's ``GRPOTrainer`` passes them (``stoa.tasks.rewardfn``), so a TRL reward
function works unchanged.

Rewards: each ``reward=module:fn[*weight]`` (repeatable) is called once per group and the weighted rewards are
summed. Without ``reward=``, the built-in reward is exact match against the answer column: a numeric answer
matches the completion's final number (``stoa.tasks.extract.extract_answer``, as gsm8k: "#### N", \\boxed{N},
"the answer is N", else the last number); any other answer must equal the whole completion, spaces stripped.
A completion is correct (``is_correct``, the held-out accuracy) when its summed reward is at least
``correct_at`` (default 1.0).

Held-out split: ``test_path`` (or ``test.*`` beside a directory's ``train.*``) when given; otherwise the rows
whose prompt text hashes (SHA-256) below ``test_fraction`` (default 0.1) of the range, so a prompt and all its
duplicates fall on one side and the split never changes with the file's order. Prompt ids are "train:<i>" /
"test:<i>", i the row's index within its split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    RewardError,
    TaskOptionError,
    check_prompt_version,
    format_prompt_id,
    parse_prompt_id,
)
from stoa.tasks.extract import EXTRACT_VERSION, answers_match, extract_answer, normalize_number
from stoa.tasks.rewardfn import RewardFn, call_reward, combine, load_reward, probe
from stoa.tasks.scoring import score_group
from stoa.tasks.table import Table, fingerprint, hub_tables, read_table, resolve_files

__all__ = ["DatasetTask", "exact_match"]

_SPLITS = ("train", "test")
_REWARD_REV = 1
_PROMPT_VERSION = 1
_ROLES = ("system", "user", "assistant")


def _messages(value: Any, where: str, column: str) -> tuple[dict[str, str], ...] | None:
    """A conversational prompt's messages, checked; None when ``value`` is plain text."""
    if isinstance(value, str):
        return None
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise TaskOptionError(f"dataset: {where}: column {column!r} must be a string or a list of chat messages "
                              f"{{'role': 'system'|'user'|'assistant', 'content': str}}, got {str(value)[:80]!r}")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _prompt_text(value: Any) -> str:
    """The text a prompt is hashed by for the held-out split."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def _in_test(value: Any, fraction: float) -> bool:
    h = hashlib.sha256(_prompt_text(value).encode()).digest()
    return int.from_bytes(h[:8], "big") < fraction * 2**64


def _answer_text(value: Any) -> str:
    return "" if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def exact_match(completion: str, answer: str) -> bool:
    """The built-in reward's test: numbers by final answer (``extract_answer``), other answers by equality.

    Args:
        completion: the model's text.
        answer: the answer column's value as text.
    """
    if normalize_number(answer) is not None:
        return answers_match(extract_answer(completion), answer)
    return completion.strip() == answer.strip()


class DatasetTask:
    """A jsonl/parquet dataset with TRL-shaped reward functions (module docstring).

    Args:
        path: the train file (jsonl or parquet), or a directory holding ``train.jsonl`` (and ``test.jsonl``).
        test_path: the test file; default ``test.*`` beside a directory's train file, else a hash split.
        hf: a Hugging Face hub dataset id instead of ``path`` (needs ``datasets`` and the network everywhere);
            its ``train`` split, and its ``test`` split when it has one (else a hash split).
        hf_config: the hub dataset's config ("" for its default).
        prompt: the prompt column (default "prompt").
        answer: the answer column; default "answer" when the data has it; "" for none.
        system: a system message put before every prompt (default none).
        reward: ``module:fn`` or ``module:fn*weight`` reward functions (repeatable), summed; none: exact match.
        correct_at: the summed reward at which a completion counts as correct (default 1.0).
        test_fraction: the share of prompts held out when there is no test file (default 0.1).
        prompt_version, n_train, n_test, train_sha256, test_sha256: checks, from ``spec()``.
    """

    id: str = "dataset"
    reward_version: str = f"{_REWARD_REV}.{EXTRACT_VERSION}"
    OPTIONS: ClassVar[dict[str, type]] = {
        "path": str, "test_path": str, "hf": str, "hf_config": str, "prompt": str, "answer": str, "system": str,
        "reward": tuple, "correct_at": float, "test_fraction": float, "prompt_version": int, "n_train": int,
        "n_test": int, "train_sha256": str, "test_sha256": str,
    }
    POSITIONAL: ClassVar[str] = "path"
    """``dataset:problems.jsonl`` means ``dataset:path=problems.jsonl``."""
    FILE_OPTIONS: ClassVar[tuple[str, ...]] = ("path", "test_path")
    """Options naming local files, uploaded by the trainer and named ``bucket:<sha256>/<name>`` in the contract."""
    HUB_OPTIONS: ClassVar[tuple[str, ...]] = ("hf",)
    """Options naming a hub dataset: a worker accepts only a hub id there (``stoa.tasks.data.contract_refs``)."""

    def __init__(self, path: str | None = None, test_path: str | None = None, hf: str | None = None,
                 hf_config: str = "", prompt: str = "prompt", answer: str | None = None, system: str = "",
                 reward: Sequence[str] = (), correct_at: float = 1.0, test_fraction: float = 0.1,
                 prompt_version: int | None = None, n_train: int | None = None, n_test: int | None = None,
                 train_sha256: str | None = None, test_sha256: str | None = None) -> None:
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        if not 0.0 <= test_fraction < 1.0:
            raise TaskOptionError(f"dataset: option 'test_fraction' must be in [0, 1), got {test_fraction}")
        train, test = self._tables(path, test_path, hf, hf_config)
        self.prompt_column = prompt
        self.answer_column = self._answer_column(answer, train)
        self.system, self.correct_at, self.test_fraction = system, correct_at, test_fraction
        for table in (train, test):
            if table is not None:
                self._check_columns(table)
        if test is None:
            self.train = [r for r in train.rows if not _in_test(r[prompt], test_fraction)]
            self.test = [r for r in train.rows if _in_test(r[prompt], test_fraction)]
        else:
            self.train, self.test = train.rows, test.rows
        self.train_source, self.test_source = train.source, test.source if test is not None else None
        if not self.train:
            raise TaskOptionError(f"dataset: the train split of {self.train_source} is empty; add rows or lower "
                                  "test_fraction")
        self._train_sha256 = fingerprint(self.train)
        self._test_sha256 = fingerprint(self.test) if self.test else ""
        self._check_expected(n_train=n_train, n_test=n_test, train_sha256=train_sha256, test_sha256=test_sha256)
        self.reward_specs = tuple(reward)
        self.reward_fns = self._load_rewards(train.columns)

    def _tables(self, path: str | None, test_path: str | None, hf: str | None,
                hf_config: str) -> tuple[Table, Table | None]:
        """The train and test tables from the files or the hub; sets ``_source`` (what ``spec()`` names)."""
        if (path is None) == (hf is None):
            raise TaskOptionError("dataset: give option 'path' (a jsonl or parquet file, or a directory holding "
                                  "train.jsonl) or option 'hf' (a hub dataset id), exactly one")
        if hf is not None:
            if test_path is not None:
                raise TaskOptionError("dataset: option 'test_path' goes with 'path', not with 'hf' (the hub "
                                      "dataset's test split is used when it has one)")
            self._source: dict[str, object] = {"hf": hf, "hf_config": hf_config}
            return hub_tables(hf, hf_config)
        assert path is not None
        files = resolve_files(path, test_path)
        self._source = {"path": str(files.train)}
        if files.test is not None:
            self._source["test_path"] = str(files.test)
        return read_table(files.train), read_table(files.test) if files.test is not None else None

    def _answer_column(self, answer: str | None, train: Table) -> str:
        if answer is None:
            return "answer" if "answer" in train.columns else ""
        if answer and answer not in train.columns:
            raise TaskOptionError(f"dataset: no column {answer!r} (option 'answer') in {train.source}; its columns: "
                                  f"{list(train.columns)}; name the answer column with answer=COL, or answer= for none")
        return answer

    def _check_columns(self, table: Table) -> None:
        """Every row has the prompt column, as a string or chat messages; the answer column is in the file."""
        col = self.prompt_column
        if col not in table.columns:
            raise TaskOptionError(f"dataset: no column {col!r} in {table.source}; its columns: {list(table.columns)};"
                                  " name the prompt column with prompt=COL")
        if self.answer_column and self.answer_column not in table.columns:
            raise TaskOptionError(f"dataset: no column {self.answer_column!r} in {table.source}; its columns: "
                                  f"{list(table.columns)}; give every split the answer column")
        for i, row in enumerate(table.rows):
            if col not in row:
                raise TaskOptionError(f"dataset: {table.source}: row {i} has no column {col!r}; give every row a "
                                      "prompt")
            _messages(row[col], f"{table.source}: row {i}", col)

    def _check_expected(self, **expected: object) -> None:
        actual = {"n_train": len(self.train), "n_test": len(self.test), "train_sha256": self._train_sha256,
                  "test_sha256": self._test_sha256}
        for name, want in expected.items():
            if want is not None and want != actual[name]:
                raise TaskOptionError(f"dataset: option {name!r}: expected {want!r} but {self.train_source} / "
                                      f"{self.test_source} give {actual[name]!r}; this is another copy of the data "
                                      "than the run was started with")

    def _load_rewards(self, columns: Sequence[str]) -> tuple[RewardFn, ...]:
        if not self.reward_specs and not self.answer_column:
            raise TaskOptionError(f"dataset: no reward function and no answer column in {self.train_source}; give "
                                  "reward=module:fn (a TRL reward function), or answer=COL for the built-in exact "
                                  "match")
        offered = ["prompts", "completions", *(c for c in columns if c != self.prompt_column)]
        fns = tuple(load_reward(s, offered) for s in self.reward_specs)
        first = self.train[0]
        for rf in fns:
            probe(rf, first[self.prompt_column], self._columns(first))
        return fns

    def _columns(self, row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k != self.prompt_column}

    def code_modules(self) -> tuple[str, ...]:
        """The modules of the reward functions, recorded in the run contract (``stoa.tasks.code``)."""
        return tuple(dict.fromkeys(rf.module for rf in self.reward_fns))

    def spec(self) -> dict[str, object]:
        """JSON-able description of the data and rewards; ``get_task("dataset", **spec)`` rebuilds and checks it."""
        return {**self._source, "prompt": self.prompt_column, "answer": self.answer_column, "system": self.system,
                "reward": list(self.reward_specs), "correct_at": self.correct_at, "test_fraction": self.test_fraction,
                "prompt_version": _PROMPT_VERSION, "n_train": len(self.train), "n_test": len(self.test),
                "train_sha256": self._train_sha256, "test_sha256": self._test_sha256}

    def _row(self, prompt_id: str) -> dict[str, Any]:
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        rows = self.train if split == "train" else self.test
        if index >= len(rows):
            raise PromptIdError(f"dataset: prompt id {prompt_id!r} is out of range: the {split} split has "
                                f"{len(rows)} rows")
        return rows[index]

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id ("train:<i>" or "test:<i>"); ``PromptIdError`` if malformed or out of range.

        Args:
            prompt_id: the id.
        """
        row = self._row(prompt_id)
        value = row[self.prompt_column]
        messages = _messages(value, prompt_id, self.prompt_column) or ({"role": "user", "content": value},)
        if self.system:
            messages = ({"role": "system", "content": self.system}, *messages)
        answer = _answer_text(row.get(self.answer_column)) if self.answer_column else ""
        return Prompt(id=prompt_id, messages=tuple(messages), answer=answer)

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A uniformly random training prompt.

        Args:
            rng: source of the random index.
        """
        return self.get(format_prompt_id("train", int(rng.integers(0, len(self.train)))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first min(n, size of the test split) test prompts, in file order.

        Args:
            n: how many prompts.

        Raises:
            ValueError: n < 0, or n > 0 and the test split is empty.
        """
        if n < 0:
            raise ValueError(f"dataset: heldout n must be >= 0, got {n}")
        if n and not self.test:
            raise ValueError(f"dataset: the test split of {self.train_source} is empty; give test_path=FILE or a "
                             "test_fraction above 0")
        return [self.get(format_prompt_id("test", i)) for i in range(min(n, len(self.test)))]

    def rewards(self, prompt: Prompt, completions: list[str]) -> Any:
        """The summed, weighted rewards of a group: each reward function called once (or the built-in match).

        What a function returned that is not a number, or the wrong count, is passed on for ``score_group`` to
        name (``stoa.tasks.rewardfn.combine``).

        Args:
            prompt: the group's prompt (its id names the row).
            completions: the completions' text.
        """
        row = self._row(prompt.id)
        if not self.reward_fns:
            return [1.0 if exact_match(c, prompt.answer) else 0.0 for c in completions]
        value, columns = row[self.prompt_column], self._columns(row)
        return combine([(rf, call_reward(rf, value, completions, columns)) for rf in self.reward_fns],
                       len(completions))

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The summed reward of one completion (``rewards`` of a group of one).

        Args:
            prompt: the prompt answered.
            completion: the model's text.
        """
        return float(self.rewards(prompt, [completion])[0])

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the summed reward is at least ``correct_at``; False when the reward code fails (scored through
        ``score_group``, so a raising or hanging function never stops an evaluation).

        Args:
            prompt: the prompt answered.
            completion: the model's text.
        """
        try:
            return score_group(self, prompt, [completion])[0] >= self.correct_at
        except RewardError:
            return False

    def __repr__(self) -> str:
        return f"DatasetTask(train={self.train_source!r}, test={self.test_source!r}, reward={self.reward_specs!r})"
