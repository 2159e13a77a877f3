"""TRL-shaped reward functions: loaded from ``module:fn[*weight]``, checked once, called once per group.

A reward function is called as TRL's ``GRPOTrainer`` calls it: with keyword lists, one item per completion,
``fn(prompts=[...], completions=[...], **columns)``, where ``columns`` holds every dataset column but the prompt
column (the answer column under its own name), each row's value repeated once per completion. A plain-text
prompt's completions are strings; a conversational prompt's (a list of ``{"role", "content"}`` messages) are
``[{"role": "assistant", "content": text}]``. It returns one number per completion, or None where it does not
apply (as TRL: several functions' rewards are summed with their weights, None counting as nothing; a completion
no function scored gets NaN, which ``score_group`` rejects as ``reward_not_finite``). TRL also passes
``completion_ids`` and ``trainer_state``; stoa scores text, so it passes neither: a function that requires them
is refused at start-up (:class:`~stoa.tasks.base.RewardFunctionError`), and one that gives them a default runs.
A function without ``**kwargs`` gets only the keywords it names.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stoa.tasks.base import RewardFunctionError, TaskOptionError, TaskPluginError
from stoa.tasks.code import working_dir_on_path

__all__ = ["PROBE_COMPLETIONS", "PROBE_TIMEOUT_S", "RewardFn", "call_reward", "combine", "completions_for",
           "load_reward", "parse_reward_spec", "probe"]

PROBE_TIMEOUT_S = 60.0
"""How long the start-up probe call of one reward function may take."""
PROBE_COMPLETIONS = ("", "The answer is 0.")
"""The two dummy completions each reward function is called with once at start-up."""

_SPEC = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<fn>[A-Za-z_]\w*)(?:\*(?P<weight>[^*]+))?")


@dataclass(frozen=True)
class RewardFn:
    """One loaded reward function and how to call it."""

    spec: str
    """The option value it came from, ``module:fn`` or ``module:fn*weight``."""
    module: str
    """Its module's import name."""
    weight: float
    """What its rewards are multiplied by before the sum."""
    fn: Callable[..., Any]
    """The function."""
    names: frozenset[str] | None
    """The keywords it takes, or None when it takes ``**kwargs`` (then it gets every column)."""

    @property
    def label(self) -> str:
        """``module:fn``, for messages."""
        return self.spec.partition("*")[0]


def parse_reward_spec(text: str) -> tuple[str, str, float]:
    """(module, function name, weight) of ``module:fn[*weight]``; ``TaskOptionError`` naming the form.

    Args:
        text: the ``reward`` option's value.
    """
    m = _SPEC.fullmatch(text.strip())
    weight = 1.0
    if m is not None and m.group("weight") is not None:
        try:
            weight = float(m.group("weight"))
        except ValueError:
            weight = math.nan
    if m is None or not math.isfinite(weight):
        raise TaskOptionError(f"dataset: option 'reward': {text!r} is not module:function or module:function*weight "
                              "(e.g. reward=my_rewards:correct*0.5)")
    return m.group("module"), m.group("fn"), weight


