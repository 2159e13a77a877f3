"""Schemas of the small control objects: run status, trainer lease, evaluator heartbeat, tracker handle and the
run's stored trainer configuration.

Each is one JSON object, one level deep, written whole by one writer (``to_json``) and read by anyone
(``parse``: ``stoa.untrusted`` bounds and exact types, :class:`~stoa.schemas.BadSchemaObject` naming the key).
``from_json`` is the lenient read for clients that treat a refused object as absent (``None``). Fields a
writer added later are optional, so an older writer's object still parses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from stoa.schemas import BadSchemaObject, checked, load, schema_version, versioned
from stoa.untrusted import (
    MAX_DEPTH,
    as_object,
    check_int,
    check_number,
    check_text,
    field_bool,
    field_float,
    field_int,
    field_str,
    field_text,
)

STATES = ("running", "finished", "failed")
"""The states a run status may hold."""
MAX_STATUS_BYTES = 4096
"""A status object larger than this is refused (treated as absent)."""
MAX_COUNT = 2**31 - 1
"""Largest version, step, want or worker count a status may carry."""
MAX_SECONDS = 1e12
"""Largest time or step time (seconds) a status may carry."""
MAX_FLEET_RATE = 1e9
"""Largest ``fleet_rate`` or ``use_rate`` (groups per minute) a status may carry."""
MAX_LEASE_BYTES = 64 << 10
"""Longest ``lease.json`` read (the trainer writes about 200 bytes)."""
MAX_HEARTBEAT_BYTES = 4096
"""An evaluator heartbeat larger than this is refused (anyone who can write the bucket can write it)."""
MAX_HANDLE_BYTES = 4096
"""Longest stored tracker handle read."""
MAX_CONFIG_BYTES = 1 << 20
"""Longest stored configuration read (a real one is about 3 KB)."""
CONFIG_FORMAT = "stoa-trainer-config-1"
"""The stored configuration's format tag (its version)."""
_PID = {"lo": -(1 << 31), "hi": (1 << 31) - 1}


def _dumps(obj: Any, sort_keys: bool = True) -> bytes:
    return json.dumps(versioned(asdict(obj)), sort_keys=sort_keys).encode()


@dataclass(frozen=True)
class RunStatus:
    """What ``status.json`` holds: what the trainer tells its workers (``stoa.lifecycle``).

    Args:
        state: ``running``, ``finished`` or ``failed``.
        version: the newest version the trainer published.
        updated_at: unix time of this write.
        heartbeat_at: unix time the trainer last showed it was alive (equal to ``updated_at`` here).
        wanted_groups: groups the trainer can still use from the current window (None: no backpressure).
        step_s: the trainer's last step time in seconds (workers wait at least 3x this before calling the
            heartbeat stale).
        rollouts_kept_from: the oldest rollout version retention has not deleted (a restart starts there).
        step: the run's optimizer steps so far (restarts included).
        target_steps: the run's total steps (0: unbounded; None: not said, a trainer older than this field);
            ``stoa status`` shows it with an ETA.
        workers: the workers the trainer counts live, among whom the want is shared (0: none counted yet; None:
            not said, a trainer older than this field: every worker may sample the whole want).
        fleet_rate: the live workers' summed speed in groups per minute (``stoa.trainer.rates``); a worker's
            share of the want is the want x its own speed / this (None: not said, shares by the count).
        use_rate: groups per minute the trainer can train (``groups_per_step x 60 / step_s``); workers pace to
            their share of it when the fleet is faster (None: not said, no pacing gap).
        schema: the schema version (absent in older objects: 1).
    """

    state: str
    version: int
    updated_at: float
    heartbeat_at: float
    wanted_groups: int | None = None
    step_s: float = 0.0
    rollouts_kept_from: int = 1
    step: int = 0
    target_steps: int | None = None
    workers: int | None = None
    fleet_rate: float | None = None
    use_rate: float | None = None
    schema: int = 1

    SCHEMA = 1

    def to_json(self) -> bytes:
        """Serialize for the bucket (no ``fleet_rate`` or ``use_rate`` key when None: written as before them)."""
        d = asdict(self)
        for k in ("fleet_rate", "use_rate"):
            if d[k] is None:
                del d[k]
        return json.dumps(versioned(d), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, key: str = "status.json") -> RunStatus:
        """Parse untrusted bytes (at most 4 KiB, one level deep, exact types).

        Args:
            data: the stored bytes.
            key: the object's key, for the message.

        Raises:
            BadSchemaObject: not a run status (names the key and the field).
        """
        d = load(data, key, max_bytes=MAX_STATUS_BYTES, max_depth=1)
        return checked(key, lambda: cls._fields(d, schema_version(d, key, cls.SCHEMA)))

    @classmethod
    def _fields(cls, d: dict[str, Any], schema: int) -> RunStatus:
        state = field_str(d, "state", max_len=16)
        if state not in STATES:
            raise ValueError(f"state {state!r}")

        def count(name: str, absent: int | None) -> int | None:  # absent in a status of an older trainer
            return absent if d.get(name) is None else field_int(d, name, hi=MAX_COUNT)

        def rate(name: str) -> float | None:  # absent in a status of an older trainer
            return None if d.get(name) is None else field_float(d, name, bound=MAX_FLEET_RATE)

        return cls(state, field_int(d, "version", hi=MAX_COUNT), field_float(d, "updated_at", bound=MAX_SECONDS),
                   field_float(d, "heartbeat_at", bound=MAX_SECONDS), count("wanted_groups", None),
                   field_float(d, "step_s", bound=MAX_SECONDS), field_int(d, "rollouts_kept_from", hi=MAX_COUNT),
                   count("step", 0) or 0, count("target_steps", None), count("workers", None),
                   rate("fleet_rate"), rate("use_rate"), schema)

    @classmethod
    def from_json(cls, data: bytes) -> RunStatus | None:
        """:meth:`parse`, or ``None`` for anything refused (workers read a malformed status as absent).

        Args:
            data: the stored bytes.
        """
        try:
            return cls.parse(data)
        except ValueError:
            return None


