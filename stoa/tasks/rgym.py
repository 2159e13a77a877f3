"""reasoning-gym as a task: ``--task rg:NAME[,size=...,seed=...,config=key:value]``.

reasoning-gym (``pip install reasoning-gym``) has ~100 procedural generators, each a dataset class whose entry
``i`` is a pure function of (config, seed, i) and a ``score_answer(answer, entry)`` verifier. This adapter maps
``train:i`` (``0 <= i < size``) to entry ``i`` of the generator seeded with ``seed``, and ``test:j`` to the
``j``-th entry of a second generator seeded with ``test_seed`` (default ``seed + 2**31``: most generators draw
entry ``i`` from ``Random(seed + i)``, so a nearby test seed would repeat training entries shifted by one index).
With ``disjoint`` (the default) a held-out entry whose question text is also a training question is skipped, so
the splits share no question; that costs generating the ``size`` training questions once, when the first
held-out prompt is built. Rewards are reasoning-gym's own: the last ``<answer>...</answer>`` of the completion
(``reasoning_gym.utils.extract_answer``) scored by the dataset's ``score_answer``, in [0, 1]; correct means 1.0.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import hashlib
import importlib.metadata
import json
import math
import os
import types
import typing
from typing import Any, ClassVar

import numpy as np

from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    TaskOptionError,
    chat_messages,
    check_prompt_version,
    format_prompt_id,
    parse_prompt_id,
)
from stoa.tasks.extract import EXTRACT_VERSION
from stoa.tasks.extract import extract_answer as final_number

__all__ = ["ReasoningGymTask", "rg_names"]

_SPLITS = ("train", "test")
_PROMPT_VERSION = 1
"""Revision of how ids map to entries and how prompts are worded; part of ``spec()``."""
_REWARD_REV = 1
"""Revision of the reward rule; reasoning-gym's version is appended in ``reward_version``."""
_TEST_SEED_OFFSET = 2**31
_MANAGED = ("seed", "size")
_SEQ_SEP = ";"
"""Separates the items of a list- or tuple-valued config field (``config=words:a;b``): specs cannot hold commas."""
_SCAN_FACTOR = 4
"""A held-out split scans at most this many times ``test_size`` (plus 100) test entries for disjoint ones."""
_EXTRACTS = {"tag": "reasoning-gym's: the last <answer>...</answer>, else no answer",
             "number": "the last <answer>...</answer>, else the completion's final number (stoa's extractor)"}
"""How the answer is read from a completion (the ``extract`` option)."""
_FINGERPRINT_ENTRIES = 4
"""Training entries hashed into ``fingerprint``: enough to tell two machines' generators apart."""
HASH_SEEDED = frozenset({"isomorphic_strings", "polynomial_multiplication", "ransom_note", "word_ladder"})
"""Generators whose entries depend on Python's string hash seed (measured: two processes, PYTHONHASHSEED 1 and 2,
differ within the first 4 entries; the 8 slowest generators were not measured). They need one fixed seed."""
_LIST_HINT = "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'"


def _rg() -> types.ModuleType:
    """The reasoning_gym package, or one line naming the install."""
    try:
        import reasoning_gym
    except ImportError:
        raise TaskOptionError("rg: reasoning-gym is not installed; pip install reasoning-gym") from None
    return reasoning_gym


def rg_version() -> str:
    """The installed reasoning-gym distribution's version (its ``__version__`` can lag behind)."""
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(_rg(), "__version__", "unknown"))


def rg_names() -> list[str]:
    """Every reasoning-gym dataset name installed here."""
    _rg()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _classes(name: str) -> tuple[type, type]:
    """(dataset class, config class) of a reasoning-gym name; ``TaskOptionError`` with close matches."""
    _rg()
    from reasoning_gym.factory import DATASETS

    if not name:
        raise TaskOptionError("rg: option 'dataset' is required: give a reasoning-gym dataset, e.g. rg:leg_counting")
    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise TaskOptionError(f"rg: unknown reasoning-gym dataset {name!r}; {hint}list the {len(DATASETS)} names "
                              f"with: {_LIST_HINT}")
    return DATASETS[name]


