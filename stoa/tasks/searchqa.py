"""Search-R1 / PaperSearchQA question answering from local files (jsonl or parquet), with a corpus jsonl.

Accepted row layouts (one JSON object per jsonl line, or one parquet row):

- ``question`` (str) and ``golden_answers`` (a list of str, or one str): the prompt is built from the
  question with ``stoa.tasks.search.INSTRUCTIONS``;
- Search-R1's parquet layout: ``prompt`` (a list of chat messages ``{"role", "content"}``, used as they are
  when there is no ``question``) and ``reward_model.ground_truth.target`` (a list of str, or one str) when
  there is no ``golden_answers``. Other columns (``data_source``, ``extra_info``, ...) are ignored.

A row without a question (or prompt) or without a non-empty answer is refused, naming the file and the line
(jsonl, 1-based) or row (parquet, 0-based). Parquet needs ``pyarrow`` (imported only for parquet files). The
corpus file (``corpus=``) is read with ``stoa.retrieval.read_corpus`` (``id``, ``title``, ``text`` or Search-R1's
``contents``); a line without an id or a text is refused there, naming the line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stoa.retrieval import read_corpus
from stoa.retrieval.base import Doc
from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    check_prompt_version,
    format_prompt_id,
    parse_prompt_id,
)
from stoa.tasks.qa import encode_golds
from stoa.tasks.search import SEARCH_OPTIONS, SearchTaskBase, search_messages
from stoa.tasks.table import jsonl_rows, parquet_rows

__all__ = ["QAItem", "SearchQATask", "load_qa"]

_SPLITS = ("train", "test")
_PROMPT_VERSION = 1
MAX_LINE_BYTES = 64 << 20
"""Longest jsonl line read (the data may come from a run's bucket: every line is parsed with bounds)."""
MAX_LINE_DEPTH = 32
"""Deepest JSON nesting of a line (Search-R1 rows nest ``reward_model.ground_truth.target`` a few deep)."""


@dataclass(frozen=True)
class QAItem:
    """One question: its chat messages and gold answers."""

    messages: tuple[dict[str, str], ...]
    golds: tuple[str, ...]


def _golds(row: dict[str, Any]) -> tuple[str, ...] | None:
    value = row.get("golden_answers")
    if value is None:
        rm = row.get("reward_model")
        gt = rm.get("ground_truth") if isinstance(rm, dict) else None
        value = gt.get("target") if isinstance(gt, dict) else row.get("reward_model.ground_truth.target")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        return None
    golds = tuple(v for v in value if v.strip())
    return golds or None


def _chat(prompt: object) -> tuple[dict[str, str], ...] | None:
    """Search-R1's ``prompt`` column as chat messages, or None when it is not a list of them."""
    if not isinstance(prompt, list | tuple) or not prompt:
        return None
    out: list[dict[str, str]] = []
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _messages(row: dict[str, Any], system: str, use_prompt: bool, shots: int) -> tuple[dict[str, str], ...] | None:
    chat = _chat(row.get("prompt"))
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        return chat
    return chat if chat is not None and use_prompt else search_messages(question, system, shots)


def _items(rows: Iterable[tuple[str, Any]], system: str, use_prompt: bool, shots: int) -> list[QAItem]:
    out: list[QAItem] = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"searchqa: {where}: expected an object with 'question' and 'golden_answers', "
                             f"got {type(row).__name__}")
        messages = _messages(row, system, use_prompt, shots)
        if messages is None:
            raise ValueError(f"searchqa: {where}: no question: give 'question' (a string) or 'prompt' "
                             "(a list of chat messages)")
        golds = _golds(row)
        if golds is None:
            raise ValueError(f"searchqa: {where}: no answers: give 'golden_answers' (a list of strings) or "
                             "'reward_model.ground_truth.target'")
        out.append(QAItem(messages=messages, golds=golds))
    return out


