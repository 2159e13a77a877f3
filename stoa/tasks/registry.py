"""Which class a task name means: a built-in, an installed plugin (entry point), or ``module.path:ClassName``.

A task spec is ``NAME[:key=value,...]``. ``NAME`` is looked up in this order:

1. a built-in task (``TASKS``: arithmetic, gsm8k, ...) or adapter (``ADAPTERS``: ``dataset``, ``rg``, ``vf``,
   imported only when named, since they need optional packages);
2. an entry point of the group ``stoa.tasks`` (``pip install my-task`` makes ``--task my-task`` work);
3. ``module.path:ClassName`` (the spec is then ``module.path:ClassName[:key=value,...]``), imported from the
   installed packages or the working directory.

A class declares its options as the built-ins do (``OPTIONS``: name -> bool, int, float, str, or tuple for a
repeatable option) and may name one option a bare first item fills (``POSITIONAL``: ``rg:leg_counting`` means
``rg:name=leg_counting``). What cannot be used is one line naming the fix (``TaskPluginError``, exit 14).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stoa.tasks.arithmetic import ArithmeticTask
from stoa.tasks.base import Task, TaskDataError, TaskOptionError, TaskPluginError, coerce_options
from stoa.tasks.code import working_dir_on_path
from stoa.tasks.gsm8k import GSM8KTask
from stoa.tasks.search import SearchTask
from stoa.tasks.searchqa import SearchQATask
from stoa.tasks.toy import ToyTask
from stoa.tasks.walk import WalkTask

__all__ = ["ADAPTERS", "ENTRY_POINT_GROUP", "TASKS", "check_file_options", "get_task", "known_tasks", "load_task",
           "parse_task_spec", "task_class", "task_name"]

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "search": SearchTask,
    "searchqa": SearchQATask,
    "toy": ToyTask,
    "walk": WalkTask,
}
"""The built-in tasks, name -> class (each declares its options, name -> type, in ``OPTIONS``)."""

ADAPTERS: dict[str, str] = {
    "dataset": "stoa.tasks.dataset:DatasetTask",
    "rg": "stoa.tasks.rgym:ReasoningGymTask",
    "vf": "stoa.tasks.vf:VerifiersTask",
}
"""Tasks built from other libraries' shapes (``module:Class``, imported when named): a jsonl/parquet dataset
with TRL-style reward functions, a reasoning-gym generator, a verifiers environment."""

ENTRY_POINT_GROUP = "stoa.tasks"
"""The entry-point group of installed task plugins: ``[project.entry-points."stoa.tasks"] my-task = "pkg:Cls"``."""

_NAMES: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
"""The name each task was built under, when it differs from its ``id`` (a plugin's ``module:Class``)."""
_IMPORT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_FIX = ("give a built-in task, an installed plugin's name, or module.path:ClassName of an importable class "
        "(docs/tasks.md#your-own-task)")


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_tasks() -> list[str]:
    """Every task name this machine can build: built-ins, adapters and installed plugins."""
    return sorted({*TASKS, *ADAPTERS, *_entry_points()})


def _import_class(target: str, name: str) -> type:
    """The class ``module.path:ClassName`` names; ``TaskPluginError`` naming the fix when it cannot be had."""
    module_name, _, attr = target.partition(":")
    working_dir_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None) or module_name
        raise TaskPluginError(f"task {name!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
                              f"install the package that provides {missing!r} (pip install ...), or put "
                              f"{module_name.split('.')[0]}.py in the working directory") from None
    except Exception as e:  # noqa: BLE001 - a plugin's own import-time failure, reported as one line
        raise TaskPluginError(f"task {name!r}: importing {module_name!r} failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); fix the plugin module") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise TaskPluginError(f"task {name!r}: module {module_name!r} has no class {attr!r}; {_FIX}")
    return _checked_class(cls, name)


def _checked_class(cls: type, name: str) -> type:
    """``cls`` if it can be a task: the ``Task`` methods, and ``OPTIONS`` a dict of option types when present."""
    missing = [m for m in ("get", "sample_train", "heldout", "reward", "is_correct", "spec") if
               not callable(getattr(cls, m, None))]
    if missing:
        raise TaskPluginError(f"task {name!r}: {cls.__module__}.{cls.__qualname__} is not a task: it lacks "
                              f"{', '.join(missing)}; implement the Task protocol (docs/tasks.md#your-own-task)")
    options = getattr(cls, "OPTIONS", {})
    if not isinstance(options, dict) or not all(
            isinstance(k, str) and v in (bool, int, float, str, tuple) for k, v in options.items()):
        raise TaskPluginError(f"task {name!r}: {cls.__qualname__}.OPTIONS must map option names to bool, int, "
                              "float, str or tuple")
    return cls


def task_class(name: str) -> type:
    """The class of a task name (built-in, adapter, entry point or ``module.path:ClassName``).

    Args:
        name: the task's name, as in a spec or a run contract's ``task_id``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TaskPluginError: a plugin that does not import or is not a task.
    """
    if name in TASKS:
        return TASKS[name]
    if name in ADAPTERS:
        return _import_class(ADAPTERS[name], name)
    ep = _entry_points().get(name)
    if ep is not None:
        try:
            loaded = ep.load()
        except Exception as e:  # noqa: BLE001 - a plugin's import failure is one line
            raise TaskPluginError(f"task {name!r}: its entry point {ep.value!r} does not load ({type(e).__name__}: "
                                  f"{str(e)[:200]}); reinstall the plugin (pip install ...)") from None
        if not isinstance(loaded, type):
            raise TaskPluginError(f"task {name!r}: entry point {ep.value!r} is not a class; {_FIX}")
        return _checked_class(loaded, name)
    if _IMPORT_NAME.fullmatch(name):
        return _import_class(name, name)
    raise ValueError(f"unknown task {name!r}; known tasks: {known_tasks()}, or module.path:ClassName of your own")


