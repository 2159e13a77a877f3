"""A verifiers (0.4, ``verifiers.v1``) environment as a stoa task: ``--task vf:ENV[,arg=key:value,...]``.

``ENV`` is a verifiers taskset id: an installed package (``pip install ENV``, ``prime env install owner/ENV``; a
hub id ``owner/ENV@version`` names the same module) or a module in the working directory, exporting its
``vf.Taskset`` subclass through ``__all__``, as ``vf-eval`` resolves it. verifiers is imported only when such a
task is built (importing ``verifiers.v1`` takes ~5 s).

Covered:

- Prompts: the taskset's tasks, read once (``Taskset.__iter__``: ``idx`` set, config system prompt applied), in
  load order. Messages are the task's ``system_prompt`` (a system message) then its ``prompt`` (a string is one
  user message; a message list keeps each message's role and text), as verifiers' chat harness sends them.
  ``Prompt.answer`` is the task data's ``answer`` field when it has one, else "".
- Held-out split: verifiers 0.4 has no eval split. With ``eval_arg=key:value`` options the held-out prompts are a
  second load of the taskset with those config fields changed (``eval_arg=split:test``); otherwise a
  deterministic ``heldout`` fraction (default 0.1) of the tasks, chosen by a hash of each task's key (its data
  without ``idx``, or the taskset's own ``Task.key``), so adding rows never moves another row between splits.
- Options of the taskset: ``arg=key:value``, repeatable, one per config field; the value is a string that the
  taskset's pydantic config validates and converts to the field's type (``"3"`` -> 3, ``"true"`` -> True);
  fields of structured types (lists, dicts, nested configs) cannot be set this way. Values cannot hold commas.
- Reward: ``Task.score`` on a trace rebuilt from the prompt and the completion (one sampled assistant message,
  or the episode's turns and tool results, ``stoa.tasks.vf_tools``), without a runtime; the reward is the weighted
  sum of the ``@vf.reward`` functions (``Trace.reward``). A group is scored concurrently in one event loop
  (``rewards``), so ``score_group`` times it out and turns a raising reward into ``reward_raised``.
  ``is_correct``: the reward reaches ``correct_at`` (default 1.0).
- Tools: a taskset whose toolsets (``Taskset.toolsets``, ``Task.toolsets``) are in-process ``vf.Toolset`` classes
  of plain functions becomes a multi-turn task with local tools (``tool_kind = "local"``) that the trainer replays
  exactly; the text protocol and what it cannot reproduce are in ``stoa.tasks.vf_tools``. Such an environment must
  say ``tools=deterministic``, or ``tools=nondeterministic`` for functions whose answers change (a live lookup):
  the task then declares ``deterministic_tools = False`` and the trainer refuses to start unless the run sets
  ``replay = false`` (docs/tasks.md#tools-that-cannot-be-replayed).
- Identity: ``spec()`` carries the taskset's config, counts and a SHA-256 over the tasks' content, so a worker with
  another version of the data is refused; ``code_modules()`` names the environment's module and ``verifiers``, so
  the contract records both distributions and digests.

Not covered (refused with one line, exit 14, unless noted): multi-agent environments (a taskset that exports its
own ``vf.Env``); a taskset that ships its own harness (its program is not a plain chat); tasks that need a
container; rewards or metrics that need a runtime, and judges (LLM calls); infinite tasksets without ``limit``;
multimodal prompt content (its text is kept); per-task tools (``setup_task``), stateful, remote or containerised
toolsets; ``@vf.stop`` and ``@vf.intercept`` hooks (never run: stoa's own limits end an episode).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, ClassVar

import numpy as np

from stoa.envs.base import Tools
from stoa.retrieval.base import Searcher
from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    TaskDataError,
    TaskOptionError,
    format_prompt_id,
    parse_prompt_id,
)
from stoa.tasks.code import working_dir_on_path
from stoa.tasks.multiturn import LIMIT_OPTIONS, limits_spec, task_limits
from stoa.tasks.vf_load import Loaded, load_env, parse_args
from stoa.tasks.vf_tools import LocalTool, VerifiersToolEnv, VerifiersTools, episode_messages, run_sync, tools_prompt

__all__ = ["VerifiersTask"]

_SPLITS = ("train", "test")
_PROMPT_VERSION = 1


def _split_test(key: str, fraction: float) -> bool:
    """Whether a task with this key is held out (a stable hash of the key against ``fraction``)."""
    h = int.from_bytes(hashlib.sha256(f"stoa.vf|{key}".encode()).digest()[:8], "little")
    return h % 1_000_000 < round(fraction * 1_000_000)


def _fingerprint(train: list[Any], test: list[Any]) -> str:
    """SHA-256 over both splits' task content hashes, in order."""
    h = hashlib.sha256()
    for split, tasks in (("train", train), ("test", test)):
        for t in tasks:
            h.update(f"{split}\0{t.hash}\n".encode())
    return h.hexdigest()