def load_qa(path: str | Path, system: str = "", use_prompt: bool = False, shots: int = 1) -> list[QAItem]:
    """The questions of a jsonl or parquet file (parquet when the name ends in ``.parquet``).

    Args:
        path: the file.
        system: an optional system message for prompts built from ``question``.
        use_prompt: use a row's ``prompt`` chat messages as they are even when it has a ``question``.
        shots: worked examples before the question (``stoa.tasks.search.search_messages``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a bad line or row (named).
        TaskDataError: a parquet file without pyarrow installed (a RuntimeError too).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"searchqa: no such file: {p}")
    rows = (parquet_rows(p, "searchqa") if p.suffix == ".parquet"
            else jsonl_rows(p, "searchqa", MAX_LINE_BYTES, MAX_LINE_DEPTH))
    return _items(rows, system, use_prompt, shots)


def _fingerprint(items: Iterable[QAItem]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([list(it.messages), list(it.golds)], ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def _file_option(name: str, value: str) -> Path:
    p = Path(value).expanduser().resolve()
    if not p.is_file():
        raise ValueError(f"searchqa: option {name!r}: no such file: {p}; give a local jsonl (or parquet) file")
    return p


class SearchQATask(SearchTaskBase):
    """Search-R1 / PaperSearchQA data from local files, with Search-R1's episode format and EM/cover-EM.

    Prompt ids are "train:<i>" / "test:<i>", i the 0-based row index (blank jsonl lines skipped). ``spec()``
    names the files and each split's size and SHA-256, and the checks fail closed on another copy.

    Args:
        path: the train questions (jsonl or parquet).
        test_path: the held-out questions (jsonl or parquet); none means no held-out split.
        corpus: the corpus jsonl (``corpus()`` reads it; the retriever's index is built from it).
        use_prompt: use each row's Search-R1 ``prompt`` messages verbatim even when it has a ``question``
            (default: build the prompt from ``question``; rows with only ``prompt`` use it anyway).
        n_train: if given, the train split must have this many questions (a check, from spec()).
        n_test: if given, the test split must have this many questions (a check, from spec()).
        train_sha256: if given, the train split's fingerprint must equal it (a check, from spec()).
        test_sha256: if given, the test split's fingerprint must equal it ("" for none).
        prompt_version: if given, must equal this code's prompt version (a check, from spec()).
        **search: the options of ``stoa.tasks.search.SearchTaskBase``.
    """

    id: str = "searchqa"
    OPTIONS: ClassVar[dict[str, type]] = {"path": str, "test_path": str, "corpus": str, "n_train": int,
                                          "n_test": int, "train_sha256": str, "test_sha256": str,
                                          "prompt_version": int, "use_prompt": bool, **SEARCH_OPTIONS}
    FILE_OPTIONS: ClassVar[tuple[str, ...]] = ("path", "test_path", "corpus")
    """Options naming local files: the trainer uploads them and the contract names them ``bucket:<sha256>/<name>``
    (``stoa.tasks.data``), so workers elsewhere need no copy."""

    def __init__(self, path: str | None = None, test_path: str | None = None, corpus: str | None = None,
                 n_train: int | None = None, n_test: int | None = None, train_sha256: str | None = None,
                 test_sha256: str | None = None, prompt_version: int | None = None, use_prompt: bool = False,
                 **search: Any) -> None:
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        if path is None:
            raise ValueError("searchqa: option 'path' is required: the questions file (jsonl or parquet), "
                             "e.g. searchqa:path=train.parquet,test_path=test.parquet,corpus=corpus.jsonl")
        self._init_search(**search)
        self.path = _file_option("path", path)
        self.test_path = _file_option("test_path", test_path) if test_path else None
        self.corpus_path = _file_option("corpus", corpus) if corpus else None
        self.use_prompt = use_prompt
        self.train = load_qa(self.path, self.system, use_prompt, self.shots)
        self.test = load_qa(self.test_path, self.system, use_prompt, self.shots) if self.test_path else []
        if not self.train:
            raise ValueError(f"searchqa: option 'path': {self.path} holds no questions")
        actual = {"n_train": len(self.train), "n_test": len(self.test), "train_sha256": _fingerprint(self.train),
                  "test_sha256": _fingerprint(self.test) if self.test else ""}
        expected = {"n_train": n_train, "n_test": n_test, "train_sha256": train_sha256, "test_sha256": test_sha256}
        for name, want in expected.items():
            if want is not None and want != actual[name]:
                raise ValueError(f"searchqa: option {name!r}: expected {want!r} but {self.path} / {self.test_path} "
                                 f"give {actual[name]!r}; this is another copy of the data than the run's")
        self._checks = actual

    def spec(self) -> dict[str, object]:
        """JSON-able options that rebuild this task (``get_task("searchqa", **spec)``), with its data checks."""
        files: dict[str, object] = {"path": str(self.path)}
        if self.test_path is not None:
            files["test_path"] = str(self.test_path)
        if self.corpus_path is not None:
            files["corpus"] = str(self.corpus_path)
        return {**files, **self._checks, "prompt_version": _PROMPT_VERSION, "use_prompt": self.use_prompt,
                **self._search_spec()}

    def corpus(self) -> Iterator[Doc]:
        """The corpus documents (``stoa.retrieval.read_corpus``).

        Raises:
            ValueError: no ``corpus`` option.
            stoa.retrieval.CorpusError: a line without an id or a text (names the line).
        """
        if self.corpus_path is None:
            raise ValueError("searchqa: no corpus: give option 'corpus' (a jsonl of id, title, text/contents)")

        return read_corpus(self.corpus_path)

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id.

        Args:
            prompt_id: "train:<i>" or "test:<i>".

        Raises:
            PromptIdError: malformed id, unknown split, or an index past the split's end.
        """
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        items = self.train if split == "train" else self.test
        if index >= len(items):
            raise PromptIdError(f"searchqa: prompt id {prompt_id!r} is out of range: the {split} split has "
                                f"{len(items)} questions ({self.path if split == 'train' else self.test_path})")
        item = items[index]
        return Prompt(id=prompt_id, messages=item.messages, answer=encode_golds(item.golds))

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A uniformly random training question.

        Args:
            rng: source of the index.
        """
        return self.get(format_prompt_id("train", int(rng.integers(0, len(self.train)))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first min(n, size of the test split) held-out questions, in file order.

        Args:
            n: how many.

        Raises:
            ValueError: n < 0, or n > 0 without a test split.
        """
        if n < 0:
            raise ValueError(f"searchqa: heldout n must be >= 0, got {n}")
        if n and not self.test:
            raise ValueError("searchqa: no held-out split: give option 'test_path'")
        return [self.get(format_prompt_id("test", i)) for i in range(min(n, len(self.test)))]

    def __repr__(self) -> str:
        return f"SearchQATask(path={str(self.path)!r}, test_path={self.test_path!r}, reward={self.reward_kind!r})"