def get_task(name: str, /, **options: object) -> Task:
    """Build a task by name.

    Args:
        name: a task name (``task_class``).
        **options: the task's options; strings are converted to the option's type ("2" -> 2).

    Raises:
        ValueError: unknown task (the message lists the known ones), unknown option or bad value
            (the message names the option).
        TaskOptionError: an option names a missing or malformed file, or has a bad value (a ``ValueError``).
        TaskDataError: the task's data cannot be fetched (a hub dataset without network).
        TaskPluginError: a plugin that does not import or is not a task (exit 14).
    """
    cls = task_class(name)
    kwargs = coerce_options(name, getattr(cls, "OPTIONS", {}), options)
    try:
        task = cls(**kwargs)
    except (TaskDataError, TaskPluginError):
        raise
    except (ValueError, FileNotFoundError) as e:  # a task's constructor reports its data and options so
        raise TaskOptionError(str(e)) from e
    if not isinstance(task, Task) or not isinstance(getattr(task, "id", None), str):
        raise TaskPluginError(f"task {name!r}: an instance of {cls.__qualname__} lacks the attributes 'id' and "
                              "'reward_version' (str); implement the Task protocol (docs/tasks.md#your-own-task)")
    if task.id != name:
        try:
            _NAMES[task] = name
        except TypeError:  # a class with __slots__ and no __weakref__
            raise TaskPluginError(f"task {name!r}: its id is {task.id!r}; set id = {name!r} on the class (or allow "
                                  "weak references), so workers build the same task from the run contract") from None
    return task


def task_name(task: Task) -> str:
    """The name that rebuilds ``task`` with ``get_task`` (what the run contract records as ``task_id``): the
    spec's name for a task built here (``my_pkg.tasks:Quiz``), else its ``id``.

    Args:
        task: a task.
    """
    try:
        return _NAMES.get(task, task.id)
    except TypeError:
        return task.id


def _split_name(spec: str) -> tuple[str, str]:
    """(task name, the options text) of a spec; ``module.path:ClassName`` keeps its colon."""
    head, sep, rest = spec.strip().partition(":")
    head = head.strip()
    if not sep or head in TASKS or head in ADAPTERS or head in _entry_points():
        return head, rest
    cls_name, _, options = rest.partition(":")
    if _IMPORT_NAME.fullmatch(f"{head}:{cls_name.strip()}") and "=" not in cls_name:
        return f"{head}:{cls_name.strip()}", options
    return head, rest


def parse_task_spec(spec: str) -> tuple[str, dict[str, object]]:
    """Parse "name", "name:key=value,key=value" or "module.path:ClassName:key=value" into (name, options).

    The value is everything after the first "=" up to the next ",", with surrounding spaces removed, so values
    cannot contain commas. A repeatable option (declared ``tuple``) may be given more than once; a class's
    ``POSITIONAL`` option may be given as a bare first item. Example: "arithmetic:digits=2,ops=+-" ->
    ("arithmetic", {"digits": 2, "ops": "+-"}).

    Args:
        spec: the task spec string, e.g. from a command line.

    Raises:
        ValueError: unknown task, malformed item, repeated, unknown or badly typed option.
        TaskPluginError: a plugin that does not import or is not a task.
    """
    name, rest = _split_name(spec)
    cls = task_class(name)
    declared: Mapping[str, type] = getattr(cls, "OPTIONS", {})
    positional = getattr(cls, "POSITIONAL", None)
    raw: dict[str, Any] = {}
    items = [i for i in rest.split(",")] if rest.strip() else []
    for n, item in enumerate(items):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq and n == 0 and positional and key:
            key, value = positional, key
        elif not eq or not key:
            raise ValueError(f"task spec {spec!r}: expected key=value, got {item.strip()!r}")
        if key in raw and declared.get(key) is tuple:
            raw[key] = (*raw[key], value.strip())
        elif key in raw:
            raise ValueError(f"task spec {spec!r}: option {key!r} given twice")
        else:
            raw[key] = (value.strip(),) if declared.get(key) is tuple else value.strip()
    return name, coerce_options(name, declared, raw)


def check_file_options(name: str, options: Mapping[str, object]) -> None:
    """Refuse a file option (``FILE_OPTIONS``: ``gsm8k:path=...``) that names no file here, before anything
    loads, so a typo is one line even in a dry run; a ``bucket:`` reference (a run's copy) is not looked at.

    Args:
        name: the task name.
        options: its parsed options.

    Raises:
        TaskOptionError: a file option names no existing file or directory.
    """
    for option in getattr(task_class(name), "FILE_OPTIONS", ()):
        value = options.get(option)
        if isinstance(value, str) and not value.startswith("bucket:") and not Path(value).expanduser().exists():
            raise TaskOptionError(f"{name}: option {option!r}: no such file: {value}; give the path of a local "
                                  "file (jsonl)")


def load_task(spec: str) -> Task:
    """Build a task from a spec string such as "gsm8k:path=/data/gsm8k/train.jsonl".

    Args:
        spec: see `parse_task_spec`.
    """
    name, options = parse_task_spec(spec)
    return get_task(name, **options)