@dataclass(frozen=True)
class LeaseRecord:
    """The content of ``trainer/lease.json`` (``stoa.trainer.lease``).

    Args:
        holder: random id of the holding trainer process.
        host: its host name.
        pid: its process id on that host.
        started: when it took the lease (unix time).
        heartbeat: its last renewal (unix time, the holder's clock).
        epoch: bumped at every take-over.
        model: the ``--model`` the holder was started with (a restart without ``--model`` reuses it).
        released: the holder stopped cleanly; anyone may take the lease.
        schema: the schema version (absent in older objects: 1).
    """

    holder: str
    host: str
    pid: int
    started: float
    heartbeat: float
    epoch: int
    model: str = ""
    released: bool = False
    schema: int = 1

    SCHEMA = 1

    def to_json(self) -> bytes:
        """Encode as JSON."""
        return _dumps(self)

    @classmethod
    def parse(cls, data: bytes, key: str = "lease.json") -> LeaseRecord:
        """Parse untrusted bytes (at most 64 KiB, one object deep, exact types: a pid or epoch is an integer,
        times are finite numbers, ``released`` a boolean).

        Args:
            data: the object's bytes.
            key: the object's key, for the message.

        Raises:
            BadSchemaObject: not a lease (names the key and the field).
        """
        d = load(data, key, max_bytes=MAX_LEASE_BYTES, max_depth=1)
        schema = schema_version(d, key, cls.SCHEMA)
        return checked(key, lambda: cls(
            holder=field_text(d, "holder", max_len=256), host=field_text(d, "host", max_len=256),
            pid=field_int(d, "pid", **_PID), started=check_number(d.get("started"), "started"),
            heartbeat=check_number(d.get("heartbeat"), "heartbeat"), epoch=field_int(d, "epoch", hi=1 << 62),
            model=field_str(d, "model", max_len=4096, default=""),
            released=field_bool(d, "released", default=False), schema=schema))

    @classmethod
    def from_json(cls, data: bytes) -> LeaseRecord | None:
        """:meth:`parse`, or ``None`` when the bytes are not a lease: a trainer treats a refused lease like a
        stale one (``--take-over`` replaces it); ``stoa status`` shows no holder.

        Args:
            data: the object's bytes.
        """
        try:
            return cls.parse(data)
        except ValueError:
            return None


