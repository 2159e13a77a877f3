"""The same reward and tool code on every machine: a task plugin's identity, recorded and checked.

The trainer re-scores every record and replays every tool call, so a worker whose plugin computes other rewards
would look like a liar. The trainer records, in the run contract's ``task_code``, each module a task's rewards
depend on beyond stoa itself (the class of a ``module:Class`` or entry-point task, a dataset task's reward
functions, the reasoning-gym or verifiers package): its import name, the distribution that installs it and its
version, and a SHA-256 over its Python source. A worker or evaluator checks its own copy against that record
*before* importing it (the digest is computed from the files, not from the imported module), and refuses with
one line naming the ``pip install`` that fixes it (``TaskCodeMismatch``, exit 16).

The contract is untrusted (signed runs aside): a forged one could name another installed module. A worker
therefore imports only modules whose source matches the record and that are neither part of Python's standard
library nor stoa's own internals; the worst a forged contract can do is make a worker import code its owner
installed. Workers never run code that comes from the bucket.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TaskCode", "TaskCodeMismatch", "check_task_code", "from_contract", "identify", "pip_requirement",
           "task_code", "task_modules", "working_dir_on_path"]

MAX_SOURCE_FILES = 20_000
"""Most ``.py`` files hashed for one package (reasoning-gym has ~600)."""


class TaskCodeMismatch(RuntimeError):
    """This machine's copy of a task plugin is missing or differs from the run's; the message names the
    ``pip install`` that fixes it (exit 16)."""


@dataclass(frozen=True)
class TaskCode:
    """One module a task's rewards or tools depend on, as the trainer had it."""

    module: str
    """Top-level import name (``my_rewards``, ``reasoning_gym``)."""
    dist: str
    """The distribution that installs it (``my-task``), or "" for a loose module on the path."""
    version: str
    """That distribution's version, or ""."""
    sha256: str
    """SHA-256 over the module's Python source: every ``.py`` file of the package, by relative path."""

    def to_dict(self) -> dict[str, str]:
        """The contract's JSON form."""
        return {"module": self.module, "dist": self.dist, "version": self.version, "sha256": self.sha256}


def working_dir_on_path() -> None:
    """Let plugins be files in the working directory (as ``python -m`` finds them): it joins ``sys.path`` last."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _source_files(module: str) -> tuple[Path, list[Path]] | None:
    """(root, the ``.py`` files) of an installed top-level module, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        roots = [Path(p) for p in spec.submodule_search_locations]
        files = sorted({f for r in roots for f in r.rglob("*.py") if "__pycache__" not in f.parts})
        return (roots[0], files[:MAX_SOURCE_FILES + 1]) if files else None  # a removed package's stale spec
    if spec.origin and spec.origin.endswith(".py") and Path(spec.origin).is_file():
        origin = Path(spec.origin)
        return origin.parent, [origin]
    return None


def _digest(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        name = f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name
        data = f.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _distribution(module: str) -> tuple[str, str]:
    """(distribution, version) that installs a top-level module, or ("", "") for a loose module."""
    dists = importlib.metadata.packages_distributions().get(module, [])
    if not dists:
        return "", ""
    try:
        return dists[0], importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return dists[0], ""


def identify(module: str) -> TaskCode | None:
    """This machine's identity of a module (its top-level package), or None when it is not installed.

    Args:
        module: an import name; only its top-level part counts (``my_task.rewards`` -> ``my_task``).
    """
    top = module.split(".")[0]
    working_dir_on_path()  # a loose module is found where the trainer found it: the working directory
    found = _source_files(top)
    if found is None:
        return None
    dist, version = _distribution(top)
    return TaskCode(top, dist, version, _digest(*found))


def pip_requirement(code: TaskCode) -> str:
    """What installs the recorded code: ``pip install 'dist==version'``, or the file to copy for a loose module.

    Args:
        code: the contract's record.
    """
    if code.dist and code.version:
        return f"pip install '{code.dist}=={code.version}'"
    if code.dist:
        return f"pip install '{code.dist}'"
    return f"copy the trainer's {code.module}.py (sha256 {code.sha256[:12]}...) into the working directory"


def _refusal(code: TaskCode) -> str | None:
    """Why this machine may not use the recorded module, or None when its copy is the same."""
    top = code.module
    if top in sys.stdlib_module_names or top == "stoa" or not top.isidentifier():
        return f"the run names {top!r} as task code, which is not a task plugin; the contract is forged"
    mine = identify(top)
    if mine is None:
        return f"the run's task needs {top!r}, which is not installed here; {pip_requirement(code)}"
    if mine.sha256 != code.sha256:
        here = f"{mine.dist} {mine.version}".strip() or "a loose module"
        theirs = f"{code.dist} {code.version}".strip() or "a loose module"
        return (f"the run's task code {top!r} differs here ({here}, sha256 {mine.sha256[:12]}...) from the "
                f"trainer's ({theirs}, sha256 {code.sha256[:12]}...); {pip_requirement(code)}")
    return None


def task_modules(task: object) -> tuple[str, ...]:
    """The top-level modules outside stoa that a task's rewards and tools depend on: its class's module and what
    the task names in ``code_modules()`` (a dataset task's reward functions, ``reasoning_gym``).

    Args:
        task: a built task.
    """
    named: Callable[[], tuple[str, ...]] = getattr(task, "code_modules", lambda: ())
    mods = [type(task).__module__, *named()]
    return tuple(dict.fromkeys(m.split(".")[0] for m in mods if m.split(".")[0] not in ("stoa", "__main__")))


def task_code(task: object) -> tuple[TaskCode, ...]:
    """What the trainer records in the contract's ``task_code`` for a task (``()`` for a built-in).

    Args:
        task: a built task (its modules are imported, so each is found).
    """
    found = [identify(m) for m in task_modules(task)]
    return tuple(c for c in found if c is not None)


def check_task_code(recorded: tuple[TaskCode, ...]) -> None:
    """Refuse to build the run's task unless every recorded module is installed here with the same source.

    Call it before ``get_task``: nothing is imported before its digest matches.

    Args:
        recorded: the contract's ``task_code``.

    Raises:
        TaskCodeMismatch: a module missing, different, or not a plugin (the first one, named with its fix).
    """
    for code in recorded:
        problem = _refusal(code)
        if problem is not None:
            raise TaskCodeMismatch(problem)


def from_contract(entries: Sequence[Mapping[str, str]]) -> tuple[TaskCode, ...]:
    """The contract's ``task_code`` (already type-checked by ``stoa.contract``) as ``TaskCode`` records.

    Args:
        entries: ``RunContract.task_code``.
    """
    return tuple(TaskCode(e["module"], e["dist"], e["version"], e["sha256"]) for e in entries)
