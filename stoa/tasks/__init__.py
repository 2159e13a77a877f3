"""Tasks: prompts addressed by stable ids and exact reward functions, shared by workers and trainer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from stoa.tasks.arithmetic import ArithmeticTask
from stoa.tasks.base import Prompt, PromptIdError, Task, TaskDataError, TaskOptionError, coerce_options
from stoa.tasks.extract import answers_match, extract_answer, normalize_number
from stoa.tasks.gsm8k import GSM8KTask
from stoa.tasks.multiturn import MultiTurnTask, episode_limits, is_multiturn
from stoa.tasks.search import SearchTask
from stoa.tasks.searchqa import SearchQATask
from stoa.tasks.toy import ToyTask
from stoa.tasks.walk import WalkTask

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "GSM8KTask",
    "MultiTurnTask",
    "Prompt",
    "PromptIdError",
    "SearchQATask",
    "SearchTask",
    "Task",
    "TaskClass",
    "TaskDataError",
    "TaskOptionError",
    "ToyTask",
    "WalkTask",
    "answers_match",
    "episode_limits",
    "extract_answer",
    "get_task",
    "is_multiturn",
    "load_task",
    "normalize_number",
    "parse_task_spec",
]

TaskClass = (type[ArithmeticTask] | type[GSM8KTask] | type[ToyTask] | type[SearchTask] | type[SearchQATask]
             | type[WalkTask])
"""The registered task classes (each declares its options, name -> type, in ``OPTIONS``)."""

# Task name -> class.
TASKS: dict[str, TaskClass] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "search": SearchTask,
    "searchqa": SearchQATask,
    "toy": ToyTask,
    "walk": WalkTask,
}


def _task_class(name: str) -> TaskClass:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None


def get_task(name: str, **options: object) -> Task:
    """Build a task by name.

    Args:
        name: a key of ``TASKS`` ("arithmetic", "gsm8k", "search", "searchqa", "toy", "walk").
        **options: the task's options; strings are converted to the option's type ("2" -> 2).

    Raises:
        ValueError: unknown task (the message lists the known ones), unknown option or bad value
            (the message names the option).
        TaskOptionError: an option names a missing or malformed file, or has a bad value (a ``ValueError``).
        TaskDataError: the task's data cannot be fetched (a hub dataset without network).
    """
    cls = _task_class(name)
    kwargs = coerce_options(name, cls.OPTIONS, options)
    try:
        return cls(**kwargs)
    except TaskDataError:
        raise
    except (ValueError, FileNotFoundError) as e:  # a task's constructor reports its data and options so
        raise TaskOptionError(str(e)) from e


def parse_task_spec(spec: str) -> tuple[str, dict[str, object]]:
    """Parse "name" or "name:key=value,key=value" into (name, options with coerced types).

    The value is everything after the first "=" up to the next ",", with surrounding spaces
    removed, so values cannot contain commas. Example: "arithmetic:digits=2,ops=+-" ->
    ("arithmetic", {"digits": 2, "ops": "+-"}).

    Args:
        spec: the task spec string, e.g. from a command line.

    Raises:
        ValueError: unknown task, malformed item, repeated, unknown or badly typed option.
    """
    name, sep, rest = spec.strip().partition(":")
    name = name.strip()
    cls = _task_class(name)
    raw: dict[str, object] = {}
    if sep and rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"task spec {spec!r}: expected key=value, got {item.strip()!r}")
            if key in raw:
                raise ValueError(f"task spec {spec!r}: option {key!r} given twice")
            raw[key] = value.strip()
    return name, coerce_options(name, cls.OPTIONS, raw)


def check_file_options(name: str, options: Mapping[str, object]) -> None:
    """Refuse a file option (``FILE_OPTIONS``: ``gsm8k:path=...``) that names no file here, before anything
    loads, so a typo is one line even in a dry run; a ``bucket:`` reference (a run's copy) is not looked at.

    Args:
        name: the task name.
        options: its parsed options.

    Raises:
        TaskOptionError: a file option names no existing file or directory.
    """

    for option in getattr(TASKS.get(name), "FILE_OPTIONS", ()):
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