class VerifiersTask:
    """A verifiers environment's taskset, rewards and (deterministic) tools; see the module docstring.

    Args:
        env: the taskset id (installed package or working-directory module).
        arg: ``key:value`` taskset config fields (strings, validated by the taskset's config).
        eval_arg: ``key:value`` fields changed for the held-out load (none: the ``heldout`` split).
        heldout: fraction of tasks held out when no ``eval_arg`` is given (0 .. 0.5).
        limit: read at most this many tasks per load (0: all; needed for an infinite taskset).
        tools: ``deterministic`` or ``nondeterministic``; required when the environment has tools.
        correct_at: the reward at or above which a completion counts as correct.
        max_turns: model turns per episode (tool environments).
        max_obs_tokens: tokens of one tool result.
        max_total_tokens: tokens after the prompt.
        prompt_version, n_train, n_test, sha256: checks from ``spec()`` (a worker's copy must match).
    """

    id: str = "vf"
    reward_version: str = "1"
    POSITIONAL: ClassVar[str] = "env"
    OPTIONS: ClassVar[dict[str, type]] = {
        "env": str, "arg": tuple, "eval_arg": tuple, "heldout": float, "limit": int, "tools": str,
        "correct_at": float, "prompt_version": int, "n_train": int, "n_test": int, "sha256": str, **LIMIT_OPTIONS,
    }

    def __init__(self, env: str = "", arg: tuple[str, ...] = (), eval_arg: tuple[str, ...] = (),
                 heldout: float = 0.1, limit: int = 0, tools: str = "", correct_at: float = 1.0,
                 max_turns: int = 8, max_obs_tokens: int = 512, max_total_tokens: int = 4096,
                 prompt_version: int | None = None, n_train: int | None = None, n_test: int | None = None,
                 sha256: str | None = None) -> None:
        if not env:
            raise TaskOptionError("vf: name the environment: --task vf:ENV (an installed verifiers taskset id)")
        if not 0.0 <= heldout <= 0.5:
            raise TaskOptionError(f"vf: option 'heldout' must be in [0, 0.5], got {heldout}")
        if prompt_version is not None and prompt_version != _PROMPT_VERSION:
            raise TaskOptionError(f"vf: option 'prompt_version' is {prompt_version}, this stoa builds version "
                                  f"{_PROMPT_VERSION}; use the stoa version the run was started with")
        working_dir_on_path()
        loaded = load_env(env, arg, limit)
        self.env, self.args, self.eval_args, self.heldout_fraction = env, tuple(arg), tuple(eval_arg), heldout
        self.limit, self.correct_at, self.module = limit, correct_at, loaded.module
        self.train, self.test = self._splits(loaded, env)
        if not self.train:
            raise TaskDataError(f"vf:{env}: no training tasks (the held-out split took all "
                                f"{len(self.test)}); lower 'heldout' or give eval_arg")
        self.tools: dict[str, LocalTool] = self._check_tools(loaded, tools)
        self.deterministic_tools = tools != "nondeterministic"
        """False: the trainer cannot replay these tools; a run must set ``replay = false``."""
        self.tools_text = tools_prompt(self.tools) if self.tools else ""
        self.limits = task_limits("vf", max_turns, max_obs_tokens, max_total_tokens) if self.tools else None
        self.tool_kind = "local" if self.tools else None
        self.sha256 = _fingerprint(self.train, self.test)
        for name, want, have in (("n_train", n_train, len(self.train)), ("n_test", n_test, len(self.test)),
                                 ("sha256", sha256, self.sha256)):
            if want is not None and want != have:
                raise TaskOptionError(f"vf:{env}: option {name!r}: the run has {want!r} but this machine's "
                                      f"environment gives {have!r}; install the environment version the run was "
                                      "started with")

    def _splits(self, loaded: Loaded, env: str) -> tuple[list[Any], list[Any]]:
        """(train, test) tasks: a second load for ``eval_arg``, else the hash split."""
        if self.eval_args:
            overrides = {**parse_args(env, self.args), **parse_args(env, self.eval_args)}
            held = load_env(env, tuple(f"{k}:{v}" for k, v in overrides.items()), self.limit)
            return loaded.tasks, held.tasks
        keys = [loaded.key(t) for t in loaded.tasks]
        test = {i for i, k in enumerate(keys) if _split_test(k, self.heldout_fraction)}
        return ([t for i, t in enumerate(loaded.tasks) if i not in test],
                [t for i, t in enumerate(loaded.tasks) if i in test])

    def _check_tools(self, loaded: Loaded, tools: str) -> dict[str, LocalTool]:
        """The in-process tools, once the environment declared whether they are deterministic."""
        if tools not in ("", "deterministic", "nondeterministic"):
            raise TaskOptionError(f"vf:{self.env}: option 'tools' must be deterministic or nondeterministic, "
                                  f"got {tools!r}")
        if not loaded.servers:
            return {}
        if not tools:
            raise TaskOptionError(f"vf:{self.env}: the environment has tools; declare tools=deterministic (plain "
                                  "functions of their arguments, replayed by the trainer) or tools=nondeterministic")
        return loaded.local_tools(self.env)

    def code_modules(self) -> tuple[str, ...]:
        """The modules rewards and tools come from: the environment's and ``verifiers``."""
        return (self.module, "verifiers")

    def spec(self) -> dict[str, object]:
        """JSON-able options that rebuild this task and check its data (``get_task("vf", **spec)``)."""
        out: dict[str, object] = {"env": self.env, "arg": list(self.args), "eval_arg": list(self.eval_args),
                                  "heldout": self.heldout_fraction, "limit": self.limit,
                                  "correct_at": self.correct_at, "prompt_version": _PROMPT_VERSION,
                                  "n_train": len(self.train), "n_test": len(self.test), "sha256": self.sha256}
        if self.limits is not None:
            out.update(tools="deterministic" if self.deterministic_tools else "nondeterministic",
                       **limits_spec(self.limits))
        return out

    def _task(self, prompt_id: str) -> Any:
        split, index = parse_prompt_id("vf", prompt_id, _SPLITS)
        tasks = self.train if split == "train" else self.test
        if index >= len(tasks):
            raise PromptIdError(f"vf:{self.env}: prompt id {prompt_id!r} is out of range: the {split} split has "
                                f"{len(tasks)} tasks")
        return tasks[index]

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id ("train:<i>" / "test:<i>", the i-th task of the split in load order).

        Raises:
            PromptIdError: malformed id, unknown split, or index past the split's end.
        """
        from verifiers.v1.types import content_text

        data = self._task(prompt_id).data
        messages: list[dict[str, str]] = []
        system = "\n\n".join(s for s in (data.system_prompt or "", self.tools_text) if s)
        if system:
            messages.append({"role": "system", "content": system})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
        answer = getattr(data, "answer", "")
        answer = answer if isinstance(answer, str) else json.dumps(answer, default=str)
        return Prompt(id=prompt_id, messages=tuple(messages), answer=answer)

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A uniformly random training prompt."""
        return self.get(format_prompt_id("train", int(rng.integers(0, len(self.train)))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``min(n, size)`` held-out prompts, in load order."""
        if n < 0:
            raise ValueError(f"vf: heldout n must be >= 0, got {n}")
        if n and not self.test:
            raise ValueError(f"vf:{self.env}: no held-out tasks (heldout={self.heldout_fraction} of "
                             f"{len(self.train)} tasks chose none); raise 'heldout' or give eval_arg=key:value")
        return [self.get(format_prompt_id("test", i)) for i in range(min(n, len(self.test)))]

    def rewards(self, prompt: Prompt, completions: list[str]) -> list[float]:
        """The rubric's weighted score of each completion, scored concurrently in one event loop.

        Raises:
            verifiers' ``TaskError`` (or any error of the reward code): ``score_group`` reports ``reward_raised``.
        """
        import verifiers.v1 as vf
        from verifiers.v1.graph import MessageNode

        task = self._task(prompt.id)
        head = [vf.SystemMessage(content=m["content"]) if m["role"] == "system" else
                vf.UserMessage(content=m["content"]) if m["role"] == "user" else
                vf.AssistantMessage(content=m["content"]) for m in prompt.messages]
        traces = []
        for text in completions:
            tail = episode_messages(text, self.tools) if self.tools else [vf.AssistantMessage(content=text)]
            nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=i >= len(head)
                                 and m.role == "assistant") for i, m in enumerate([*head, *tail])]
            traces.append(vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                     hash=task.hash),
                                   agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes))

        async def score() -> None:
            await asyncio.gather(*(task.score(t) for t in traces))

        run_sync(score)
        return [float(t.reward) for t in traces]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The weighted rubric score of one completion."""
        return self.rewards(prompt, [completion])[0]

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the reward reaches ``correct_at``."""
        return self.reward(prompt, completion) >= self.correct_at

    def make_env(self, prompt: Prompt, seed: int) -> VerifiersToolEnv:
        """An episode with the environment's in-process tools (tool environments only)."""
        return VerifiersToolEnv(self.tools)

    def make_tools(self, searcher: Searcher | None = None) -> Tools:
        """The in-process tools (``searcher`` is ignored)."""
        return VerifiersTools(self.tools)

    def __repr__(self) -> str:
        return f"VerifiersTask(env={self.env!r}, train={len(self.train)}, test={len(self.test)})"
