"""The bucket object types a client reads, where each is planted, and its crafted variants.

Every object is planted in a copy of a base run's bucket (:mod:`tests.hostile.bases`): either in place of the
honest object (its honest bytes are what the variants start from) or, for objects a run only may hold (a
metrics chunk, a record, an evaluator heartbeat, ...), next to the honest ones under a well-formed key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.hostile import variants as v

RUN = "r"
"""The run id of every base run."""


@dataclass(frozen=True)
class Plant:
    """One object to write: ``key`` relative to the bucket root, and its bytes."""

    key: str
    data: bytes


Locate = Callable[[Path], "list[str]"]
"""Given a bucket root, the keys (relative to it) an object type is planted at."""


def _one(pattern: str) -> Locate:
    """The newest key under ``runs/r/`` matching a glob ``pattern``."""
    def locate(bucket: Path) -> list[str]:
        found = sorted((bucket / "runs" / RUN).glob(pattern))
        assert found, f"no {pattern} in the base run"
        return [str(found[-1].relative_to(bucket))]
    return locate


def _fixed(*keys: str) -> Locate:
    return lambda bucket: [f"runs/{RUN}/{k}" for k in keys]


def _current_version(bucket: Path) -> int:
    return int(json.loads((bucket / "runs" / RUN / "weights" / "current.json").read_bytes())["version"])


def _new_record(bucket: Path) -> list[str]:
    return [f"runs/{RUN}/rollouts/v{_current_version(bucket):08d}/evil-00000000.rec"]


def _honest_record(bucket: Path) -> bytes:
    return sorted((bucket / "runs" / RUN / "rollouts").glob("v*/*.rec"))[0].read_bytes()


def _honest_chunk(bucket: Path) -> bytes:
    return sorted((bucket / "runs" / RUN / "metrics").glob("trainer-*-*.jsonl"))[0].read_bytes()


@dataclass(frozen=True)
class ObjectType:
    """A kind of bucket object and how to plant it.

    Args:
        name: the row name in the table.
        base: the base run it is planted in (``toy``, ``signed``, ``gsm8k``, ``search``).
        locate: where it goes.
        variants: the crafted variants, by name.
        honest: the honest bytes when the base run holds none at ``locate`` (else the object's own bytes).
        readers: the clients that read it (the fast matrix runs only these; the full table runs every client).
        must_refuse: clients that must not exit 0 on any variant (they would have followed the object).
    """

    name: str
    base: str
    locate: Locate
    variants: dict[str, v.Variant]
    honest: Callable[[Path], bytes] | None = None
    readers: tuple[str, ...] = ()
    must_refuse: tuple[str, ...] = field(default=())


CHEAP = ("status", "runs", "plot", "export", "join-card")
ALL_CLIENTS = ("trainer", "worker", "eval", *CHEAP)

HEARTBEAT = json.dumps({"host": "h", "pid": 7, "stopped": False, "time": 1.0e9, "version": 1}).encode()
TRACKER = json.dumps({"id": "abc123", "project": "stoa", "entity": "me"}).encode()


def _contract_path(kind: str) -> v.Variant:
    """The gsm8k contract with its task data path changed (``kind``: absolute, relative, dotdot, home); the
    ``unpinned`` kind also drops the data's digest and size, as a forger who does not know the file would."""
    def variant(original: bytes, ctx: v.PlantContext) -> bytes:
        d = json.loads(original)
        secret = ctx.canary / "secret.jsonl"
        d["task_spec"]["path"] = {"absolute": str(secret), "unpinned": str(secret),
                                  "relative": "../" * 6 + "canary/secret.jsonl",
                                  "dotdot": "bucket:../../../../canary/secret.jsonl",
                                  "home": "~/../canary/secret.jsonl"}[kind]
        if kind == "unpinned":
            for name in ("train_sha256", "n_train"):
                d["task_spec"].pop(name, None)
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return variant


KEY_PREFIXES = ("rollouts/v00000001/", "rollouts/v{cur}/", "rollouts/", "metrics/", "weights/versions/",
                "weights/anchors/", "trainer/checkpoints/", "trainer/", "")
"""Where hostile key names are planted, under ``runs/r/`` (``{cur}``: the current version, 8 digits)."""
KEY_NAMES: dict[str, str] = {
    "backslash": "w\\0-00000001.rec", "newline": "w\n0-00000001.rec", "control": "w\x01-00000001.rec",
    "dotdot": "..\\..\\x-00000001.rec", "long": "w" * 240 + "-00000001.rec", "unicode": "wé\u202e-00000001.rec",
    "dash": "-rf -00000001.rec",
}


def key_plants(bucket: Path, name: str) -> list[Plant]:
    """One small object named ``KEY_NAMES[name]`` under each of ``KEY_PREFIXES``, and a run of that name."""
    cur = f"{_current_version(bucket):08d}"
    base = KEY_NAMES[name]
    plants = [Plant(f"runs/{RUN}/{p.format(cur=cur)}{base}", b"x") for p in KEY_PREFIXES]
    return [*plants, Plant(f"runs/{base.removesuffix('.rec')}/run.json", b"{}")]


def object_types() -> list[ObjectType]:
    """Every object type of the matrix (key names are :func:`key_plants`)."""
    weights = ("worker", "eval", "export", "trainer")
    return [
        ObjectType("contract", "signed", _fixed("run.json"), v.CONTRACT_VARIANTS, readers=ALL_CLIENTS),
        ObjectType("pointer", "signed", _fixed("weights/current.json"), v.POINTER_VARIANTS,
                   readers=(*weights, "status", "runs")),
        ObjectType("pointer_unsigned_run", "toy", _fixed("weights/current.json"), v.JSON_VARIANTS,
                   readers=(*weights, "status", "runs")),
        ObjectType("patch", "toy", _one("weights/versions/v*.patch"), v.BINARY_VARIANTS, readers=weights),
        ObjectType("anchor_manifest", "toy", _one("weights/anchors/v*/manifest.json"), v.JSON_VARIANTS,
                   readers=weights),
        ObjectType("anchor_weights", "toy", _one("weights/anchors/v*/model.safetensors"), v.SAFETENSORS_VARIANTS,
                   readers=weights),
        ObjectType("checkpoint_pointer", "toy", _fixed("trainer/checkpoint.json"), v.JSON_VARIANTS,
                   readers=("trainer", "export")),
        ObjectType("journal", "toy", _fixed("trainer/journal.json"), v.JSON_VARIANTS, readers=("trainer", "status")),
        ObjectType("lease", "toy", _fixed("trainer/lease.json"), v.JSON_VARIANTS,
                   readers=("trainer", "status", "runs")),
        ObjectType("status", "toy", _fixed("status.json"), v.JSON_VARIANTS,
                   readers=("trainer", "worker", "eval", "status", "runs")),
        ObjectType("metrics_chunk", "toy",
                   _fixed("metrics/eval-1700000000-00000000.jsonl", "metrics/worker-evil-1700000000-00000000.jsonl"),
                   v.JSON_VARIANTS, honest=_honest_chunk, readers=("eval", "status", "plot")),
        ObjectType("evaluator_heartbeat", "toy", _fixed("evaluator.json"), v.JSON_VARIANTS,
                   honest=lambda b: HEARTBEAT, readers=("trainer", "status", "eval")),
        ObjectType("tracker_ids", "toy", _fixed("trackers/wandb.json"), v.JSON_VARIANTS, honest=lambda b: TRACKER,
                   readers=("trainer",)),
        ObjectType("rollout_record", "toy", _new_record, {**v.BINARY_VARIANTS, "duplicate": lambda o, c: o},
                   honest=_honest_record, readers=("trainer", "status", "plot")),
        ObjectType("task_data", "gsm8k", _one("data/*/train.jsonl"), v.JSON_VARIANTS, readers=("worker", "eval")),
        ObjectType("contract_path", "gsm8k", _fixed("run.json"),
                   {k: _contract_path(k) for k in ("absolute", "unpinned", "relative", "dotdot", "home")},
                   readers=("worker", "eval", "export", "join-card"), must_refuse=("worker", "eval")),
        ObjectType("retriever_manifest", "search", _one("retriever/*/stoa-index.json"), v.JSON_VARIANTS,
                   readers=("worker", "eval")),
    ]


def plants_for(obj: ObjectType, variant: str, bucket: Path, ctx_of: Callable[[str], v.PlantContext]) -> list[Plant]:
    """The objects to write for ``obj``'s ``variant`` in ``bucket``; [] when the variant does not apply.

    Args:
        obj: the object type.
        variant: one of ``obj.variants``.
        bucket: the cell's bucket root (a copy of the base run's).
        ctx_of: the plant context of a key.
    """
    plants = []
    for key in obj.locate(bucket):
        original = obj.honest(bucket) if obj.honest else (bucket / key).read_bytes()
        data = obj.variants[variant](original, ctx_of(key))
        if data is None:
            return []
        plants.append(Plant(key, data))
    return plants
