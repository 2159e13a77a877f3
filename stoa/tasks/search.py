"""Search agents in Search-R1's format, and the built-in seeded ``search`` task (no download).

The model reasons, calls ``<search> query </search>``, reads ``<information> ... </information>`` and answers
``<answer> ... </answer>``; a turn ends at ``</search>`` or ``</answer>``. The reward is EM or cover-EM of the
last answer span of the episode text (``stoa.tasks.qa``), and 0 for an episode whose own turns hold
``<information>`` markup (``OBSERVATION_MARKUP``): an answer after a document the policy wrote itself earns
nothing, whatever the document says. ``SearchTaskBase`` holds what every search task
shares (options, environment, tools, reward); ``SearchTask`` is the built-in task over a generated world of
invented entities (``stoa.tasks.world``), whose answers no model knows without searching.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from stoa.envs.base import Observation, ToolResult, Tools, result_hash
from stoa.retrieval import SearchTools
from stoa.retrieval.base import Doc, Searcher
from stoa.rollouts.episode import ROLE_ECHO, ROLE_MASKED, ToolCall
from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    chat_messages,
    check_prompt_version,
    format_prompt_id,
    parse_prompt_id,
)
from stoa.tasks.demos import Demo
from stoa.tasks.multiturn import LIMIT_OPTIONS, limits_spec, task_limits
from stoa.tasks.qa import (
    QA_VERSION,
    QAScore,
    check_reward_kind,
    decode_golds,
    encode_golds,
    extract_final_answer,
    score,
)
from stoa.tasks.world import World, build_world

__all__ = ["INSTRUCTIONS", "OBSERVATION_MARKUP", "SEARCH_OPTIONS", "SearchEnv", "SearchTask", "SearchTaskBase",
           "search_messages", "wrote_observation"]

INSTRUCTIONS = (
    "Answer the question. To look something up, write <search> your query </search> and the results will "
    "appear between <information> and </information>. You can search more than once. When you know the "
    "answer, write <answer> your answer </answer>."
)
"""Search-R1's protocol, told briefly enough for a small model."""

SEARCH_OPTIONS: dict[str, type] = {
    "reward": str, "topk": int, "max_doc_chars": int, "index": str, "system": str, "shots": int,
    "format_reward": float, **LIMIT_OPTIONS,
}
"""Options every search task declares."""

_OPEN, _CLOSE = "<search>", "</search>"
OBSERVATION_MARKUP = ("<information>", "</information>")
"""The tags only observations hold: an episode whose own turns hold either scores 0 (EM, cover-EM, format)."""
_SPLITS = ("train", "test")
_REWARD_REV = 2
"""2: an episode whose own turns hold ``OBSERVATION_MARKUP`` scores 0."""
_PROMPT_VERSION = 2
"""Revision of the built-in task's prompts; bumped with ``INSTRUCTIONS`` and with ``world.WORLD_VERSION``."""
_CACHE: dict[tuple[int, int, int], World] = {}


EXAMPLE_QUESTION = "Where was Tom Brant born?"
EXAMPLE_EPISODE = ("<search> Tom Brant born </search>\n\n<information>Doc 1(Title: Tom Brant) Tom Brant is a painter. "
                   "He was born in Kelso.\n</information>\n\n<answer> Kelso </answer>")
"""The worked example of ``shots=1``: an invented person outside every corpus (no number, so no year answer
can leak), one search, one answer."""


def search_messages(question: str, system: str = "", shots: int = 1) -> tuple[dict[str, str], ...]:
    """The chat prompt of a question: the instructions, then (``shots=1``) a worked example as an earlier
    exchange, then the question.

    A 135M instruct model never writes ``<search>`` from the instructions alone (0 of 48 episodes of
    SmolLM2-135M-Instruct); after one worked exchange it searches in about a third of them, which gives RL a
    signal to grow (measured in docs/search.md).

    Args:
        question: the question.
        system: an optional system message.
        shots: 0 (Search-R1's zero-shot prompt) or 1 (one worked example first).
    """
    if shots == 0:
        return chat_messages(f"{INSTRUCTIONS}\n\nQuestion: {question.strip()}", system)
    head = ({"role": "system", "content": system},) if system else ()
    return (*head, {"role": "user", "content": f"{INSTRUCTIONS}\n\nQuestion: {EXAMPLE_QUESTION}"},
            {"role": "assistant", "content": EXAMPLE_EPISODE},
            {"role": "user", "content": f"Question: {question.strip()}"})


