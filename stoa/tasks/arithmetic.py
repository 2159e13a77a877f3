"""Procedural arithmetic task: unlimited seeded problems, each a pure function of its id and the options."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from stoa.tasks.base import Prompt, chat_messages, check_prompt_version, format_prompt_id, parse_prompt_id
from stoa.tasks.demos import Demo
from stoa.tasks.extract import EXTRACT_VERSION, answers_match, extract_answer, normalize_number

__all__ = ["ArithmeticTask"]

_ALL_OPS = "+-*"
# A problem: operands and the operators between them.
_Problem = tuple[tuple[int, ...], tuple[str, ...]]
_SPLITS = ("train", "test")
# Revision of the reward rule itself; the extractor's version is appended in reward_version.
_REWARD_REV = 1
# Revision of the prompt wording and of how problems are drawn from ids; part of spec().
_PROMPT_VERSION = 1
# One problem in _HELDOUT_MOD is held out, decided by a hash of its text alone (not of the seed or
# options), so a problem that is held out in one run is held out in every run.
_HELDOUT_MOD = 10
# Problem spaces up to this size are enumerated once, which gives distinct held-out problems
# in a fixed order and a clear error when a split would be empty; larger ones use rejection sampling.
_ENUMERATE_LIMIT = 50_000
_MAX_ATTEMPTS = 10_000
_MAX_DIGITS = 18
_MAX_TERMS = 8


# Enumerated small spaces by (digits, ops, n_terms, seed); read-only once built.
_POOL_CACHE: dict[tuple[int, str, int, int], dict[str, list[_Problem]]] = {}


def _u64s(key: str, count: int) -> list[int]:
    """`count` pseudo-random 64-bit integers, a pure function of `key` (BLAKE2b in counter mode)."""
    out: list[int] = []
    block = 0
    while len(out) < count:
        d = hashlib.blake2b(f"{key}|{block}".encode(), digest_size=64).digest()
        out.extend(int.from_bytes(d[i : i + 8], "little") for i in range(0, 64, 8))
        block += 1
    return out[:count]


def _is_heldout(expr: str) -> bool:
    """Whether a problem (by its canonical expression text) belongs to the held-out split."""
    d = hashlib.blake2b(f"stoa.arithmetic.heldout|{expr}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") % _HELDOUT_MOD == 0


def _evaluate(terms: Sequence[int], ops: Sequence[str]) -> int:
    """Value of terms[0] ops[0] terms[1] ... with the usual precedence (* before + and -)."""
    total = 0
    sign = 1
    product = terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        if op == "*":
            product *= term
        else:
            total += sign * product
            sign = 1 if op == "+" else -1
            product = term
    return total + sign * product


def _render(terms: Sequence[int], ops: Sequence[str]) -> str:
    parts = [str(terms[0])]
    for op, term in zip(ops, terms[1:], strict=True):
        parts += [op, str(term)]
    return " ".join(parts)


class ArithmeticTask:
    """Integer arithmetic problems such as "What is 23 + 45?", verified exactly.

    Prompt ids are "train:<i>" and "test:<i>"; the problem is a pure function of (options, split, i),
    so the trainer rebuilds any prompt from its id. A problem is held out iff a hash of its text says
    so (one in ten), and training never yields a held-out problem, so the splits are disjoint by
    problem, not just by id.

    Args:
        digits: digits per operand (operands are uniform in [10**(digits-1), 10**digits - 1]).
        ops: operators to draw from, any of "+", "-", "*" (e.g. "+-"); "*" binds tighter.
        n_terms: operands per problem.
        seed: selects which problems the ids map to.
        format_reward: reward for a wrong answer given as just a number (default 0: exact only).
        system: optional system message (default none).
        prompt_version: if given, must equal this code's prompt version (a check; spec() has it,
            so `get_task("arithmetic", **task.spec())` rebuilds the task and fails on a mismatch).
    """

    id: str = "arithmetic"
    reward_version: str = f"{_REWARD_REV}.{EXTRACT_VERSION}"
    OPTIONS: ClassVar[dict[str, type]] = {
        "digits": int,
        "ops": str,
        "n_terms": int,
        "seed": int,
        "format_reward": float,
        "system": str,
        "prompt_version": int,
    }

    def __init__(
        self,
        digits: int = 2,
        ops: str = "+",
        n_terms: int = 2,
        seed: int = 0,
        format_reward: float = 0.0,
        system: str = "",
        prompt_version: int | None = None,
    ) -> None:
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        if not 1 <= digits <= _MAX_DIGITS:
            raise ValueError(f"arithmetic: option 'digits' must be in [1, {_MAX_DIGITS}], got {digits}")
        bad = sorted(set(ops) - set(_ALL_OPS))
        if not ops or bad:
            raise ValueError(
                f"arithmetic: option 'ops' must be a non-empty string of {list(_ALL_OPS)}, got {ops!r}"
            )
        if not 2 <= n_terms <= _MAX_TERMS:
            raise ValueError(f"arithmetic: option 'n_terms' must be in [2, {_MAX_TERMS}], got {n_terms}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"arithmetic: option 'seed' must be in [0, 2**63), got {seed}")
        if not (math.isfinite(format_reward) and 0.0 <= format_reward < 1.0):
            raise ValueError(f"arithmetic: option 'format_reward' must be in [0, 1), got {format_reward}")
        self.digits = digits
        self.ops = "".join(o for o in _ALL_OPS if o in ops)  # canonical order, no repeats
        self.n_terms = n_terms
        self.seed = seed
        self.format_reward = float(format_reward)
        self.system = system
        self._lo = 10 ** (digits - 1)
        self._hi = 10**digits - 1
        n_operands = self._hi - self._lo + 1
        self.space_size = n_operands**n_terms * len(self.ops) ** (n_terms - 1)
        self._pools: dict[str, list[_Problem]] | None = None
        if self.space_size <= _ENUMERATE_LIMIT:
            key = (self.digits, self.ops, self.n_terms, self.seed)
            if key not in _POOL_CACHE:
                _POOL_CACHE[key] = self._enumerate()
            self._pools = _POOL_CACHE[key]

    def spec(self) -> dict[str, object]:
        """JSON-able description of everything that determines prompts and rewards."""
        return {
            "digits": self.digits,
            "ops": self.ops,
            "n_terms": self.n_terms,
            "seed": self.seed,
            "format_reward": self.format_reward,
            "system": self.system,
            "prompt_version": _PROMPT_VERSION,
        }

    def _problem_from_draws(self, draws: list[int]) -> _Problem:
        span = self._hi - self._lo + 1
        terms = tuple(self._lo + d % span for d in draws[: self.n_terms])
        ops = tuple(self.ops[d % len(self.ops)] for d in draws[self.n_terms :])
        return terms, ops

    def _enumerate(self) -> dict[str, list[_Problem]]:
        """Every problem of a small space, split by held-out membership and shuffled by the seed."""
        span = self._hi - self._lo + 1
        n_ops = len(self.ops)
        keyed: dict[str, list[tuple[bytes, tuple[int, ...], tuple[str, ...]]]] = {"train": [], "test": []}
        for number in range(self.space_size):
            code = number
            terms: list[int] = []
            for _ in range(self.n_terms):
                code, r = divmod(code, span)
                terms.append(self._lo + r)
            ops: list[str] = []
            for _ in range(self.n_terms - 1):
                code, r = divmod(code, n_ops)
                ops.append(self.ops[r])
            expr = _render(terms, ops)
            order = hashlib.blake2b(
                f"stoa.arithmetic.order|{self.seed}|{expr}".encode(), digest_size=16
            ).digest()
            keyed["test" if _is_heldout(expr) else "train"].append((order, tuple(terms), tuple(ops)))
        for split, items in keyed.items():
            if not items:
                raise ValueError(
                    f"arithmetic: the problem space of digits={self.digits}, ops={self.ops!r}, "
                    f"n_terms={self.n_terms} ({self.space_size} problems) has no {split} problems; "
                    "raise 'digits', 'n_terms' or add 'ops'"
                )
            items.sort(key=lambda item: item[0])
        return {split: [(t, o) for _, t, o in items] for split, items in keyed.items()}

    def _problem(self, split: str, index: int) -> _Problem:
        if self._pools is not None:
            pool = self._pools[split]
            if split == "test":
                return pool[index % len(pool)]
            (draw,) = _u64s(f"stoa.arithmetic|seed={self.seed}|{split}|{index}", 1)
            return pool[draw % len(pool)]
        want_test = split == "test"
        for attempt in range(_MAX_ATTEMPTS):
            key = f"stoa.arithmetic|seed={self.seed}|{split}|{index}|{attempt}"
            terms, ops = self._problem_from_draws(_u64s(key, 2 * self.n_terms - 1))
            if _is_heldout(_render(terms, ops)) == want_test:
                return terms, ops
        raise RuntimeError(  # pragma: no cover - probability about 0.9**10000 for a large space
            f"arithmetic: no {split} problem found for index {index} after {_MAX_ATTEMPTS} attempts"
        )

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id.

        Args:
            prompt_id: "train:<i>" or "test:<i>", i a non-negative decimal integer without leading zeros.

        Raises:
            PromptIdError: malformed id or unknown split (a ValueError and a KeyError).
        """
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        terms, ops = self._problem(split, index)
        expr = _render(terms, ops)
        user = f"What is {expr}? Answer with just the number."
        return Prompt(
            id=prompt_id, messages=chat_messages(user, self.system), answer=str(_evaluate(terms, ops))
        )

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A random training prompt (never a held-out problem).

        Args:
            rng: source of the random training index.
        """
        return self.get(format_prompt_id("train", int(rng.integers(0, 2**62))))

    def demonstrations(self, n: int, rng: np.random.Generator) -> list[Demo]:
        """``n`` demonstrations on random training problems: the answer alone, as the prompt asks.

        Args:
            n: how many.
            rng: source of the problems.
        """
        out = []
        for _ in range(n):
            prompt = self.sample_train(rng)
            out.append(Demo(prompt, (prompt.answer,)))
        return out

    def heldout(self, n: int) -> list[Prompt]:
        """The first n held-out prompts, "test:0" .. "test:<n-1>".

        For spaces small enough to enumerate the first min(n, size of the held-out split) are
        distinct; past that they repeat in the same order.

        Args:
            n: how many prompts.
        """
        if n < 0:
            raise ValueError(f"arithmetic: heldout n must be >= 0, got {n}")
        return [self.get(format_prompt_id("test", i)) for i in range(n)]

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the completion's final number equals the true value.

        Args:
            prompt: the prompt answered.
            completion: the model's text.
        """
        return answers_match(extract_answer(completion), prompt.answer)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 if correct; else `format_reward` if the completion is just a number; else 0.0.

        Args:
            prompt: the prompt answered.
            completion: the model's text.
        """
        if self.is_correct(prompt, completion):
            return 1.0
        if self.format_reward and normalize_number(completion) is not None:
            return self.format_reward
        return 0.0

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(digits={self.digits}, ops={self.ops!r}, n_terms={self.n_terms}, "
            f"seed={self.seed}, format_reward={self.format_reward}, system={self.system!r})"
        )
