"""A verifiers environment's tools as stoa's text-level tool protocol (``stoa.tasks.vf`` uses it).

verifiers 0.4 exposes tools as MCP servers (``vf.Toolset`` subclasses with ``@vf.tool`` methods) and the model
calls them through OpenAI-style native tool calling: the inference server parses the model's text into
``tool_calls`` with a model-specific parser, and the tool list reaches the model through the chat template's
``tools=`` argument. Stoa's engines work on tokens and never call an inference server, so that path cannot be
reproduced exactly. What stoa does instead, honestly:

- the tools are listed in the system prompt as text (``tools_prompt``), one line each, with the calling format;
- a turn calls a tool by ending with ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (Hermes/Qwen
  syntax; ``</tool_call>`` is the stop string); one call per turn, the last one in the turn;
- the result comes back as ``<tool_response>\\nTEXT\\n</tool_response>`` (TEXT is the echo role);
- the tool runs in-process: the toolset is constructed with its config and the ``@vf.tool`` method called with
  the JSON arguments, validated against its signature as the MCP server would (``pydantic.validate_call``); a
  string result is the text, anything else its JSON (``pydantic_core.to_json``, as the MCP server renders it);
  a call that raises answers ``Error: <type>: <message>``;
- for the reward the episode is rebuilt as verifiers messages (assistant turns with native ``tool_calls``, tool
  messages with the re-run results), so ``trace.messages``, ``trace.tool_messages`` and ``trace.last_reply``
  read as they would after a verifiers rollout.

Only tools that are plain functions of their arguments can be replayed this way, so a toolset is refused when it
keeps per-rollout state (a ``State`` subclass), prepares per-task state (``setup_task``), is remote (``url``), or
runs outside a subprocess (a container runtime).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from stoa.envs.base import Observation, ToolResult, result_hash
from stoa.rollouts.episode import ROLE_ECHO, ROLE_MASKED, ToolCall
from stoa.tasks.base import TaskPluginError

__all__ = ["CALL_CLOSE", "CALL_OPEN", "LocalTool", "VerifiersToolEnv", "VerifiersTools", "episode_messages",
           "local_tools", "parse_tool_call", "run_sync", "tools_prompt"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The text that frames a tool call in a model turn."""
_MAX_ARG_CHARS = 8192


