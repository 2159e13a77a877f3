"""Loading a verifiers (0.4) taskset for ``stoa.tasks.vf``: the module, its config, its tasks and tool servers,
each failure one line (``TaskPluginError`` exit 14 for code, ``TaskDataError`` exit 2 for data)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stoa.tasks.base import TaskDataError, TaskOptionError, TaskPluginError
from stoa.tasks.vf_tools import LocalTool, local_tools

__all__ = ["Loaded", "load_env", "parse_args"]

_NETWORK_ERRORS = ("Connection", "Timeout", "HTTP", "Hub", "Network", "SSL", "Resolve")


@dataclass(frozen=True)
class Loaded:
    """A loaded taskset."""

    module: str
    """The module that defines it (what the contract records)."""
    tasks: list[Any]
    """Its ``vf.Task`` instances, in load order."""
    servers: list[Any]
    """Its tool servers (taskset-wide, then the task type's)."""

    @staticmethod
    def key(task: Any) -> str:
        """A task's stable identity: the taskset's own ``Task.key`` if it overrides it, else its data's content
        hash without ``idx`` (so inserting a row moves no other row)."""
        from verifiers.v1.task import Task, task_key

        if type(task).key is not Task.key:
            return str(task.key)
        return task_key(task.data.model_dump(mode="json", exclude_none=True, exclude={"idx"}))

    def local_tools(self, env: str) -> dict[str, LocalTool]:
        """The servers' tools, callable in-process (``TaskPluginError`` for a server that cannot be replayed)."""
        return local_tools(self.servers, env)


def parse_args(env: str, args: Sequence[str]) -> dict[str, str]:
    """``key:value`` items as a dict (``TaskOptionError`` naming a malformed or repeated one).

    Args:
        env: the environment's name, for messages.
        args: the ``arg`` option's items.
    """
    out: dict[str, str] = {}
    for item in args:
        key, sep, value = item.partition(":")
        if not sep or not key.strip().isidentifier():
            raise TaskOptionError(f"vf:{env}: option 'arg' must be key:value (a taskset config field), got {item!r}")
        if key.strip() in out:
            raise TaskOptionError(f"vf:{env}: option 'arg' sets {key.strip()!r} twice")
        out[key.strip()] = value.strip()
    return out


def _import(env: str) -> tuple[str, type]:
    """(module name, Taskset class) of a taskset id, as verifiers resolves it."""
    from verifiers.v1.utils.loaders import import_taskset, taskset_class

    name = env.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    try:
        module = import_taskset(env)
    except ModuleNotFoundError as e:
        cause = e.__cause__ if isinstance(e.__cause__, ModuleNotFoundError) else e
        if cause.name and cause.name.split(".")[0] not in (name, "verifiers"):
            raise TaskPluginError(f"vf:{env}: the environment imports {cause.name!r}, which is not installed; "
                                  f"pip install {cause.name.split('.')[0]}") from None
        raise TaskPluginError(f"vf:{env}: no verifiers environment {name!r} is installed; pip install {name} "
                              f"(or prime env install OWNER/{name}), or put {name}.py in the working "
                              "directory") from None
    except Exception as e:  # noqa: BLE001 - the environment's own import-time failure, one line
        raise TaskPluginError(f"vf:{env}: importing {name!r} failed ({type(e).__name__}: {str(e)[:200]}); "
                              "fix or reinstall the environment") from None
    try:
        return module.__name__, taskset_class(env)
    except (AttributeError, TypeError, ValueError) as e:
        raise TaskPluginError(f"vf:{env}: {e}") from None


def _check_shape(env: str, cls: type) -> None:
    """Refuse what stoa cannot play: multi-agent envs and tasksets with their own harness."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    if not issubclass(environment_class(env), vf.SingleAgentEnv):
        raise TaskPluginError(f"vf:{env}: a multi-agent environment ({environment_class(env).__name__}); stoa "
                              "plays single-agent tasksets only")
    if default_harness_id(env) != "bash":
        raise TaskPluginError(f"vf:{env}: the taskset ships its own harness; stoa plays a plain chat with the "
                              "taskset's toolsets and cannot run another agent program")
    if cls.task_type().NEEDS_CONTAINER:
        raise TaskPluginError(f"vf:{env}: its tasks need a container; stoa runs no sandboxes")


def _is_network(e: BaseException) -> bool:
    return isinstance(e, ConnectionError | TimeoutError) or any(
        w in type(c).__name__ for c in type(e).__mro__ for w in _NETWORK_ERRORS)


def _read(env: str, taskset: Any, limit: int) -> list[Any]:
    """The taskset's tasks (``limit`` caps an infinite one); a failed load is one line."""
    if not taskset.bounded and limit <= 0:
        raise TaskOptionError(f"vf:{env}: the taskset is infinite; give limit=N to read its first N tasks")
    view = taskset.take(limit) if limit > 0 else taskset
    try:
        tasks = list(view)
    except Exception as e:  # noqa: BLE001 - the taskset's load(): data or network, reported as one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if _is_network(e):
            raise TaskDataError(f"vf:{env}: loading the taskset needs the network ({type(e).__name__}: {first}); "
                                "fetch its data where the network is reachable and point the taskset at the local "
                                "copy (arg=KEY:PATH)") from None
        raise TaskPluginError(f"vf:{env}: the taskset's load() failed ({type(e).__name__}: {first}); fix the "
                              "environment or its options") from None
    if not tasks:
        raise TaskDataError(f"vf:{env}: the taskset yields no tasks (no dataset); check its options (arg=...)")
    return tasks


def _check_scoring(env: str, task: Any) -> None:
    """Refuse rewards, metrics or judges stoa cannot run: those that need a runtime, and LLM judges."""
    if task.config.judges:
        raise TaskPluginError(f"vf:{env}: the task config names judges (LLM calls); stoa's rewards must be "
                              "computed locally and identically on every machine")
    for fn in (*task.hooks("reward"), *task.hooks("metric")):
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            raise TaskPluginError(f"vf:{env}: {fn.__name__} needs a runtime (a sandbox); stoa scores from the "
                                  "transcript only")


def load_env(env: str, args: Sequence[str], limit: int) -> Loaded:
    """Import a taskset, build its config from ``key:value`` args, and read its tasks.

    Args:
        env: the taskset id.
        args: ``key:value`` config fields.
        limit: the most tasks to read (0: all).

    Raises:
        TaskPluginError: not installed, not a taskset, or not playable by stoa (the message names the fix).
        TaskOptionError: a bad config field or value.
        TaskDataError: the load needs the network, or yields nothing.
    """
    importlib.invalidate_caches()
    module, cls = _import(env)
    _check_shape(env, cls)
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import taskset_config_type

    fields = parse_args(env, args)
    try:
        config = taskset_config_type(env).model_validate({**fields, "id": env})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise TaskOptionError(f"vf:{env}: option arg={where}:...: {err['msg']} (given {err.get('input')!r}); "
                              "arg=key:value sets a field of the taskset's config") from None
    try:
        taskset = cls(config)
    except Exception as e:  # noqa: BLE001 - the taskset's constructor, one line
        if _is_network(e):
            raise TaskDataError(f"vf:{env}: building the taskset needs the network ({type(e).__name__}: "
                                f"{str(e)[:200]}); use a local copy of its data") from None
        raise TaskPluginError(f"vf:{env}: building the taskset failed ({type(e).__name__}: {str(e)[:200]})") from None
    tasks = _read(env, taskset, limit)
    _check_scoring(env, tasks[0])
    servers = [*cls.toolsets(config), *type(tasks[0]).toolsets(tasks[0].config)]
    return Loaded(module=module, tasks=tasks, servers=servers)
