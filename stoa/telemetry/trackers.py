"""Experiment trackers the metrics rows also go to: Weights & Biases and TensorBoard (``--report-to``).

Both packages are optional and probed at open: a missing one is skipped with one warning line that names
the ``pip install``. A tracker whose call raises is disabled with one warning; logging never stops training.

W&B: the trainer (source ``trainer``) creates the W&B run and keeps its id in the bucket
(``runs/<run>/trackers/wandb.json``) so a restarted trainer resumes the same W&B run; workers and other
processes log to the same project, grouped by the stoa run, each named after its source. TensorBoard:
every numeric metric as a scalar per step under ``<log_dir>/tensorboard/<source>``. Stdlib only at import.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from stoa.config.base import report_to_names
from stoa.layout import tracker_key
from stoa.schemas.control import TrackerHandle

log = logging.getLogger(__name__)

OWNERS = ("trainer", "local")
"""Sources that create (and resume) the W&B run; every other source joins the run's group."""
DEFAULT_PROJECT = "stoa"
"""W&B project when ``WANDB_PROJECT`` is not set."""
COMPLETIONS_EVERY_ENV = "STOA_WANDB_COMPLETIONS_EVERY"
"""Steps between two completions tables (default ``DEFAULT_COMPLETIONS_EVERY``; 0 turns them off)."""
DEFAULT_COMPLETIONS_EVERY = 10
COMPLETIONS_PER_TABLE = 4
"""Completions per table (the first sample of this many groups of the step)."""


class Tracker(Protocol):
    """Where metrics rows go besides the JSONL file."""

    name: str

    def log(self, row: Mapping[str, Any], step: int | None) -> None:
        """Record one metrics row (flat name -> value; non-numeric values are the tracker's to skip)."""
        ...

    def close(self) -> None:
        """Flush and finish."""
        ...


class Completion(NamedTuple):
    """One sampled completion for the completions table."""

    prompt_id: str
    text: str
    reward: float