def run_sync(factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run a coroutine to completion from synchronous code, on this thread when no event loop runs here
    (``score_group``'s helper thread), else on a fresh thread (a caller inside an event loop).

    Args:
        factory: builds the coroutine (called on the thread that runs it).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(factory())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="vf-async", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass(frozen=True)
class LocalTool:
    """One ``@vf.tool`` method, callable in-process."""

    name: str
    """The name the model calls it by: ``<server>_<tool>`` as verifiers advertises it (bare without a prefix)."""
    fn: Callable[..., Any]
    """The bound tool method."""
    signature: str
    """``name(a: int, b: int)`` as listed in the prompt."""
    doc: str
    """Its description (the docstring's text)."""


def _refusal(server: Any, base_state: type, toolset_base: type) -> str | None:
    """Why a toolset cannot be replayed in-process, or None."""
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.state import state_cls

    cls = type(server)
    if state_cls(cls) is not base_state:
        return f"it keeps per-rollout state ({state_cls(cls).__name__})"
    if cls.setup_task is not toolset_base.setup_task:
        return "it prepares per-task state (setup_task)"
    config = server.config
    if getattr(config, "url", None):
        return f"it is a remote server ({config.url})"
    if not isinstance(getattr(config, "runtime", SubprocessConfig()), SubprocessConfig):
        return f"it runs in a {type(config.runtime).__name__} runtime"
    return None


def local_tools(servers: Sequence[Any], env: str) -> dict[str, LocalTool]:
    """The tools of a taskset's and its task type's toolsets, by the name the model calls them.

    Args:
        servers: the ``vf.Toolset`` instances (``Taskset.toolsets(config)`` and ``Task.toolsets(config)``).
        env: the environment's name, for messages.

    Raises:
        TaskPluginError: a server that is not a ``vf.Toolset`` of plain functions, or two tools with one name.
    """
    import verifiers.v1 as vf
    from verifiers.v1.utils.decorators import discover_decorated

    out: dict[str, LocalTool] = {}
    for server in servers:
        if not isinstance(server, vf.Toolset):
            raise TaskPluginError(f"vf:{env}: tool server {type(server).__name__} is not a vf.Toolset; stoa runs "
                                  "only in-process @vf.tool functions")
        why = _refusal(server, vf.State, vf.Toolset)
        if why is not None:
            raise TaskPluginError(f"vf:{env}: toolset {type(server).__name__} cannot run in stoa: {why}; stoa runs "
                                  "stateless in-process @vf.tool functions")
        for fn in discover_decorated(server, "tool"):
            raw = getattr(fn, "tool_name", None) or fn.__name__
            name = f"{server.server_name}_{raw}" if server.server_name else raw
            if name in out:
                raise TaskPluginError(f"vf:{env}: two tools are named {name!r}; give the toolsets distinct names")
            params = ", ".join(str(p) for p in inspect.signature(fn).parameters.values())
            out[name] = LocalTool(name, fn, f"{name}({params})", " ".join((fn.__doc__ or "").split()))
    return out


def tools_prompt(tools: dict[str, LocalTool]) -> str:
    """The system-prompt text that lists the tools and the calling format.

    Args:
        tools: the environment's tools.
    """
    lines = [f"- {t.signature}: {t.doc}" if t.doc else f"- {t.signature}" for t in tools.values()]
    return ("You can call tools. To call one, end your turn with "
            f'{CALL_OPEN}{{"name": "TOOL", "arguments": {{...}}}}{CALL_CLOSE}; the result comes back as '
            "<tool_response>...</tool_response>. When you are done, answer without a tool call. Tools:\n"
            + "\n".join(lines))


def parse_tool_call(turn_text: str, tools: dict[str, LocalTool]) -> ToolCall | None:
    """The last complete tool call of a turn, with canonical JSON arguments; None when there is none, it is not
    a JSON object naming a known tool with object arguments, or the arguments are too long.

    Args:
        turn_text: the decoded turn.
        tools: the environment's tools.
    """
    end = turn_text.rfind(CALL_CLOSE)
    start = turn_text.rfind(CALL_OPEN, 0, end) if end >= 0 else -1
    if start < 0:
        return None
    try:
        body = json.loads(turn_text[start + len(CALL_OPEN):end])
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("name") not in tools:
        return None
    args = body.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    text = json.dumps(args, sort_keys=True, ensure_ascii=False)
    return ToolCall(str(body["name"]), text) if len(text) <= _MAX_ARG_CHARS else None


async def _call(tool: LocalTool, arguments: str) -> str:
    """One tool call's result text (``Error: ...`` when the call raises)."""
    import pydantic
    import pydantic_core

    try:
        result = pydantic.validate_call(tool.fn)(**json.loads(arguments))
        if inspect.isawaitable(result):
            result = await result
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, as over MCP
        return f"Error: {type(e).__name__}: {str(e)[:500]}"
    return result if isinstance(result, str) else pydantic_core.to_json(result, fallback=str, indent=2).decode()


class VerifiersTools:
    """Runs a batch of tool calls in-process (``Tools``); the digest covers the call and its result.

    Args:
        tools: the environment's tools.
    """

    def __init__(self, tools: dict[str, LocalTool]) -> None:
        self.tools = tools

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order.

        Args:
            calls: the calls of every paused row (names are known tools: ``parse_tool_call`` checked them).
        """
        async def batch() -> list[str]:
            return list(await asyncio.gather(*(_call(self.tools[c.name], c.arguments) for c in calls)))

        texts = run_sync(batch)
        return [ToolResult(text=t, digest=result_hash([c.name, c.arguments, t]))
                for c, t in zip(calls, texts, strict=True)]


class VerifiersToolEnv:
    """One episode of a verifiers environment with in-process tools (``Environment``).

    Args:
        tools: the environment's tools.
    """

    stop_strings: tuple[str, ...] = (CALL_CLOSE,)

    def __init__(self, tools: dict[str, LocalTool]) -> None:
        self.tools = tools

    def initial_state(self) -> str:
        """No state is shared between turns (the key is empty)."""
        return ""

    def parse(self, turn_text: str) -> ToolCall | None:
        """The turn's tool call; None (the episode ends) without a valid one.

        Args:
            turn_text: the decoded turn.
        """
        return parse_tool_call(turn_text, self.tools)

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        """The tool's result in ``<tool_response>`` markup (the result text is the echo role).

        Args:
            call: the call.
            result: its result.
        """
        segments = (("\n<tool_response>\n", ROLE_MASKED), (result.text, ROLE_ECHO), ("\n</tool_response>\n",
                                                                                      ROLE_MASKED))
        return Observation(segments=segments)


def episode_messages(completion: str, tools: dict[str, LocalTool]) -> list[Any]:
    """The policy's episode text as verifiers messages, re-running each tool call in-process.

    The episode text is the policy's turns joined by newlines; every turn but the last ends at its first
    ``</tool_call>`` (the stop string), so splitting there recovers the turns. A turn whose call does not parse
    ended the episode: it is the last assistant message.

    Args:
        completion: the episode text (``stoa.envs.base.episode_text``).
        tools: the environment's tools.
    """
    import verifiers.v1 as vf

    *pieces, tail = completion.split(CALL_CLOSE)
    messages: list[Any] = []
    runner = VerifiersTools(tools)
    for n, piece in enumerate(pieces):
        turn = (piece[1:] if n and piece.startswith("\n") else piece) + CALL_CLOSE
        call = parse_tool_call(turn, tools)
        if call is None:
            messages.append(vf.AssistantMessage(content=turn))
            return messages
        before = turn[:turn.rfind(CALL_OPEN)].strip()
        tool_call = vf.ToolCall(id=f"call_{n}", name=call.name, arguments=call.arguments)
        messages.append(vf.AssistantMessage(content=before or None, tool_calls=[tool_call]))
        messages.append(vf.ToolMessage(tool_call_id=f"call_{n}", content=runner.run([call])[0].text, name=call.name))
    last = tail[1:] if pieces and tail.startswith("\n") else tail
    if last or not pieces:
        messages.append(vf.AssistantMessage(content=last))
    return messages
