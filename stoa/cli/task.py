"""``stoa task SPEC``: build a task as a run would and score a few prompts, before any run starts.

It answers what a new task's author asks first: does my spec build, which code will every worker need, and do
my reward functions give the reference answer full marks? Nothing is written anywhere.
"""

from __future__ import annotations

import argparse
import json

from stoa.tasks import load_task, task_name
from stoa.tasks.base import Prompt, Task
from stoa.tasks.code import pip_requirement, task_code
from stoa.tasks.data import portable_task_data
from stoa.tasks.scoring import score_group


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``task`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "task", help="build a task spec as a run would and score a few held-out prompts",
        description="Build the task of SPEC (a built-in, an adapter such as dataset:... or rg:..., an installed "
                    "plugin, or module.path:ClassName), print what the run contract would record (its name, "
                    "spec and the plugin code every worker must have), and score N held-out prompts: the "
                    "reward of the reference answer and of an empty completion, through the same guard the "
                    "trainer uses. Writes nothing.")
    p.add_argument("spec", metavar="SPEC", help="task spec, e.g. 'dataset:path=problems.jsonl,reward=reward:correct'")
    p.add_argument("--n", type=int, default=3, help="held-out prompts to show and score [default: 3]")
    p.set_defaults(func=run)


def _show(task: Task, prompt: Prompt) -> str:
    """One prompt's line: id, the last message, the answer, and the rewards of the answer and of ''."""
    written = getattr(task, "reference_completion", None)  # the answer as a completion writes it, if not bare
    reference = str(written(prompt)) if callable(written) else prompt.answer
    answer, empty = score_group(task, prompt, [reference, ""])
    text = prompt.messages[-1]["content"] if prompt.messages else ""
    text = text if len(text) <= 100 else text[:97] + "..."
    shown = json.dumps(text, ensure_ascii=False)
    truth = json.dumps(prompt.answer, ensure_ascii=False)[:60]
    return f"  {prompt.id:<8} {shown}\n           answer {truth}: reward {answer:g}; an empty completion: {empty:g}"


def run(args: argparse.Namespace) -> int:
    """Print the task's contract form and a few scored prompts.

    Args:
        args: parsed arguments.
    """
    task = load_task(args.spec)
    cls = type(task)
    print(f"task {task_name(task)} ({cls.__module__}.{cls.__qualname__}), reward version {task.reward_version}")
    print(f"  spec: {json.dumps(portable_task_data(task).spec, sort_keys=True)[:400]}")
    codes = task_code(task)
    for code in codes:
        print(f"  code every worker needs: {code.module} ({pip_requirement(code)})")
    if not codes:
        print("  code every worker needs: none beyond stoa")
    prompts = task.heldout(max(args.n, 0))
    print(f"held-out prompts ({len(prompts)}):")
    for prompt in prompts:
        print(_show(task, prompt))
    return 0