class SearchEnv:
    """One Search-R1 episode: parse ``<search>`` calls, show results as ``<information>``.

    The state key starts at ``"start"`` and becomes ``result_hash([previous, result.digest])`` after each
    observation, so two turns share a key exactly when they saw the same results in the same order.
    """

    stop_strings: tuple[str, ...] = ("</search>", "</answer>")

    def __init__(self) -> None:
        self.state = "start"

    def initial_state(self) -> str:
        """The key before the first turn."""
        return "start"

    def parse(self, turn_text: str) -> ToolCall | None:
        """The turn's search call: None when it gives an ``<answer>`` or has no (non-empty) complete query.

        The query is the text between the last ``</search>`` and the ``<search>`` before it, stripped.

        Args:
            turn_text: the decoded turn.
        """
        if "<answer>" in turn_text:
            return None
        end = turn_text.rfind(_CLOSE)
        start = turn_text.rfind(_OPEN, 0, end) if end >= 0 else -1
        if start < 0:
            return None
        query = turn_text[start + len(_OPEN) : end].strip()
        return ToolCall("search", query) if query else None

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        """The results between ``<information>`` tags (the documents' text is echo, the tags masked).

        Args:
            call: the search call.
            result: the rendered documents.
        """
        self.state = result_hash([self.state, result.digest])
        segments = (("\n\n<information>", ROLE_MASKED), (result.text, ROLE_ECHO),
                    ("</information>\n\n", ROLE_MASKED))
        return Observation(segments=segments, state=self.state)


class SearchTaskBase:
    """What every search task shares: the options of ``SEARCH_OPTIONS``, the env, the tools and the reward.

    Args:
        reward: ``cover_em`` (default) or ``em``; ``is_correct`` uses the same metric.
        topk: documents per search.
        max_doc_chars: characters of each document shown.
        index: the retriever index fingerprint the run searches ("" = not pinned); ``make_tools`` refuses
            a searcher with another fingerprint.
        system: an optional system message.
        shots: worked examples before the question: 1 (default) or 0 (Search-R1's zero-shot prompt).
        format_reward: reward of a wrong answer given in the protocol's form (at least one ``<search>`` call,
            then an ``<answer>`` span), in [0, 1); 0 (default) rewards correct answers only. A small model that
            never completes the protocol gets no signal without it.
        max_turns: model turns per episode.
        max_obs_tokens: tokens of one observation.
        max_total_tokens: tokens after the prompt.
    """

    id: str = "search"
    tool_kind: str = "search"
    reward_version: str = f"{_REWARD_REV}.{QA_VERSION}"

    def _init_search(self, reward: str = "cover_em", topk: int = 3, max_doc_chars: int = 480, index: str = "",
                     system: str = "", shots: int = 1, format_reward: float = 0.0, max_turns: int = 4,
                     max_obs_tokens: int = 512, max_total_tokens: int = 1024) -> None:
        self.reward_kind = check_reward_kind(self.id, reward)
        for name, value in (("topk", topk), ("max_doc_chars", max_doc_chars)):
            if value < 1:
                raise ValueError(f"{self.id}: option {name!r} must be >= 1, got {value}")
        if shots not in (0, 1):
            raise ValueError(f"{self.id}: option 'shots' must be 0 or 1, got {shots}")
        self.topk, self.max_doc_chars, self.index, self.system = topk, max_doc_chars, index, system
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"{self.id}: option 'format_reward' must be in [0, 1), got {format_reward}")
        self.shots, self.format_reward = shots, float(format_reward)
        self.limits = task_limits(self.id, max_turns, max_obs_tokens, max_total_tokens)

    def _search_spec(self) -> dict[str, object]:
        out: dict[str, object] = {"reward": self.reward_kind, "topk": self.topk,
                                  "max_doc_chars": self.max_doc_chars, "system": self.system, "shots": self.shots,
                                  "format_reward": self.format_reward,
                                  **limits_spec(self.limits)}
        if self.index:
            out["index"] = self.index
        return out

    def make_env(self, prompt: Prompt, seed: int) -> SearchEnv:
        """A fresh Search-R1 environment (the same for every prompt and seed).

        Args:
            prompt: the prompt.
            seed: the episode's seed (unused: search is deterministic).
        """
        return SearchEnv()

    def make_tools(self, searcher: Searcher | None) -> Tools:
        """The ``search`` tool over ``searcher`` (``stoa.retrieval.SearchTools``, ``topk`` and ``max_doc_chars``).

        Args:
            searcher: the retriever.

        Raises:
            ValueError: no searcher, or one whose fingerprint differs from the ``index`` option.
        """
        if searcher is None:
            raise ValueError(f"{self.id}: the search tool needs a retriever; give an index "
                             "(stoa retriever index CORPUS.jsonl DIR) or a --retriever URL")
        if self.index and searcher.fingerprint != self.index:
            raise ValueError(f"{self.id}: option 'index' is {self.index!r} but the retriever serves "
                             f"{searcher.fingerprint!r}; use the index the run was started with")

        return SearchTools(searcher, k=self.topk, max_doc_chars=self.max_doc_chars)

    def score(self, prompt: Prompt, completion: str) -> QAScore:
        """EM and cover-EM of the episode text's last ``<answer>`` span.

        An episode text holding ``OBSERVATION_MARKUP`` scores 0 on both: the policy wrote a document itself.

        Args:
            prompt: the prompt (its answer holds the gold answers).
            completion: the episode text (the policy's turns only).
        """
        if wrote_observation(completion):
            return QAScore(extract_final_answer(completion), False, False)
        return score(completion, decode_golds(prompt.answer))

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 if the final answer matches by the ``reward`` metric; else ``format_reward`` when the episode
        searched and then answered in the protocol's form; else 0.0. Always 0.0 when the policy's own turns hold
        ``OBSERVATION_MARKUP``.

        Args:
            prompt: the prompt.
            completion: the episode text.
        """
        r = self.score(prompt, completion).reward(self.reward_kind)
        if r < 1.0 and self.format_reward > 0 and _searched_then_answered(completion) and not wrote_observation(
                completion):
            return self.format_reward
        return r

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the final answer matches by the ``reward`` metric (a format reward is never correct).

        Args:
            prompt: the prompt.
            completion: the episode text.
        """
        return self.score(prompt, completion).reward(self.reward_kind) == 1.0