def _keywords(fn: Callable[..., Any], label: str, offered: Sequence[str]) -> frozenset[str] | None:
    """The keywords ``fn`` takes of ``offered`` (None: all, it has ``**kwargs``); refuses a signature TRL's
    keyword call cannot bind."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin or C function without a signature: called with every keyword
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in params:
        if p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.kind is p.POSITIONAL_ONLY or p.name not in offered:
            why = ("stoa scores text, so it passes no token ids or trainer state" if p.name in
                   ("completion_ids", "trainer_state") else f"it is not a column (columns: {sorted(offered)})")
            raise RewardFunctionError(f"reward function {label}: its parameter {p.name!r} cannot be filled: {why}; "
                                      "stoa calls fn(prompts=..., completions=..., **columns) as TRL does: give "
                                      f"{p.name!r} a default or take **kwargs")
    return None if takes_all else frozenset(p.name for p in params if p.name in offered)


def load_reward(text: str, offered: Sequence[str]) -> RewardFn:
    """The reward function ``module:fn[*weight]`` names, imported (the working directory is on the path).

    Args:
        text: the ``reward`` option's value.
        offered: the keywords it will be called with (``prompts``, ``completions`` and the columns).

    Raises:
        TaskOptionError: a malformed value.
        TaskPluginError: the module does not import or has no such function (exit 14).
        RewardFunctionError: a signature the call cannot bind (exit 15).
    """
    module_name, fn_name, weight = parse_reward_spec(text)
    label = f"{module_name}:{fn_name}"
    working_dir_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskPluginError(f"reward function {label}: cannot import {module_name!r} ({type(e).__name__}: "
                              f"{str(e)[:200]}); put {module_name.split('.')[0]}.py in the working directory or "
                              "pip install the package that provides it") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: one line
        raise TaskPluginError(f"reward function {label}: importing {module_name!r} failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); fix the module") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskPluginError(f"reward function {label}: module {module_name!r} has no function {fn_name!r}; "
                              "name a function defined in it")
    return RewardFn(text.strip(), module_name, weight, fn, _keywords(fn, label, offered))


def completions_for(prompt: object, texts: Sequence[str]) -> list[Any]:
    """The completions as TRL passes them: strings for a plain prompt, one assistant message each for a
    conversational one.

    Args:
        prompt: the row's prompt column value (a string or a list of messages).
        texts: the completions' text.
    """
    if isinstance(prompt, str):
        return list(texts)
    return [[{"role": "assistant", "content": t}] for t in texts]


def call_reward(rf: RewardFn, prompt: object, texts: Sequence[str], columns: Mapping[str, Any]) -> Any:
    """One reward function's raw output for a group (each value repeated per completion, as TRL does).

    Args:
        rf: the function.
        prompt: the row's prompt (copied, so the function cannot change the dataset).
        texts: the completions' text.
        columns: the row's other columns (copied likewise).
    """
    n = len(texts)
    row = copy.deepcopy(dict(columns))
    kwargs: dict[str, Any] = {"prompts": [copy.deepcopy(prompt) for _ in range(n)],
                              "completions": completions_for(prompt, texts),
                              **{k: [v] * n for k, v in row.items()}}
    if rf.names is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in rf.names}
    return rf.fn(**kwargs)


def _as_list(values: Any) -> Any:
    """What a reward function returned as a list where TRL would take it (any iterable but a string or a mapping:
    a numpy array, a tensor, a generator); anything else as it is."""
    if isinstance(values, Sequence) or isinstance(values, str | bytes | Mapping):
        return values
    if callable(getattr(values, "tolist", None)):
        return values.tolist()
    return list(values) if isinstance(values, Iterable) else values


def _number(v: Any) -> float | None:
    """``v`` as a float, or None when it is no number (a string is none, even "1.0")."""
    if isinstance(v, str | bytes):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _not_a_number(v: Any, rf: RewardFn) -> object:
    """A stand-in for a value that is not a number, which no ``float()`` takes (a string such as "1" would pass
    ``score_group``'s check): its type's name says what the function returned, so the rejection names it."""
    return type(f"{type(v).__name__} from {rf.label}", (), {"__slots__": ()})()


def combine(outputs: Sequence[tuple[RewardFn, Any]], n: int) -> Any:
    """The weighted sum of several functions' outputs, per completion.

    What cannot be summed is passed on for ``score_group`` to name: a function's output that is not ``n`` items,
    as it is (``reward_wrong_length``), an item that is not a number (``reward_not_finite``). A completion
    no function scored (all None) is NaN. Returns a list of ``n`` floats when all is well.

    Args:
        outputs: each function with its raw output.
        n: the number of completions.
    """
    total: list[Any] = [None] * n
    for rf, raw in outputs:
        values = _as_list(raw)
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) != n:
            return values
        for i, v in enumerate(values):
            x = _number(v)
            if v is None or not isinstance(total[i], float | None):
                continue
            total[i] = _not_a_number(v, rf) if x is None else (total[i] or 0.0) + rf.weight * x
    return [math.nan if t is None else t for t in total]


def probe(rf: RewardFn, prompt: object, columns: Mapping[str, Any]) -> None:
    """Call ``rf`` once on a row with two dummy completions; refuse it unless it returns two numbers (or None).

    Args:
        rf: the function.
        prompt: the first training row's prompt.
        columns: that row's other columns.

    Raises:
        RewardFunctionError: it raised, hung past ``PROBE_TIMEOUT_S``, or returned the wrong count or a
            non-number (exit 15).
    """
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["values"] = call_reward(rf, prompt, PROBE_COMPLETIONS, columns)
        except BaseException as e:  # noqa: BLE001 - the user's code: reported below
            out["error"] = e

    t = threading.Thread(target=run, name=f"probe-{rf.label}", daemon=True)
    t.start()
    t.join(PROBE_TIMEOUT_S)
    kind = "a plain-text prompt: completions are strings" if isinstance(prompt, str) else \
        "a conversational prompt: completions are [{'role': 'assistant', 'content': text}]"
    where = f"reward function {rf.label}, called on the first training row ({kind}) with 2 completions,"
    if t.is_alive():
        raise RewardFunctionError(f"{where} did not return within {PROBE_TIMEOUT_S:g}s; make it return")
    if "error" in out:
        e = out["error"]
        raise RewardFunctionError(f"{where} raised {type(e).__name__}: {str(e)[:200]}; fix the function")
    values = _as_list(out["values"])
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) != 2:
        got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
        raise RewardFunctionError(f"{where} returned {got}; return a list with one number per completion")
    bad = [v for v in values if v is not None and _number(v) is None]
    if bad:
        raise RewardFunctionError(f"{where} returned {type(bad[0]).__name__} {str(bad[0])[:40]!r}, not a number; "
                                  "return a list of floats")
