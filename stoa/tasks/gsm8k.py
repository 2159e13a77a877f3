"""GSM8K grade-school math task from a local jsonl file or the Hugging Face hub, verified exactly."""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    TaskDataError,
    chat_messages,
    check_prompt_version,
    format_prompt_id,
    parse_prompt_id,
)
from stoa.tasks.extract import EXTRACT_VERSION, answers_match, extract_answer, normalize_number
from stoa.untrusted import loads_bounded

__all__ = ["GSM8KTask", "Problem", "load_hf", "load_jsonl", "parse_gsm8k_answer"]

_SPLITS = ("train", "test")
_REWARD_REV = 1
_PROMPT_VERSION = 1
_DEFAULT_HF = "openai/gsm8k"
MAX_LINE_BYTES = 16 << 20
"""Longest jsonl line read (the data may come from a run's bucket: every line is parsed with bounds)."""
MAX_LINE_DEPTH = 16
"""Deepest JSON nesting of a line (a problem is a flat object)."""
_INSTRUCTIONS = {
    "hashes": "Solve the problem step by step. Then write the final answer as a number on its own line, "
              'as "#### <number>".',
    "boxed": "Solve the problem step by step. Then put the final answer, a number, in \\boxed{}.",
}


@dataclass(frozen=True)
class Problem:
    """One GSM8K item: the question and the canonical final answer."""

    question: str
    answer: str


def parse_gsm8k_answer(answer: str) -> str | None:
    """The canonical number after the last "####" of a GSM8K reference answer, or None.

    Args:
        answer: the dataset's answer field (worked solution ending in "#### <number>").
    """
    _, sep, tail = answer.rpartition("####")
    if not sep:
        return None
    return normalize_number(tail)


def _fingerprint(problems: Iterable[Problem]) -> str:
    """SHA-256 over the canonical problems, equal for the same data from jsonl or the hub."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.question, p.answer], ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def _problems_from_rows(rows: Iterable[tuple[str, Any]], where: str) -> list[Problem]:
    """Validated problems from (location, row) pairs; errors name the location."""
    out: list[Problem] = []
    for loc, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"gsm8k: {where}{loc}: expected a JSON object, got {type(row).__name__}")
        q, a = row.get("question"), row.get("answer")
        if not isinstance(q, str) or not isinstance(a, str):
            raise ValueError(f"gsm8k: {where}{loc}: needs string fields 'question' and 'answer'")
        truth = parse_gsm8k_answer(a)
        if truth is None:
            raise ValueError(f"gsm8k: {where}{loc}: answer does not end in '#### <number>': {a[-80:]!r}")
        out.append(Problem(question=q.strip(), answer=truth))
    return out


def load_jsonl(path: str | Path) -> list[Problem]:
    """GSM8K problems from a jsonl file (one {"question", "answer"} object per line; blank lines skipped).

    Args:
        path: the jsonl file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON or lacks a parseable answer; the message gives the line.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"gsm8k: no such file: {p}")

    def rows() -> Iterable[tuple[str, Any]]:
        with p.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f":{lineno}", loads_bounded(line, max_bytes=MAX_LINE_BYTES, max_depth=MAX_LINE_DEPTH)
                except ValueError as e:  # also too deep, a number too long, NaN or invalid UTF-8
                    raise ValueError(f"gsm8k: {p}:{lineno}: not valid JSON ({str(e)[:200]})") from None

    return _problems_from_rows(rows(), str(p))


def load_hf(dataset: str, config: str, split: str) -> list[Problem]:
    """GSM8K problems from the Hugging Face hub through the optional `datasets` package.

    Args:
        dataset: hub dataset id, e.g. "openai/gsm8k".
        config: dataset config, "main" for the standard GSM8K.
        split: "train" or "test".

    Raises:
        TaskDataError: `datasets` is not installed or the load failed (e.g. no network); the message
            says how to use a local jsonl file instead (a RuntimeError too).
    """
    hint = ("or use a local copy with the task spec 'gsm8k:path=/path/to/train.jsonl' "
            "(test.jsonl beside it becomes the test split)")
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise TaskDataError(
            f"gsm8k: loading {dataset!r} from the Hugging Face hub needs the 'datasets' package "
            f"(pip install 'stoa[datasets]'), {hint}"
        ) from None
    try:
        ds = datasets.load_dataset(dataset, config, split=split)
    except Exception as e:  # the hub raises many kinds (connection, auth, missing config)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TaskDataError(
            f"gsm8k: could not load {dataset!r} ({config}, {split}) from the hub ({first}); {hint}"
        ) from e
    return _problems_from_rows(((f"[{i}]", dict(row)) for i, row in enumerate(ds)), f"{dataset}:{split}")


