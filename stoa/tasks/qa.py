"""Question answering rewards of search agents: the final answer span, Search-R1's normalisation, EM and cover-EM.

The rules, written down (they are the reward; changing one changes ``QA_VERSION``):

- **Answer**: the text of the LAST ``<answer>...</answer>`` span of the text the reward is given, stripped of
  surrounding whitespace; no complete span means no answer (score 0). Rewards are given the episode text
  (``stoa.envs.episode_text``: the policy's own turns only), so an ``<answer>`` in the prompt or in an
  observation never counts.
- **Normalisation** (Search-R1's ``normalize_answer``, itself SQuAD's): lowercase; remove every ASCII punctuation
  character (``string.punctuation``); replace the articles ``a``, ``an``, ``the`` (whole words) by a space;
  collapse runs of whitespace to one space and strip the ends.
- **EM**: the normalised answer equals a normalised gold answer.
- **Cover-EM** (Search-R1's ``subem_check``): a normalised gold answer occurs as a substring of the normalised
  answer (so "Tarsk, in Velmoria" covers the gold "Tarsk").
- A gold answer that normalises to the empty string is ignored, and an answer that normalises to the empty
  string scores 0 (otherwise "the" would match everything under cover-EM).

Gold answers travel in ``Prompt.answer`` as a JSON list of strings (``encode_golds``/``decode_golds``).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "QA_VERSION",
    "REWARD_KINDS",
    "QAScore",
    "check_reward_kind",
    "cover_em",
    "decode_golds",
    "em",
    "encode_golds",
    "extract_final_answer",
    "normalize_answer",
    "score",
]

QA_VERSION = 1
"""Bump when extraction, normalisation, EM or cover-EM can give another result for some input."""

REWARD_KINDS = ("cover_em", "em")
"""The reward options of QA tasks: ``cover_em`` (the default) or ``em``."""

_OPEN, _CLOSE = "<answer>", "</answer>"
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def extract_final_answer(text: str) -> str | None:
    """The stripped content of the last complete ``<answer>...</answer>`` span, or None.

    Args:
        text: the episode text (the policy's turns only).
    """
    end = text.rfind(_CLOSE)
    while end >= 0:
        start = text.rfind(_OPEN, 0, end)
        if start >= 0:
            return text[start + len(_OPEN) : end].strip()
        end = text.rfind(_CLOSE, 0, end)
    return None


def normalize_answer(s: str) -> str:
    """Search-R1's normalisation: lowercase, drop ASCII punctuation, drop articles, collapse whitespace.

    Args:
        s: an answer or a gold answer.
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _normalized_golds(golds: Sequence[str] | str) -> list[str]:
    if isinstance(golds, str):
        golds = [golds]
    return [g for g in (normalize_answer(x) for x in golds) if g]


def em(pred: str | None, golds: Sequence[str] | str) -> bool:
    """Exact match: the normalised prediction equals a normalised gold answer.

    Args:
        pred: the extracted answer (None: no answer).
        golds: the gold answers (a string is one answer).
    """
    p = normalize_answer(pred) if pred is not None else ""
    return bool(p) and p in _normalized_golds(golds)


def cover_em(pred: str | None, golds: Sequence[str] | str) -> bool:
    """Cover exact match: a normalised gold answer occurs in the normalised prediction.

    Args:
        pred: the extracted answer (None: no answer).
        golds: the gold answers (a string is one answer).
    """
    p = normalize_answer(pred) if pred is not None else ""
    return bool(p) and any(g in p for g in _normalized_golds(golds))


@dataclass(frozen=True)
class QAScore:
    """Both metrics of one episode."""

    answer: str | None
    """The extracted final answer (None: no complete ``<answer>`` span)."""
    em: bool
    """Exact match."""
    cover_em: bool
    """Cover exact match."""

    def reward(self, kind: str) -> float:
        """1.0 or 0.0 by the metric ``kind`` names.

        Args:
            kind: ``cover_em`` or ``em``.
        """
        return 1.0 if (self.em if kind == "em" else self.cover_em) else 0.0


def score(text: str, golds: Sequence[str] | str) -> QAScore:
    """EM and cover-EM of the last answer span of ``text`` against the gold answers.

    Args:
        text: the episode text the reward reads.
        golds: the gold answers.
    """
    pred = extract_final_answer(text)
    return QAScore(answer=pred, em=em(pred, golds), cover_em=cover_em(pred, golds))


def check_reward_kind(task_id: str, kind: str) -> str:
    """The reward kind, checked.

    Args:
        task_id: the task, for the message.
        kind: the ``reward`` option.

    Raises:
        ValueError: not one of ``REWARD_KINDS``.
    """
    if kind not in REWARD_KINDS:
        raise ValueError(f"{task_id}: option 'reward' must be one of {list(REWARD_KINDS)}, got {kind!r}")
    return kind


def encode_golds(golds: Sequence[str]) -> str:
    """Gold answers as ``Prompt.answer``: a JSON list of strings.

    Args:
        golds: the gold answers, at least one.
    """
    return json.dumps(list(golds), ensure_ascii=False)


def decode_golds(answer: str) -> tuple[str, ...]:
    """The gold answers of a ``Prompt.answer``: a JSON list of strings, or else the whole string as one answer.

    Args:
        answer: the prompt's answer field.
    """
    try:
        value = json.loads(answer)
    except ValueError:
        return (answer,)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return (answer,)