def _scalar(kind: Any, text: str) -> object:
    """``text`` as a value of a scalar type (bool, int, float, str, a Literal of those); ValueError otherwise."""
    if typing.get_origin(kind) is typing.Literal:
        allowed = typing.get_args(kind)
        if text not in [str(a) for a in allowed]:
            raise ValueError(f"must be one of {list(allowed)}")
        return next(a for a in allowed if str(a) == text)
    if kind is bool:
        low = text.lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError("must be true or false")
        return low in ("true", "1", "yes")
    if kind in (int, float, str):
        return kind(text)
    raise ValueError(f"has type {getattr(kind, '__name__', kind)}, which a spec cannot set")


def _coerce_field(kind: Any, text: str) -> object:
    """A config field's value from its spec text, by the field's type hint."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if text.lower() == "none":
            return None
        rest = [a for a in args if a is not type(None)]
        return _coerce_field(rest[0], text)
    if kind in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else str
        values = [_scalar(item, t.strip()) for t in text.split(_SEQ_SEP) if t.strip()]
        return tuple(values) if (kind is tuple or origin is tuple) else values
    return _scalar(kind, text)


def _config_kwargs(name: str, config_cls: type, items: tuple[str, ...]) -> dict[str, object]:
    """The generator's config fields from ``config=key:value`` items, coerced to the fields' types."""
    hints = typing.get_type_hints(config_cls)
    valid = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in _MANAGED)
    out: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition(":")
        key = key.strip()
        if not sep or not key:
            raise TaskOptionError(f"rg:{name}: option 'config' must be key:value, got {item!r}; keys: {valid}")
        if key in _MANAGED:
            raise TaskOptionError(f"rg:{name}: give the generator's {key} as the option {key}=, not config={key}:")
        if key not in valid:
            raise TaskOptionError(f"rg:{name}: unknown config key {key!r}; valid keys: {valid}")
        try:
            out[key] = _coerce_field(hints.get(key, str), text.strip())
        except (ValueError, TypeError) as e:
            raise TaskOptionError(f"rg:{name}: config {key}:{text.strip()!r} {e}; fix the value (list items are "
                                  f"separated by '{_SEQ_SEP}')") from None
    return out


class ReasoningGymTask:
    """A reasoning-gym dataset as a task; prompts are ``train:i`` and ``test:j``, rebuilt from the id alone.

    Args:
        dataset: the reasoning-gym dataset name (``rg:leg_counting`` means ``rg:dataset=leg_counting``). Not
            called ``name``: ``get_task(name, **options)`` would take it for the task's name.
        size: training entries (ids ``train:0`` .. ``train:<size-1>``).
        seed: the training generator's seed.
        test_size: held-out entries (ids ``test:0`` .. ``test:<test_size-1>``).
        test_seed: the held-out generator's seed (default ``seed + 2**31``, far from the training indices).
        disjoint: skip held-out entries whose question is also a training question (default true).
        system: the system message: a name of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (``default``, ``direct``,
            ``simple``, ``DeepSeekZero``, ``chain_of_draft``) or literal text; empty for none.
        config: the generator's config fields, ``key:value`` (repeatable; list items separated by ``;``).
        extract: ``tag`` (reasoning-gym's way, the default) or ``number`` (a completion without an answer tag is
            read for its final number: small models that never write tags still get a signal on numeric tasks).
        fingerprint: if given, must equal this machine's digest of the first training entries (``spec()`` has
            it, so a worker whose generator makes other entries refuses with one line).
        prompt_version: if given, must equal this code's prompt version (``spec()`` has it).
    """

    id: str = "rg"
    OPTIONS: ClassVar[dict[str, type]] = {
        "dataset": str, "size": int, "seed": int, "test_size": int, "test_seed": int, "disjoint": bool,
        "system": str, "config": tuple, "extract": str, "fingerprint": str, "prompt_version": int,
    }
    POSITIONAL: ClassVar[str] = "dataset"

    def __init__(self, dataset: str = "", size: int = 5000, seed: int = 0, test_size: int = 500,
                 test_seed: int | None = None, disjoint: bool = True, system: str = "default",
                 config: tuple[str, ...] = (), extract: str = "tag", fingerprint: str = "",
                 prompt_version: int | None = None) -> None:
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        name = dataset
        self._dataset_cls, self._config_cls = _classes(name)
        for option, value, low in (("size", size, 1), ("test_size", test_size, 1), ("seed", seed, 0)):
            if not low <= value < 2**31:
                raise TaskOptionError(f"rg:{name}: option {option!r} must be in [{low}, 2**31), got {value}")
        self.name, self.size, self.seed, self.test_size = name, size, seed, test_size
        self.test_seed = (seed + _TEST_SEED_OFFSET) % 2**32 if test_seed is None else test_seed
        if not 0 <= self.test_seed < 2**32:
            raise TaskOptionError(f"rg:{name}: option 'test_seed' must be in [0, 2**32), got {self.test_seed}")
        self.disjoint, self.system_option, self.config = disjoint, system, tuple(config)
        if extract not in _EXTRACTS:
            raise TaskOptionError(f"rg:{name}: option 'extract' must be one of {list(_EXTRACTS)}, got {extract!r}")
        self.extract = extract
        self.reward_version = f"{_REWARD_REV}.{EXTRACT_VERSION}.rg{rg_version()}"
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.system = SYSTEM_PROMPTS.get(system, system)
        self._kwargs = _config_kwargs(name, self._config_cls, self.config)
        self._make(self.seed, 1)  # validates the config now (one line), builds nothing big
        self._datasets: dict[str, Any] = {}
        self._entries: dict[tuple[str, int], dict[str, Any]] = {}
        self._test_index: list[int] | None = None
        self._fingerprint = ""
        if name in HASH_SEEDED and not os.environ.get("PYTHONHASHSEED", "").isdigit():
            raise TaskOptionError(f"rg:{name}: this generator's entries depend on Python's hash seed, so machines "
                                  "would disagree on them; set PYTHONHASHSEED=0 for the trainer and every worker")
        if fingerprint and fingerprint != self.fingerprint():
            raise TaskOptionError(f"rg:{name}: this machine generates other entries than the run's (fingerprint "
                                  f"{self.fingerprint()} here, {fingerprint} in the run); install the run's "
                                  "reasoning-gym and give every process the same PYTHONHASHSEED")

    def spec(self) -> dict[str, object]:
        """JSON-able options that rebuild this task: ``get_task("rg", **task.spec())``."""
        return {"dataset": self.name, "size": self.size, "seed": self.seed, "test_size": self.test_size,
                "test_seed": self.test_seed, "disjoint": self.disjoint, "system": self.system_option,
                "config": list(self.config), "extract": self.extract, "fingerprint": self.fingerprint(),
                "prompt_version": _PROMPT_VERSION}

    def fingerprint(self) -> str:
        """A digest of the first training entries (question, answer): a worker whose generator differs refuses."""
        if not self._fingerprint:
            h = hashlib.sha256()
            for i in range(min(_FINGERPRINT_ENTRIES, self.size)):
                e = self._raw("train", i)
                h.update(json.dumps([str(e["question"]), str(e.get("answer"))]).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def code_modules(self) -> tuple[str, ...]:
        """The package whose source the rewards depend on (recorded in the run contract)."""
        return ("reasoning_gym",)

    def _make(self, seed: int, size: int) -> Any:
        """A generator with this task's config; ``TaskOptionError`` when reasoning-gym refuses the config."""
        try:
            cfg = self._config_cls(**self._kwargs, seed=seed, size=size)
            return self._dataset_cls(config=cfg)
        except (AssertionError, ValueError, TypeError, KeyError) as e:
            raise TaskOptionError(f"rg:{self.name}: reasoning-gym refuses the config {dict(self._kwargs)} "
                                  f"({type(e).__name__}: {str(e)[:200] or 'a check failed'}); fix the config=key:"
                                  "value options") from None

    def _dataset(self, split: str) -> Any:
        if split not in self._datasets:
            if split == "train":
                self._datasets[split] = self._make(self.seed, self.size)
            else:
                self._datasets[split] = self._make(self.test_seed, _SCAN_FACTOR * self.test_size + 100)
        return self._datasets[split]

    def _raw(self, split: str, index: int) -> dict[str, Any]:
        """Entry ``index`` of a split's generator (cached)."""
        key = (split, index)
        if key not in self._entries:
            self._entries[key] = self._dataset(split)[index]
        return self._entries[key]

    def _held_out_indices(self) -> list[int]:
        """Which test-generator entries ``test:0``, ``test:1``, ... are (skipping training questions)."""
        if self._test_index is None:
            train = ({self._dataset("train")[i]["question"] for i in range(self.size)} if self.disjoint else set())
            out: list[int] = []
            for j in range(_SCAN_FACTOR * self.test_size + 100):
                if len(out) == self.test_size:
                    break
                if self._raw("test", j)["question"] not in train:
                    out.append(j)
            if len(out) < self.test_size:
                raise TaskOptionError(f"rg:{self.name}: only {len(out)} held-out questions are not training "
                                      f"questions; lower test_size or size, or widen the generator's config")
            self._test_index = out
        return self._test_index

    def entry(self, prompt_id: str) -> dict[str, Any]:
        """The reasoning-gym entry (question, answer, metadata) a prompt id names.

        Raises:
            PromptIdError: malformed id, unknown split, or an index past the split's size.
        """
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        limit = self.size if split == "train" else self.test_size
        if index >= limit:
            raise PromptIdError(f"rg:{self.name}: prompt id {prompt_id!r} is past the {split} split's "
                                f"{limit} entries")
        return self._raw(split, index if split == "train" else self._held_out_indices()[index])

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id (``train:i`` for i < size, ``test:j`` for j < test_size)."""
        e = self.entry(prompt_id)
        answer = e.get("answer")
        return Prompt(id=prompt_id, messages=chat_messages(str(e["question"]), self.system),
                      answer="" if answer is None else str(answer))

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A uniformly random training prompt."""
        return self.get(format_prompt_id("train", int(rng.integers(0, self.size))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``min(n, test_size)`` held-out prompts, ``test:0`` onwards."""
        if n < 0:
            raise ValueError(f"rg: heldout n must be >= 0, got {n}")
        return [self.get(format_prompt_id("test", j)) for j in range(min(n, self.test_size))]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """reasoning-gym's score of the completion's last ``<answer>...</answer>``, in [0, 1]; without one, 0
        (``extract=tag``) or the score of its final number (``extract=number``: ``stoa.tasks.extract``)."""
        from reasoning_gym.utils import extract_answer

        e = self.entry(prompt.id)
        split = prompt.id.partition(":")[0]
        answer = extract_answer(completion)
        if answer is None and self.extract == "number":
            answer = final_number(completion)
        score = float(self._dataset(split).score_answer(answer, e))
        if math.isnan(score):
            raise ValueError(f"rg:{self.name}: score_answer returned NaN")
        return min(1.0, max(0.0, score))

    def reference_completion(self, prompt: Prompt) -> str:
        """The reference answer written as a completion should write it (``stoa task`` scores it)."""
        return f"<answer>{prompt.answer}</answer>"

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether reasoning-gym scores the completion 1.0."""
        return self.reward(prompt, completion) == 1.0

    def __repr__(self) -> str:
        return f"ReasoningGymTask({', '.join(f'{k}={v!r}' for k, v in self.spec().items())})"