class GSM8KTask:
    """GSM8K: grade-school math word problems with integer answers, verified exactly.

    Prompt ids are "train:<i>" / "test:<i>", i the 0-based record index in the split's file (blank
    lines skipped) or hub split.

    spec() names the source (the resolved local files, or the hub dataset) and a SHA-256 fingerprint
    and count of each split, and feeding it back (`get_task("gsm8k", **task.spec())`) rebuilds the
    task and checks that the data are the same, so a worker fails closed on a different copy.

    Args:
        path: local train jsonl, or a directory holding train.jsonl (and test.jsonl).
        test_path: local test jsonl; defaults to test.jsonl beside `path` when present.
        hf: hub dataset id (default "openai/gsm8k" when no path is given); needs `datasets`.
        hf_config: hub dataset config (default "main").
        answer_format: "hashes" (finish with "#### <number>", the default) or "boxed" (\\boxed{}).
        system: optional system message (default none).
        prompt_version: if given, must equal this code's prompt version (a check, from spec()).
        n_train: if given, the train split must have this many problems (a check, from spec()).
        n_test: if given, the test split must have this many problems (a check, from spec()).
        train_sha256: if given, the train split's fingerprint must equal it (a check, from spec()).
        test_sha256: if given, the test split's fingerprint must equal it ("" for no test split).
    """

    id: str = "gsm8k"
    reward_version: str = f"{_REWARD_REV}.{EXTRACT_VERSION}"
    OPTIONS: ClassVar[dict[str, type]] = {
        "path": str,
        "test_path": str,
        "hf": str,
        "hf_config": str,
        "answer_format": str,
        "system": str,
        "prompt_version": int,
        "n_train": int,
        "n_test": int,
        "train_sha256": str,
        "test_sha256": str,
    }
    FILE_OPTIONS: ClassVar[tuple[str, ...]] = ("path", "test_path")
    """Options naming local files: the trainer uploads them and the contract names them ``bucket:<sha256>/<name>``
    (``stoa.tasks.data``), so workers elsewhere need no copy."""
    HUB_OPTIONS: ClassVar[tuple[str, ...]] = ("hf",)
    """Options naming a Hugging Face hub dataset: a worker or evaluator accepts only a hub id there
    (``owner/name``), never a local path, which ``datasets`` would read (``stoa.tasks.data.contract_refs``)."""

    def __init__(
        self,
        path: str | None = None,
        test_path: str | None = None,
        hf: str | None = None,
        hf_config: str = "main",
        answer_format: str = "hashes",
        system: str = "",
        prompt_version: int | None = None,
        n_train: int | None = None,
        n_test: int | None = None,
        train_sha256: str | None = None,
        test_sha256: str | None = None,
    ) -> None:
        if answer_format not in _INSTRUCTIONS:
            raise ValueError(
                f"gsm8k: option 'answer_format' must be one of {sorted(_INSTRUCTIONS)}, got {answer_format!r}"
            )
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        if path is not None and hf is not None:
            raise ValueError("gsm8k: give option 'path' (local jsonl) or option 'hf' (hub dataset), not both")
        if test_path is not None and path is None:
            raise ValueError("gsm8k: option 'test_path' needs option 'path' for the train split")
        self.answer_format = answer_format
        self.system = system
        self._source: dict[str, object]
        self.test_source: str | None
        if path is not None:
            train_file = Path(path).expanduser().resolve()
            if train_file.is_dir():
                train_file = train_file / "train.jsonl"
            if not train_file.is_file():
                raise ValueError(f"gsm8k: option 'path': no such file: {train_file}; give a local jsonl file "
                                 "(or a directory holding train.jsonl)")
            test_file: Path | None
            if test_path is not None:
                test_file = Path(test_path).expanduser().resolve()
                if not test_file.is_file():
                    raise ValueError(f"gsm8k: option 'test_path': no such file: {test_file}; give a local jsonl "
                                     "file")
            else:
                beside = train_file.parent / "test.jsonl"
                test_file = beside if beside.is_file() and beside != train_file else None
            self.train: list[Problem] = load_jsonl(train_file)
            self.test: list[Problem] = load_jsonl(test_file) if test_file is not None else []
            self.train_source = str(train_file)
            self.test_source = str(test_file) if test_file is not None else None
            self._source = {"path": self.train_source}
            if self.test_source is not None:
                self._source["test_path"] = self.test_source
        else:
            dataset = hf if hf is not None else _DEFAULT_HF
            self.train = load_hf(dataset, hf_config, "train")
            self.test = load_hf(dataset, hf_config, "test")
            self.train_source = f"hf:{dataset}/{hf_config}/train"
            self.test_source = f"hf:{dataset}/{hf_config}/test"
            self._source = {"hf": dataset, "hf_config": hf_config}
        if not self.train:
            raise ValueError(f"gsm8k: the train split ({self.train_source}) is empty")
        self._train_sha256 = _fingerprint(self.train)
        self._test_sha256 = _fingerprint(self.test) if self.test else ""
        expected = {
            "n_train": n_train,
            "n_test": n_test,
            "train_sha256": train_sha256,
            "test_sha256": test_sha256,
        }
        actual = {
            "n_train": len(self.train),
            "n_test": len(self.test),
            "train_sha256": self._train_sha256,
            "test_sha256": self._test_sha256,
        }
        for name, want in expected.items():
            if want is not None and want != actual[name]:
                raise ValueError(
                    f"gsm8k: option {name!r}: expected {want!r} but the data loaded from "
                    f"{self.train_source} / {self.test_source} give {actual[name]!r}; "
                    "this is a different copy or order of GSM8K than the run was started with"
                )

    def spec(self) -> dict[str, object]:
        """JSON-able description of what determines prompts and rewards; `get_task("gsm8k", **spec)` rebuilds it."""
        return {
            "answer_format": self.answer_format,
            "system": self.system,
            "prompt_version": _PROMPT_VERSION,
            **self._source,
            "n_train": len(self.train),
            "n_test": len(self.test),
            "train_sha256": self._train_sha256,
            "test_sha256": self._test_sha256,
        }

    def _split(self, split: str) -> list[Problem]:
        return self.train if split == "train" else self.test

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id.

        Args:
            prompt_id: "train:<i>" or "test:<i>", i a record index without leading zeros.

        Raises:
            PromptIdError: malformed id, unknown split, or index past the end of the split
                (a ValueError and a KeyError).
        """
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        problems = self._split(split)
        if index >= len(problems):
            source = self.train_source if split == "train" else self.test_source
            raise PromptIdError(
                f"gsm8k: prompt id {prompt_id!r} is out of range: the {split} split has {len(problems)} "
                f"problems ({source or 'no test file found'})"
            )
        p = problems[index]
        user = f"{p.question}\n\n{_INSTRUCTIONS[self.answer_format]}"
        return Prompt(id=prompt_id, messages=chat_messages(user, self.system), answer=p.answer)

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
            ValueError: n < 0, or n > 0 and there is no test split (no test.jsonl beside the train
                file and no `test_path`).
        """
        if n < 0:
            raise ValueError(f"gsm8k: heldout n must be >= 0, got {n}")
        if n and not self.test:
            raise ValueError(
                f"gsm8k: no test split: no test.jsonl beside {self.train_source}; pass option 'test_path'"
            )
        return [self.get(format_prompt_id("test", i)) for i in range(min(n, len(self.test)))]

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the completion's final answer equals the reference number.

        Args:
            prompt: the prompt answered.
            completion: the model's text.
        """
        return answers_match(extract_answer(completion), prompt.answer)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 if the final answer is right, else 0.0.

        Args:
            prompt: the prompt answered.
            completion: the model's text.
        """
        return 1.0 if self.is_correct(prompt, completion) else 0.0

    def __repr__(self) -> str:
        return (f"GSM8KTask(train={self.train_source!r}, test={self.test_source!r}, "
                f"answer_format={self.answer_format!r})")
