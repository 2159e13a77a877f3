"""What ``stoa join`` checks before it starts a worker: engine, BLAS, memory tier, disk, bucket, contract, task code,
retriever.

Each check returns a :class:`Check` (one printed line; a failing one names its fix and the exit code of its
kind, as in ``stoa.cli.EXIT_CODES``). Nothing here imports torch or mlx: engines are probed with
``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from stoa.bucket import BucketError, CredentialsError, ObjectNotFound, open_bucket
from stoa.contract import ContractMismatch, RunContract
from stoa.engines.mlx_blas import blas_status
from stoa.envs.base import ToolUnavailable
from stoa.join.card import JoinCard
from stoa.layout import contract_key
from stoa.lifecycle import read_status
from stoa.retrieval.client import HTTPSearcher, RetrieverError
from stoa.tasks import code as task_code
from stoa.untrusted import BadBucketObject
from stoa.worker.tiers import choose_tier

MIN_FREE_GB = 2.0
"""Free disk the stoa cache needs at least (model config and tokenizer, a search task's index, logs)."""
ENGINE_PACKAGES = {"torch": ("torch", "transformers"), "mlx": ("mlx", "mlx_lm")}
"""Python packages each engine imports."""
EXIT_BAD_SETUP, EXIT_CONTRACT, EXIT_BUCKET, EXIT_TIMEOUT, EXIT_CREDENTIALS, EXIT_BAD_OBJECT = 2, 3, 4, 5, 9, 13
EXIT_TASK_CODE = 16
"""Exit codes of failed checks, the kinds of ``stoa.cli.EXIT_CODES``."""


class Check(NamedTuple):
    """One check's outcome: one printed line.

    Attributes:
        name: what was checked (``engine``, ``bucket``, ...).
        status: ``ok``, ``warn`` (works, but slower or degraded) or ``fail`` (join refuses).
        detail: what was found.
        fix: for ``warn``/``fail``, the one thing to do.
        code: the exit code when it fails.
    """

    name: str
    status: str
    detail: str
    fix: str = ""
    code: int = 0

    def line(self) -> str:
        """The printed line: status, name, detail, and the fix when there is one."""
        fix = f"; fix: {self.fix}" if self.fix and self.status != "ok" else ""
        return f"[join] {self.status:<4} {self.name:<10} {self.detail}{fix}"


def _ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def _fail(name: str, detail: str, fix: str, code: int) -> Check:
    return Check(name, "fail", detail, fix, code)


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "?"


def check_engine(engine: str, find: Callable[[str], object] = importlib.util.find_spec) -> Check:
    """The engine's packages are installed (probed without importing them).

    Args:
        engine: ``mlx`` or ``torch`` (``stoa.engines.factory.default_engine``).
        find: the module probe (tests replace it).
    """
    packages = ENGINE_PACKAGES[engine]
    missing = [p for p in packages if find(p) is None]
    if missing:
        return _fail("engine", f"{engine}: {', '.join(missing)} not installed",
                     "pip install 'stoa[worker]' in this environment", EXIT_BAD_SETUP)
    where = "Apple silicon" if engine == "mlx" else f"{platform.system()} {platform.machine()}"
    return _ok("engine", f"{engine} {_version(packages[0])} ({where})")


def check_blas(engine: str, system: str | None = None) -> Check:
    """MLX on Linux should use MKL, not the wheel's reference BLAS (a warning, never a refusal).

    Args:
        engine: the engine the worker will use.
        system: ``platform.system()`` (tests pass another).
    """
    if engine != "mlx" or (system or platform.system()) != "Linux":
        return _ok("blas", "not needed" if engine != "mlx" else "Metal/Accelerate")

    status = blas_status()
    if status.startswith("reference"):
        return Check("blas", "warn", "MLX uses the reference BLAS (4-16x slower)", "pip install mkl")
    return _ok("blas", status)


def check_tier(n_samples: int, engine: str = "auto") -> Check:
    """The memory tier and the decode batch the worker will use for the run's group size.

    Args:
        n_samples: the run's n.
        engine: the worker's engine (a torch worker on CUDA sizes from the GPU's free memory).
    """

    try:
        c = choose_tier(n_samples=n_samples, engine=engine)
    except (ValueError, RuntimeError) as e:
        return _fail("tier", str(e), "set STOA_MEMORY_GB to this machine's memory in GB", EXIT_BAD_SETUP)
    tier = f"{c.tier_gb:g} GB tier" if c.tier_gb else "below the 8 GB tier"
    return _ok("tier", f"{c.memory_gb:.1f} GB {c.memory_kind} ({c.memory_source}), {tier}: decode batch "
                       f"{c.decode_batch} rows ({c.groups_in_flight} groups x n={c.n_samples})")


def cache_dir() -> Path:
    """Where the worker keeps model files and indexes: ``$STOA_CACHE`` or ``~/.cache/stoa``."""
    env = os.environ.get("STOA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stoa"


def check_disk(path: Path | None = None, min_free_gb: float = MIN_FREE_GB) -> Check:
    """Free disk where the model cache lives (its nearest existing parent).

    Args:
        path: the cache directory (default :func:`cache_dir`).
        min_free_gb: the least free space accepted.
    """
    where = path or cache_dir()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 1e9
    if free_gb < min_free_gb:
        return _fail("disk", f"{free_gb:.1f} GB free at {where} (needs {min_free_gb:g} GB)",
                     "free space there or point STOA_CACHE at a larger disk", EXIT_BAD_SETUP)
    return _ok("disk", f"{free_gb:.1f} GB free at {where}")


class BucketProbe(NamedTuple):
    """What :func:`check_bucket` found.

    Attributes:
        check: the bucket check.
        contract: the run's contract (None when the check failed).
        state: the run's state from its status (None before the trainer's first status).
    """

    check: Check
    contract: RunContract | None = None
    state: str | None = None


def check_bucket(card: JoinCard, env: Mapping[str, str]) -> BucketProbe:
    """The bucket answers with these credentials and holds the run's contract.

    Args:
        card: the join card.
        env: variables (environment and ``--env`` file merged).
    """
    missing = [n for n in card.credentials if not env.get(n)]
    if missing:
        return BucketProbe(_fail("bucket", f"{', '.join(missing)} not set", "pass --env FILE (written by stoa "
                                 "join-card --with-secrets) or export the variables", EXIT_CREDENTIALS))
    try:
        bucket = open_bucket(card.bucket, env, create=False, retry_seconds=10.0)
        data = bucket.get(contract_key(card.run))
        status = read_status(bucket, card.run)
    except ObjectNotFound:
        return BucketProbe(_fail("bucket", f"run {card.run!r} not found in {card.bucket}",
                                 "start the trainer first, or ask for the card of a live run", EXIT_BUCKET))
    except (BucketError, ValueError) as e:
        code = EXIT_CREDENTIALS if isinstance(e, CredentialsError) else EXIT_BUCKET
        return BucketProbe(_fail("bucket", str(e).splitlines()[0], "check the URL, the credentials and the "
                                 "network", code))
    try:
        contract = RunContract.from_json(data, contract_key(card.run))
    except BadBucketObject as e:
        return BucketProbe(_fail("bucket", f"run {card.run!r}: {e.key} {e.problem}", e.fix, EXIT_BAD_OBJECT))
    except (ValueError, ContractMismatch) as e:
        return BucketProbe(_fail("bucket", f"run {card.run!r}: {e}", "install the stoa version the trainer runs",
                                 EXIT_CONTRACT))
    return BucketProbe(_ok("bucket", f"{card.bucket} answers; run {card.run!r} found"), contract,
                       status.state if status else None)


def check_contract(card: JoinCard, contract: RunContract, state: str | None) -> Check:
    """The run is the one the card describes (fingerprint, n, plane, task) and still running.

    Args:
        card: the join card.
        contract: the run's contract from the bucket.
        state: the run's state from its status (None before the trainer's first status).
    """
    differ = [name for name, ours, theirs in (("n_samples", card.n_samples, contract.n_samples),
                                              ("plane", card.plane, contract.plane),
                                              ("task", card.task, contract.task_id),
                                              ("contract", card.contract, contract.fingerprint()))
              if ours != theirs]
    if differ:
        return _fail("contract", f"the run differs from the card in {', '.join(differ)}",
                     "ask the operator for a new card (stoa join-card)", EXIT_CONTRACT)
    if state in ("finished", "failed"):
        return _fail("contract", f"run {card.run!r} is {state}", "ask for the card of a live run", EXIT_CONTRACT)
    return _ok("contract", f"n={contract.n_samples}, plane {contract.plane}, task {contract.task_id}, "
                           f"state {state or 'starting'}")


def check_plugins(contract: RunContract) -> Check:
    """This machine has the run's task plugin code, the same source as the trainer's (``stoa.tasks.code``).

    Args:
        contract: the run's contract (its ``task_code``).
    """
    recorded = task_code.from_contract(contract.task_code)
    if not recorded:
        return _ok("task-code", f"built-in task {contract.task_id}")
    try:
        task_code.check_task_code(recorded)
    except task_code.TaskCodeMismatch as e:
        fix = "; ".join(task_code.pip_requirement(c) for c in recorded)
        return _fail("task-code", str(e), f"{fix} (or stoa join --install-task-code)", EXIT_TASK_CODE)
    return _ok("task-code", ", ".join(f"{c.dist or c.module} {c.version}".strip() for c in recorded))


def check_retriever(card: JoinCard, contract: RunContract) -> Check:
    """A search task's shared endpoint answers and serves the run's corpus; without one, the bucket's index.

    Args:
        card: the join card.
        contract: the run's contract (its ``retriever`` fingerprint).
    """
    fingerprint = (contract.retriever or {}).get("fingerprint") or None
    if not card.search:
        return _ok("retriever", "none needed")
    if not card.retriever:
        if fingerprint is None:
            return _fail("retriever", "the run has no index in the bucket and the card names no endpoint",
                         "ask for a card made with --retriever URL", EXIT_BAD_SETUP)
        return _ok("retriever", f"the run's index (corpus {fingerprint}) downloads from the bucket")

    try:
        health = HTTPSearcher(card.retriever, fingerprint=fingerprint, retry_seconds=5.0, timeout_s=5.0,
                              note=lambda _: None).health()
    except (ToolUnavailable, RetrieverError, ContractMismatch, ValueError, OSError) as e:
        return _fail("retriever", f"{card.retriever}: {str(e).splitlines()[0]}",
                     "start the endpoint (stoa retriever serve) or ask for a card without --retriever",
                     EXIT_TIMEOUT)
    return _ok("retriever", f"{card.retriever} serves corpus {health.get('fingerprint', fingerprint)}")