def wrote_observation(text: str) -> bool:
    """Whether the policy's own text holds observation markup (``OBSERVATION_MARKUP``).

    Args:
        text: the episode text (the policy's turns only, ``stoa.envs.episode_text``).
    """
    return any(tag in text for tag in OBSERVATION_MARKUP)


def _searched_then_answered(text: str) -> bool:
    """Whether an episode text holds a complete ``<search>`` call before its last ``<answer>`` span."""
    if extract_final_answer(text) is None:
        return False
    call = text.find(_CLOSE)
    return text.find(_OPEN) >= 0 and 0 <= call < text.rfind("<answer>")


class SearchTask(SearchTaskBase):
    """The built-in search task: questions about invented entities, answered from a generated corpus.

    Prompt ids are "train:<i>" / "test:<i>" into the world's shuffled question lists; the held-out questions
    are about held-out entities only. ``corpus()`` yields the documents to index. ``spec()`` records the
    seed, the sizes (checked when given back), the reward and the limits.

    Args:
        seed: the world's seed.
        entities: about how many entities the world has (>= 20).
        hops: 1 (every answer is on the subject's own page) or 2 (also questions through a second entity: the
            founder's birth year, the capital's river, ...; ``stoa.tasks.world``), which a model answers with two
            searches.
        n_docs: if given, the corpus must have this many documents (a check, from spec()).
        n_train: if given, the train split must have this many questions (a check, from spec()).
        n_test: if given, the test split must have this many questions (a check, from spec()).
        prompt_version: if given, must equal this code's prompt version (a check, from spec()).
        **search: the options of ``SearchTaskBase``.
    """

    id: str = "search"
    OPTIONS: ClassVar[dict[str, type]] = {"seed": int, "entities": int, "hops": int, "n_docs": int, "n_train": int,
                                          "n_test": int, "prompt_version": int, **SEARCH_OPTIONS}

    def __init__(self, seed: int = 0, entities: int = 1000, hops: int = 1, n_docs: int | None = None,
                 n_train: int | None = None, n_test: int | None = None, prompt_version: int | None = None,
                 **search: Any) -> None:
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        if not 0 <= seed < 2**63:
            raise ValueError(f"search: option 'seed' must be in [0, 2**63), got {seed}")
        if not 20 <= entities <= 200_000:
            raise ValueError(f"search: option 'entities' must be in [20, 200000], got {entities}")
        if hops not in (1, 2):
            raise ValueError(f"search: option 'hops' must be 1 or 2, got {hops}")
        self._init_search(**search)
        self.seed, self.entities, self.hops = seed, entities, hops
        key = (seed, entities, hops)
        if key not in _CACHE:
            _CACHE[key] = build_world(seed, entities, hops)
        self.world = _CACHE[key]
        actual = {"n_docs": len(self.world.docs), "n_train": len(self.world.train), "n_test": len(self.world.test)}
        for name, want in (("n_docs", n_docs), ("n_train", n_train), ("n_test", n_test)):
            if want is not None and want != actual[name]:
                raise ValueError(f"search: option {name!r} is {want} but this code generates {actual[name]} for "
                                 f"seed={seed}, entities={entities}; use the stoa version the run was started with")

    def spec(self) -> dict[str, object]:
        """JSON-able options that rebuild this task (``get_task("search", **spec)``), sizes included."""
        hops = {"hops": self.hops} if self.hops != 1 else {}  # one-hop runs keep the spec they always had
        return {"seed": self.seed, "entities": self.entities, **hops, "n_docs": len(self.world.docs),
                "n_train": len(self.world.train), "n_test": len(self.world.test),
                "prompt_version": _PROMPT_VERSION, **self._search_spec()}

    def corpus(self) -> Iterator[Doc]:
        """The generated documents, in a fixed order."""
        return iter(self.world.docs)

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id.

        Args:
            prompt_id: "train:<i>" or "test:<i>".

        Raises:
            PromptIdError: malformed id, unknown split or index past the split's end.
        """
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        questions = self.world.train if split == "train" else self.world.test
        if index >= len(questions):
            raise PromptIdError(f"search: prompt id {prompt_id!r} is out of range: the {split} split has "
                                f"{len(questions)} questions")
        q = questions[index]
        return Prompt(id=prompt_id, messages=search_messages(q.text, self.system, self.shots),
                      answer=encode_golds(q.golds))

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A uniformly random training question.

        Args:
            rng: source of the index.
        """
        return self.get(format_prompt_id("train", int(rng.integers(0, len(self.world.train)))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first min(n, size of the test split) held-out questions.

        Args:
            n: how many.
        """
        if n < 0:
            raise ValueError(f"search: heldout n must be >= 0, got {n}")
        return [self.get(format_prompt_id("test", i)) for i in range(min(n, len(self.world.test)))]

    def prompt_kind(self, prompt: Prompt) -> str:
        """``1hop`` or ``2hop``: how many searches the question needs (evaluations report cover-EM per kind).

        Args:
            prompt: a prompt of this task.
        """
        split, index = parse_prompt_id(self.id, prompt.id, _SPLITS)
        return "2hop" if (self.world.train if split == "train" else self.world.test)[index].steps else "1hop"

    def demonstrations(self, n: int, rng: np.random.Generator) -> list[Demo]:
        """``n`` demonstrations of the protocol on random training questions: search with the question (a
        two-hop question: with each of its sub-questions in turn), then answer with the first gold answer. The
        trainer keeps one only when a document it retrieves holds that answer (``Demo.evidence``).

        Args:
            n: how many.
            rng: source of the questions.
        """
        out = []
        for i in rng.integers(0, len(self.world.train), size=n):
            q = self.world.train[int(i)]
            prompt = self.get(format_prompt_id("train", int(i)))
            searches = tuple(f"{_OPEN} {query.strip()} {_CLOSE}" for query in (q.steps or (q.text,)))
            out.append(Demo(prompt, (*searches, f"<answer> {q.golds[0]} </answer>"), evidence=q.golds[0]))
        return out

    def __repr__(self) -> str:
        return f"SearchTask(seed={self.seed}, entities={self.entities}, hops={self.hops}, reward={self.reward_kind!r})"
