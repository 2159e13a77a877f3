"""Tasks: prompts addressed by stable ids and exact reward functions, shared by workers and trainer.

Which class a task name means (built-ins, adapters, plugins): ``stoa.tasks.registry``."""

from __future__ import annotations

from stoa.tasks.arithmetic import ArithmeticTask
from stoa.tasks.base import (
    Prompt,
    PromptIdError,
    RewardError,
    RewardFunctionError,
    Task,
    TaskDataError,
    TaskOptionError,
    TaskPluginError,
)
from stoa.tasks.extract import answers_match, extract_answer, normalize_number
from stoa.tasks.gsm8k import GSM8KTask
from stoa.tasks.multiturn import MultiTurnTask, episode_limits, is_multiturn
from stoa.tasks.registry import (
    ADAPTERS,
    TASKS,
    check_file_options,
    get_task,
    known_tasks,
    load_task,
    parse_task_spec,
    task_class,
    task_name,
)
from stoa.tasks.search import SearchTask
from stoa.tasks.searchqa import SearchQATask
from stoa.tasks.toy import ToyTask
from stoa.tasks.walk import WalkTask

__all__ = [
    "ADAPTERS",
    "TASKS",
    "ArithmeticTask",
    "GSM8KTask",
    "MultiTurnTask",
    "Prompt",
    "PromptIdError",
    "RewardError",
    "RewardFunctionError",
    "SearchQATask",
    "SearchTask",
    "Task",
    "TaskDataError",
    "TaskOptionError",
    "TaskPluginError",
    "ToyTask",
    "WalkTask",
    "answers_match",
    "check_file_options",
    "episode_limits",
    "extract_answer",
    "get_task",
    "is_multiturn",
    "known_tasks",
    "load_task",
    "normalize_number",
    "parse_task_spec",
    "task_class",
    "task_name",
]