@dataclass(frozen=True)
class EvaluatorHeartbeat:
    """What ``evaluator.json`` holds (``stoa.lifecycle``).

    Args:
        time: unix time of this write (the evaluator's clock).
        host: the evaluator's host name.
        pid: its process id.
        version: the newest version it evaluated (None before the first).
        stopped: True once the evaluator exited (then it is not present, whatever the time).
        schema: the schema version (absent in older objects: 1).
    """

    time: float
    host: str
    pid: int
    version: int | None = None
    stopped: bool = False
    schema: int = 1

    SCHEMA = 1

    def to_json(self) -> bytes:
        """Serialize for the bucket."""
        return _dumps(self)

    @classmethod
    def parse(cls, data: bytes, key: str = "evaluator.json") -> EvaluatorHeartbeat:
        """Parse untrusted bytes (at most 4 KiB, one object deep, exact types).

        Args:
            data: the stored bytes.
            key: the object's key, for the message.

        Raises:
            BadSchemaObject: not an evaluator heartbeat (names the key and the field).
        """
        d = load(data, key, max_bytes=MAX_HEARTBEAT_BYTES, max_depth=1)
        schema, done = schema_version(d, key, cls.SCHEMA), d.get("version")
        return checked(key, lambda: cls(
            check_number(d.get("time"), "time"), field_text(d, "host", max_len=256), field_int(d, "pid", **_PID),
            None if done is None else check_int(done, "version"), field_bool(d, "stopped", default=False), schema))

    @classmethod
    def from_json(cls, data: bytes) -> EvaluatorHeartbeat | None:
        """:meth:`parse`, or ``None`` for anything refused: a trainer then runs its own evaluations.

        Args:
            data: the stored bytes.
        """
        try:
            return cls.parse(data)
        except ValueError:
            return None


@dataclass(frozen=True)
class TrackerHandle:
    """What ``trackers/<name>.json`` holds: the owner's experiment-tracker run to resume (``stoa.telemetry.trackers``).

    Args:
        id: the tracker's run id.
        project: its project (None: the default).
        entity: its entity (None: the default).
        schema: the schema version (absent in older objects: 1).
    """

    id: str
    project: str | None = None
    entity: str | None = None
    schema: int = 1

    SCHEMA = 1

    def to_json(self) -> bytes:
        """Serialize for the bucket."""
        return _dumps(self, sort_keys=False)

    @classmethod
    def parse(cls, data: bytes, key: str = "tracker id") -> TrackerHandle:
        """Parse untrusted bytes (at most 4 KiB, one object deep; the id at most 128 characters, project and
        entity 256 or null).

        Args:
            data: the stored bytes.
            key: the object's key (or file), for the message.

        Raises:
            BadSchemaObject: not a tracker handle (names the key and the field).
        """
        d = load(data, key, max_bytes=MAX_HANDLE_BYTES, max_depth=1)
        schema = schema_version(d, key, cls.SCHEMA)

        def text(name: str) -> str | None:
            return None if d.get(name) is None else check_text(d[name], name, max_len=256)

        return checked(key, lambda: cls(field_text(d, "id", max_len=128), text("project"), text("entity"), schema))


@dataclass(frozen=True)
class StoredConfig:
    """What ``config.json`` holds: the run's resolved trainer settings (``stoa.trainer.resume``).

    Args:
        settings: setting name -> JSON value (typed against ``TrainerConfig`` by its reader).
        created_at: unix time of the write (None: not a number).
        format: the format tag, the schema's version (:data:`CONFIG_FORMAT`).
    """

    settings: dict[str, Any]
    created_at: float | None = None
    format: str = CONFIG_FORMAT

    def to_json(self) -> bytes:
        """Serialize for the bucket (indented, sorted keys)."""
        return json.dumps({"format": self.format, "created_at": self.created_at, "settings": self.settings},
                          sort_keys=True, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, key: str = "config.json") -> StoredConfig:
        """Parse untrusted bytes (at most 1 MiB, bounded depth; the format tag :data:`CONFIG_FORMAT`, ``settings``
        an object; ``created_at`` is informational and kept only when it is a number).

        Args:
            data: the stored bytes.
            key: the object's key, for the message.

        Raises:
            BadSchemaObject: not a stored trainer configuration (names the key).
        """
        d = load(data, key, max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_DEPTH)
        if d.get("format") != CONFIG_FORMAT:
            raise BadSchemaObject(key, f"has format {str(d.get('format'))[:40]!r}, not {CONFIG_FORMAT!r}")
        settings = checked(key, lambda: as_object(d.get("settings"), "settings"))
        at = d.get("created_at")
        return cls(settings, float(at) if isinstance(at, int | float) and not isinstance(at, bool) else None)