def numeric(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a row (bools and None dropped), as floats.

    Args:
        row: flat name -> value.
    """
    return {k: float(v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class WandbTracker:
    """A W&B run: numeric metrics per step and a completions table.

    Args:
        wandb: the imported ``wandb`` module.
        run: the object ``wandb.init`` returned.
    """

    name = "wandb"

    def __init__(self, wandb: Any, run: Any) -> None:
        self.wandb, self.run = wandb, run

    def log(self, row: Mapping[str, Any], step: int | None) -> None:
        """Log the row's numbers at ``step`` (W&B's own step when None)."""
        values = numeric(row)
        if values:
            self.run.log(values, step=step)

    def log_completions(self, rows: Sequence[Completion], step: int | None) -> None:
        """Log a ``completions`` table: step, prompt id, text, reward.

        Args:
            rows: the sampled completions.
            step: the trainer step they were trained at.
        """
        table = self.wandb.Table(columns=["step", "prompt_id", "completion", "reward"],
                                 data=[[step, r.prompt_id, r.text, r.reward] for r in rows])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        """Finish the W&B run."""
        self.run.finish()


class TensorBoardTracker:
    """A TensorBoard ``SummaryWriter``: one scalar per numeric metric per step.

    Args:
        writer: a ``SummaryWriter`` (torch.utils.tensorboard or tensorboardX).
    """

    name = "tensorboard"

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, row: Mapping[str, Any], step: int | None) -> None:
        """Add a scalar per numeric metric at ``step``."""
        for key, value in numeric(row).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class TrackerSet:
    """The open trackers behind one metrics writer; a tracker whose call raises is dropped with one warning.

    Args:
        trackers: the open trackers.
        completions_every: steps between completions tables (0: never).
    """

    def __init__(self, trackers: Iterable[Tracker], completions_every: int | None = None) -> None:
        self.trackers = list(trackers)
        self.completions_every = completions_every_from_env() if completions_every is None else completions_every
        self.disabled: list[str] = []

    def _each(self, call: Callable[[Any], None], what: str, only: Callable[[Any], bool] = lambda t: True) -> None:
        for tracker in list(self.trackers):
            if not only(tracker):
                continue
            try:
                call(tracker)
            except Exception as e:  # a tracker never stops training
                self.trackers.remove(tracker)
                self.disabled.append(tracker.name)
                log.warning("%s tracker disabled after its %s failed (%s: %s); metrics still go to the JSONL "
                            "file", tracker.name, what, type(e).__name__, e)

    def log(self, row: Mapping[str, Any], step: int | None) -> None:
        """Hand one row to every tracker."""
        self._each(lambda t: t.log(row, step), "log")

    def completions_due(self, step: int) -> bool:
        """Whether a completions table is wanted at ``step`` (a tracker takes them and the step is due)."""
        return (self.completions_every > 0 and step % self.completions_every == 0
                and any(hasattr(t, "log_completions") for t in self.trackers))

    def log_completions(self, rows: Sequence[Completion], step: int | None) -> None:
        """Hand sampled completions to the trackers that keep a table."""
        self._each(lambda t: t.log_completions(rows, step), "completions table",
                   only=lambda t: hasattr(t, "log_completions"))

    def close(self) -> None:
        """Close every tracker (one that fails to close is only warned about)."""
        self._each(lambda t: t.close(), "close")
        self.trackers = []


def completions_every_from_env(env: Mapping[str, str] | None = None) -> int:
    """Steps between completions tables from ``STOA_WANDB_COMPLETIONS_EVERY`` (default 10).

    Args:
        env: environment mapping (default ``os.environ``).
    """
    raw = (os.environ if env is None else env).get(COMPLETIONS_EVERY_ENV, "").strip()
    try:
        return max(0, int(raw)) if raw else DEFAULT_COMPLETIONS_EVERY
    except ValueError:
        log.warning("%s=%r is not a whole number; using %d", COMPLETIONS_EVERY_ENV, raw, DEFAULT_COMPLETIONS_EVERY)
        return DEFAULT_COMPLETIONS_EVERY


def sample_completions(entries: Sequence[Any], decode: Callable[[Any], str],
                       k: int = COMPLETIONS_PER_TABLE) -> list[Completion]:
    """The first sample of the first ``k`` groups of a step, decoded, with the trainer's reward.

    Args:
        entries: the step's pool entries (``.record.prompt_id``, ``.record.samples[0].tokens``, ``.rewards``).
        decode: token ids -> text (the run's codec).
        k: how many completions.
    """
    rows = []
    for e in entries[:k]:
        if e.record.samples:
            rows.append(Completion(e.record.prompt_id, decode(e.record.samples[0].tokens.tolist()),
                                   float(e.rewards[0])))
    return rows


def _probe(module: str, package: str) -> Any | None:
    """Import ``module`` or warn once naming ``pip install <package>`` and return None."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install: never a crash
        log.warning("--report-to: %s is not importable (%s: %s); skipping it. Install it with: pip install %s",
                    module, type(e).__name__, e, package)
        return None


def tensorboard_modules(torch_loaded: bool) -> tuple[str, ...]:
    """SummaryWriter modules to try, lightest first: torch's when torch is already imported, else tensorboardX.

    Args:
        torch_loaded: whether this process has imported torch already.
    """
    return (("torch.utils.tensorboard", "tensorboardX") if torch_loaded
            else ("tensorboardX", "torch.utils.tensorboard"))


def open_tensorboard(log_dir: str | Path, source: str) -> TensorBoardTracker | None:
    """A TensorBoard tracker writing under ``<log_dir>/tensorboard/<source>``, or None (one warning) when
    neither torch.utils.tensorboard nor tensorboardX can be imported.

    Args:
        log_dir: the process's metrics directory.
        source: who writes (``trainer``, ``worker-<id>``, ``local``).
    """
    for module in tensorboard_modules("torch" in sys.modules):
        try:
            writer_cls = importlib.import_module(module).SummaryWriter
        except Exception:
            continue
        return TensorBoardTracker(writer_cls(log_dir=str(Path(log_dir) / "tensorboard" / source)))
    log.warning("--report-to tensorboard: neither torch.utils.tensorboard nor tensorboardX is importable; "
                "skipping it. Install it with: pip install tensorboard")
    return None


def _config_dict(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config) if isinstance(config, Mapping) else {}


class _IdStore:
    """Where the owner keeps its W&B run handle: the bucket's tracker key, else a file in the log dir."""

    def __init__(self, bucket: Any, run_id: str, log_dir: str | Path) -> None:

        self.bucket, self.key = bucket, tracker_key(run_id, "wandb")
        self.path = Path(log_dir) / "trackers" / "wandb.json"

    def load(self) -> TrackerHandle | None:
        """The stored handle (:class:`~stoa.schemas.control.TrackerHandle`); None when missing, unreadable or
        malformed (anyone may write the bucket), so a new W&B run starts."""
        try:
            raw = self.bucket.get(self.key) if self.bucket is not None else self.path.read_bytes()
            return TrackerHandle.parse(raw, self.key if self.bucket is not None else str(self.path))
        except Exception:  # missing, unreadable or malformed: start a new W&B run
            return None

    def save(self, handle: TrackerHandle) -> None:
        data = handle.to_json()
        if self.bucket is not None:
            self.bucket.put(self.key, data)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(data)


def open_wandb(*, run_id: str, source: str, bucket: Any, log_dir: str | Path, config: Any) -> WandbTracker | None:
    """A W&B tracker, or None (one warning) when wandb is missing or its run cannot start.

    The owner (``trainer``, ``local``) resumes the run whose id is stored (``resume="allow"``) or creates one
    and stores its id, project and entity; any other source joins the project grouped by ``run_id``.

    Args:
        run_id: the stoa run id (the W&B group).
        source: who writes; the W&B run's name for non-owners.
        bucket: the run's bucket (None: the owner keeps the id under ``log_dir``).
        log_dir: the process's metrics directory.
        config: the process's config (a dataclass or mapping) stored with the W&B run.
    """
    wandb = _probe("wandb", "wandb")
    if wandb is None:
        return None
    project = os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
    kw: dict[str, Any] = {"project": project, "group": run_id, "config": _config_dict(config), "resume": "allow"}
    try:
        if source not in OWNERS:
            return WandbTracker(wandb, wandb.init(name=source, job_type=source.split("-")[0], **kw))
        store = _IdStore(bucket, run_id, log_dir)
        handle = store.load()
        if handle is not None:
            kw.update(project=handle.project or project, entity=handle.entity or None)
            return WandbTracker(wandb, wandb.init(id=handle.id, name=run_id, job_type=source, **kw))
        run = wandb.init(name=run_id, job_type=source, **kw)
        store.save(TrackerHandle(run.id, getattr(run, "project", project), getattr(run, "entity", None)))
        return WandbTracker(wandb, run)
    except Exception as e:  # no login, no network, a failed store: never a crash
        log.warning("--report-to wandb: could not start the W&B run (%s: %s); skipping it", type(e).__name__, e)
        return None


def open_trackers(names: Iterable[str] | str, *, run_id: str, source: str, bucket: Any = None,
                  log_dir: str | Path, config: Any = None) -> list[Tracker]:
    """Open the named trackers; a missing package or a failed start is skipped with one warning.

    Args:
        names: tracker names (``wandb``, ``tensorboard``), or a comma-separated ``report_to`` value.
        run_id: the stoa run id.
        source: who writes: ``trainer``, ``worker-<id>``, ``local``, ``eval``.
        bucket: the run's bucket (where the trainer keeps the W&B run id); None in local mode.
        log_dir: the process's metrics directory (TensorBoard writes under ``<log_dir>/tensorboard/``).
        config: the process's config, stored with the W&B run.
    """

    wanted = report_to_names(names) if isinstance(names, str) else list(names)
    trackers: list[Tracker] = []
    for name in wanted:
        if name == "wandb":
            tracker = open_wandb(run_id=run_id, source=source, bucket=bucket, log_dir=log_dir, config=config)
        elif name == "tensorboard":
            tracker = open_tensorboard(log_dir, source)
        else:
            log.warning("--report-to: unknown tracker %r (use wandb or tensorboard); skipping it", name)
            tracker = None
        if tracker is not None:
            trackers.append(tracker)
    return trackers
