"""Every bucket key of a run, in the order of the "Bucket layout" table in docs/architecture.md.

This is the only module that spells a ``runs/`` key. Everything a run stores lives under
``runs/<run>/``::

    runs/<run>/run.json                                  contract (trainer, create-only, first)
    runs/<run>/config.json                               the trainer's resolved settings (trainer, before run.json)
    runs/<run>/model/<file>                              config + tokenizer files (trainer, create-only)
    runs/<run>/weights/current.json                      weight pointer (trainer, compare-and-swap, last)
    runs/<run>/weights/anchors/v<k>/{model.safetensors,manifest.json}   full checkpoint, manifest last
    runs/<run>/weights/versions/v<k>.patch               PULSE patch v<k-1> -> v<k>
    runs/<run>/weights/base/{model.safetensors,manifest.json}   a LoRA run's base, once (adapter plane; manifest last)
    runs/<run>/rollouts/v<version>/<worker>-<seq>.rec    one record per group (workers, create-only)
    runs/<run>/trainer/journal.json                      per-step journal (trainer, overwritten)
    runs/<run>/trainer/checkpoint.json                   the sharded checkpoint's pointer (trainer, overwritten, last)
    runs/<run>/trainer/checkpoints/<tag>/<file>          a sharded checkpoint (every rank a shard, rank 0 metadata)
    runs/<run>/trainer/checkpoint.safetensors            the single-file checkpoint of older trainers (read only)
    runs/<run>/trainer/lease.json                        the holding trainer (trainer, compare-and-swap)
    runs/<run>/trainer/provenance/s<step>.jsonl          trained groups' workers, verdicts (trainer, create-only)
    runs/<run>/status.json                               run status, heartbeat, wanted groups (trainer, overwritten)
    runs/<run>/workers/<worker>-<seq>                    a worker's presence (worker, create-only; trainer deletes)
    runs/<run>/identities/<name>/<public key>.json       a worker identity signed by the run key (operator, create-only)
    runs/<run>/revocations/<public key>.json             a revoked worker key, signed by the run key (create-only)
    runs/<run>/metrics/<source>-<start>-<seq>.jsonl      metrics chunks (trainer, worker-<id>, eval; create-only)
    runs/<run>/retriever/<fingerprint>/<file>            search tasks' BM25 index (create-only, stoa-index.json last)
    runs/<run>/trackers/<name>.json                      an experiment tracker's run id, e.g. W&B (trainer, overwritten)
    runs/<run>/data/<sha256>/<name>                      task data files, e.g. a GSM8K jsonl (trainer, create-only)
    runs/<run>/{metrics,logs}/                           local buckets only: files written beside the run

Versions and sequence numbers are zero-padded to 8 digits so listing order is numeric order.
Keys of untrusted origin (a listing) go through the parsers here, never through string slicing elsewhere.
Pure stdlib: both kinds of worker and the trainer import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANCHOR_FILE = "model.safetensors"
"""Object name of an anchor's weights inside its prefix."""
ANCHOR_MANIFEST = "manifest.json"
"""Object name of an anchor's manifest inside its prefix (written last: it marks the anchor complete)."""
CHECKPOINT_NAME = "checkpoint.safetensors"
"""Object name of the single-file checkpoint older trainers wrote (fp32 master weights + AdamW; still read)."""
CHECKPOINT_POINTER = "checkpoint.json"
"""Object name of the pointer to the trainer's current sharded checkpoint (written after all its files)."""
JOURNAL_NAME = "journal.json"
"""Object name of the trainer's per-step journal."""
LEASE_NAME = "lease.json"
"""Object name of the trainer's lease (one trainer per run)."""

_PATCH_NAME = re.compile(r"v([0-9]{8})\.patch")
_ANCHOR_DIR = re.compile(r"v([0-9]{8})")
_ROLLOUT_NAME = re.compile(r"v([0-9]{8})/([A-Za-z0-9][A-Za-z0-9._-]{0,127})-([0-9]{8})\.rec")
_METRICS_CHUNK = re.compile(
    r"(?P<source>[A-Za-z0-9][A-Za-z0-9._-]{0,127})-(?P<start>[0-9]{10})-(?P<seq>[0-9]{8})\.jsonl")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_IDENTITY_NAME = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})/([0-9a-f]{64})\.json")
_REVOCATION_NAME = re.compile(r"([0-9a-f]{64})\.json")
_PROVENANCE_NAME = re.compile(r"s([0-9]{8})\.jsonl")
_ROLLOUT_TAIL = re.compile(r"/rollouts/v[0-9]{8}/(?P<worker>[^/]+)-[0-9]{8}\.rec\Z")


RUNS_ROOT = "runs/"
"""Prefix of every run's keys (a listing of it finds every run of a bucket)."""


def parse_run_key(key: str) -> str | None:
    """The run id of a key ``runs/<run>/<rest>`` (both non-empty); ``None`` for any other key.

    Args:
        key: a listed key (untrusted: any string).
    """
    run_id, slash, rest = key[len(RUNS_ROOT):].partition("/") if key.startswith(RUNS_ROOT) else ("", "", "")
    return run_id if run_id and slash and rest else None


def run_prefix(run_id: str) -> str:
    """Key prefix of a run, ``runs/<run>`` (no trailing slash).

    Args:
        run_id: the run id.
    """
    return f"runs/{run_id}"


def contract_key(run_id: str) -> str:
    """Key of the run contract, ``runs/<run>/run.json``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/run.json"


def trainer_config_key(run_id: str) -> str:
    """Key of the trainer's stored configuration, ``runs/<run>/config.json`` (no secrets, no local paths).

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/config.json"


def model_prefix(run_id: str) -> str:
    """Key prefix of the model's config and tokenizer files, ``runs/<run>/model/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/model/"


def is_file_name(name: str) -> bool:
    """Whether a listed name is one a client may copy to a local file: 1-255 of letters, digits, '.', '_' or
    '-', starting with a letter, digit or '_' (every model and tokenizer file; a foreign name is skipped).

    Args:
        name: a listed name (untrusted: any string).
    """
    return _FILE_NAME.fullmatch(name) is not None


def model_file_key(run_id: str, name: str) -> str:
    """Key of one model file (e.g. ``config.json``).

    Args:
        run_id: the run id.
        name: the file name, no directories.
    """
    return model_prefix(run_id) + name


def weights_prefix(run_id: str) -> str:
    """Key prefix of a run's weight plane, ``runs/<run>/weights/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/weights/"


def pointer_key(run_id: str) -> str:
    """Key of the weight pointer, ``runs/<run>/weights/current.json``.

    Args:
        run_id: the run id.
    """
    return weights_prefix(run_id) + "current.json"


def base_prefix(run_id: str) -> str:
    """Key prefix of a LoRA run's base weights (published once, an anchor), ``runs/<run>/weights/base/``.

    Args:
        run_id: the run id.
    """
    return weights_prefix(run_id) + "base/"


def anchors_prefix(run_id: str) -> str:
    """Key prefix under which every anchor lives, ``runs/<run>/weights/anchors/``.

    Args:
        run_id: the run id.
    """
    return weights_prefix(run_id) + "anchors/"


def anchor_prefix(run_id: str, version: int) -> str:
    """Key prefix of the anchor at ``version`` (holds ``ANCHOR_FILE`` and ``ANCHOR_MANIFEST``).

    Args:
        run_id: the run id.
        version: the anchor's version.
    """
    return anchors_prefix(run_id) + f"v{version:08d}/"


@dataclass(frozen=True)
class AnchorObject:
    """One listed object of an anchor.

    Args:
        version: the anchor's version.
        name: the object name inside the anchor's prefix (may be any string, even empty).
    """

    version: int
    name: str


def parse_anchor_key(run_id: str, key: str) -> AnchorObject | None:
    """Parse ``runs/<run>/weights/anchors/v<8 digits>/<name>``; ``None`` for any other key.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = anchors_prefix(run_id)
    parts = key[len(head):].split("/") if key.startswith(head) else []
    if len(parts) == 2 and (m := _ANCHOR_DIR.fullmatch(parts[0])):
        return AnchorObject(int(m.group(1)), parts[1])
    return None


def patches_prefix(run_id: str) -> str:
    """Key prefix under which every patch lives, ``runs/<run>/weights/versions/``.

    Args:
        run_id: the run id.
    """
    return weights_prefix(run_id) + "versions/"


def patch_key(run_id: str, version: int) -> str:
    """Key of the patch from ``version - 1`` to ``version``.

    Args:
        run_id: the run id.
        version: the version the patch produces.
    """
    return patches_prefix(run_id) + f"v{version:08d}.patch"


def parse_patch_key(run_id: str, key: str) -> int | None:
    """The version a patch key produces, ``None`` when ``key`` is not a patch key of the run.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = patches_prefix(run_id)
    m = _PATCH_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return int(m.group(1)) if m else None


def rollouts_prefix(run_id: str) -> str:
    """Key prefix under which every rollout record lives, ``runs/<run>/rollouts/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/rollouts/"


def rollout_version_prefix(run_id: str, version: int) -> str:
    """Key prefix under which records sampled at ``version`` live.

    Args:
        run_id: the run id.
        version: the policy version the records were sampled with.
    """
    return rollouts_prefix(run_id) + f"v{version:08d}/"


def rollout_key(run_id: str, version: int, worker_id: str, seq: int) -> str:
    """Key of one rollout record, ``runs/<run>/rollouts/v<version>/<worker>-<seq>.rec``.

    Args:
        run_id: the run id.
        version: the policy version the group was sampled with.
        worker_id: the writing worker's id.
        seq: the worker's sequence number for this record.
    """
    return f"{rollout_version_prefix(run_id, version)}{worker_id}-{seq:08d}.rec"


@dataclass(frozen=True)
class RolloutKey:
    """The parts of a well-formed rollout key."""

    version: int
    worker_id: str
    seq: int


def parse_rollout_key(run_id: str, key: str) -> RolloutKey | None:
    """Parse ``runs/<run>/rollouts/v<8 digits>/<worker>-<8 digits>.rec``; ``None`` for any other key.

    Worker ids are 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = rollouts_prefix(run_id)
    m = _ROLLOUT_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return RolloutKey(int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def rollout_worker(key: str) -> str | None:
    """The worker id of a record key of any run (lenient: for keys already admitted), else ``None``.

    Args:
        key: e.g. ``runs/r/rollouts/v00000003/host-a1b2c3-00000042.rec`` (the id may contain ``-``).
    """
    m = _ROLLOUT_TAIL.search(key)
    return m.group("worker") if m else None


def rollout_label(key: str) -> str:
    """The ``v<version>/<worker>-<seq>.rec`` tail of a record key, as the ``rollout/keys`` metric logs it.

    Args:
        key: a record key.
    """
    return "/".join(key.rsplit("/", 2)[-2:])


def trainer_prefix(run_id: str) -> str:
    """Key prefix of the trainer's own state, ``runs/<run>/trainer/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/trainer/"


def checkpoint_key(run_id: str) -> str:
    """Key of the trainer's heavy checkpoint, ``runs/<run>/trainer/checkpoint.safetensors``.

    Args:
        run_id: the run id.
    """
    return trainer_prefix(run_id) + CHECKPOINT_NAME


def checkpoint_pointer_key(run_id: str) -> str:
    """Key of the pointer to the current sharded checkpoint, ``runs/<run>/trainer/checkpoint.json``.

    Args:
        run_id: the run id.
    """
    return trainer_prefix(run_id) + CHECKPOINT_POINTER


def checkpoint_files_prefix(run_id: str, tag: str | None = None) -> str:
    """Prefix of the sharded checkpoints (``runs/<run>/trainer/checkpoints/``), or of the one named ``tag``.

    Args:
        run_id: the run id.
        tag: a checkpoint's tag (``s<step>-<nonce>``); None for the prefix of all of them.
    """
    base = trainer_prefix(run_id) + "checkpoints/"
    return base if tag is None else f"{base}{tag}/"


def journal_key(run_id: str) -> str:
    """Key of the trainer's per-step journal, ``runs/<run>/trainer/journal.json``.

    Args:
        run_id: the run id.
    """
    return trainer_prefix(run_id) + JOURNAL_NAME


def lease_key(run_id: str) -> str:
    """Key of the trainer's lease, ``runs/<run>/trainer/lease.json`` (holder, heartbeat, epoch; CAS only).

    Args:
        run_id: the run id.
    """
    return trainer_prefix(run_id) + LEASE_NAME


def provenance_prefix(run_id: str) -> str:
    """Prefix of the trainer's per-step provenance objects, ``runs/<run>/trainer/provenance/``.

    Args:
        run_id: the run id.
    """
    return trainer_prefix(run_id) + "provenance/"


def provenance_key(run_id: str, step: int) -> str:
    """Key of one step's provenance, ``runs/<run>/trainer/provenance/s<step>.jsonl`` (create-only: a line per
    trained group with its record, worker, version, lag and verdicts; ``stoa audit`` reads them).

    Args:
        run_id: the run id.
        step: the run's step that trained the groups (1 for the first).
    """
    return provenance_prefix(run_id) + f"s{step:08d}.jsonl"


def parse_provenance_key(run_id: str, key: str) -> int | None:
    """The step of a provenance key of ``run_id``; ``None`` for any other key.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = provenance_prefix(run_id)
    m = _PROVENANCE_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return int(m.group(1)) if m else None


def metrics_prefix(run_id: str) -> str:
    """Prefix of a run's metrics, ``runs/<run>/metrics/``: the trainer's create-only chunk objects (every
    bucket) and, inside a local bucket, the processes' JSONL files beside them.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/metrics/"


def logs_prefix(run_id: str) -> str:
    """Folder of process logs inside a local bucket (``stoa quickstart``), ``runs/<run>/logs/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/logs/"


def status_key(run_id: str) -> str:
    """Key of the run's status, ``runs/<run>/status.json`` (state, version, trainer heartbeat, wanted groups).

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/status.json"


_PRESENCE_NAME = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})-[0-9]{8}")


def presence_prefix(run_id: str) -> str:
    """Prefix of the workers' presence objects, ``runs/<run>/workers/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/workers/"


def presence_key(run_id: str, worker_id: str, seq: int) -> str:
    """Key of a worker's presence, ``runs/<run>/workers/<worker>-<seq>`` (empty; the trainer counts and deletes it).

    Args:
        run_id: the run id.
        worker_id: the worker's id.
        seq: the worker's announcement number.
    """
    return f"{presence_prefix(run_id)}{worker_id}-{seq:08d}"


def parse_presence_key(run_id: str, key: str) -> str | None:
    """The worker id of a presence key of ``run_id``; ``None`` for any other key (untrusted: any string).

    Args:
        run_id: the run the key must belong to.
        key: a listed key.
    """
    head = presence_prefix(run_id)
    m = _PRESENCE_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return m.group(1) if m else None


def identities_prefix(run_id: str) -> str:
    """Prefix of the run's worker identities, ``runs/<run>/identities/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/identities/"


def identity_key(run_id: str, name: str, public_key: str) -> str:
    """Key of one worker identity, ``runs/<run>/identities/<name>/<public key>.json`` (create-only).

    Args:
        run_id: the run id.
        name: the worker's name (``stoa worker-key issue NAME``).
        public_key: the worker's Ed25519 public key, 64 lowercase hex digits.
    """
    return f"{identities_prefix(run_id)}{name}/{public_key}.json"


@dataclass(frozen=True)
class IdentityKey:
    """The parts of a well-formed identity key."""

    name: str
    public_key: str


def parse_identity_key(run_id: str, key: str) -> IdentityKey | None:
    """Parse ``runs/<run>/identities/<name>/<64 hex>.json``; ``None`` for any other key.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = identities_prefix(run_id)
    m = _IDENTITY_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return IdentityKey(m.group(1), m.group(2)) if m else None


def revocations_prefix(run_id: str) -> str:
    """Prefix of the run's revoked worker keys, ``runs/<run>/revocations/``.

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/revocations/"


def revocation_key(run_id: str, public_key: str) -> str:
    """Key of one revoked worker key, ``runs/<run>/revocations/<public key>.json`` (create-only).

    Args:
        run_id: the run id.
        public_key: the revoked Ed25519 public key, 64 lowercase hex digits.
    """
    return f"{revocations_prefix(run_id)}{public_key}.json"


def parse_revocation_key(run_id: str, key: str) -> str | None:
    """The public key of ``runs/<run>/revocations/<64 hex>.json``; ``None`` for any other key.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = revocations_prefix(run_id)
    m = _REVOCATION_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return m.group(1) if m else None


def metrics_chunk_key(run_id: str, source: str, start: int, seq: int) -> str:
    """Key of one create-only metrics chunk, ``runs/<run>/metrics/<source>-<start>-<seq>.jsonl``.

    Args:
        run_id: the run id.
        source: who wrote it (``trainer``, ``worker-<id>``, ``eval``), letters, digits, ``.``, ``_``, ``-``.
        start: the writing process's start, unix seconds (10 digits).
        seq: the chunk's number within that process (8 digits).
    """
    return metrics_prefix(run_id) + f"{source}-{start:010d}-{seq:08d}.jsonl"


@dataclass(frozen=True)
class MetricsChunk:
    """The parts of a well-formed metrics chunk key."""

    source: str
    start: int
    seq: int


def parse_metrics_chunk_key(run_id: str, key: str) -> MetricsChunk | None:
    """Parse ``runs/<run>/metrics/<source>-<10 digits>-<8 digits>.jsonl``; ``None`` for any other key.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = metrics_prefix(run_id)
    m = _METRICS_CHUNK.fullmatch(key[len(head):]) if key.startswith(head) else None
    return MetricsChunk(m.group("source"), int(m.group("start")), int(m.group("seq"))) if m else None


def retriever_prefix(run_id: str, fingerprint: str) -> str:
    """Key prefix of a run's retriever index, ``runs/<run>/retriever/<fingerprint>/``.

    Args:
        run_id: the run id.
        fingerprint: the index's fingerprint (``BM25Index.fingerprint``).
    """
    return f"{run_prefix(run_id)}/retriever/{fingerprint}/"


def retriever_file_key(run_id: str, fingerprint: str, name: str) -> str:
    """Key of one file of a run's retriever index (its manifest ``stoa-index.json`` is written last).

    Args:
        run_id: the run id.
        fingerprint: the index's fingerprint.
        name: the file name inside the index directory, no directories.
    """
    return retriever_prefix(run_id, fingerprint) + name


def tracker_key(run_id: str, name: str) -> str:
    """Key of an experiment tracker's handle, ``runs/<run>/trackers/<name>.json`` (e.g. the W&B run id a
    restarted trainer resumes).

    Args:
        run_id: the run id.
        name: the tracker's name (``wandb``): letters, digits, '-' or '_'.
    """
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"tracker name {name!r} must be letters, digits, '-' or '_'")
    return f"{run_prefix(run_id)}/trackers/{name}.json"


def evaluator_key(run_id: str) -> str:
    """Key of the follow-along evaluator's heartbeat, ``runs/<run>/evaluator.json`` (time, host; overwritten).

    Args:
        run_id: the run id.
    """
    return f"{run_prefix(run_id)}/evaluator.json"


def task_data_key(run_id: str, digest: str, name: str) -> str:
    """Key of one task data file the trainer uploaded, ``runs/<run>/data/<digest>/<name>`` (create-only,
    content-addressed: ``digest`` is the file's SHA-256, so a key never changes meaning).

    Args:
        run_id: the run id.
        digest: the file's SHA-256, 64 lowercase hex digits.
        name: the file's name: letters, digits, '.', '_' or '-', not starting with '.'.
    """
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"task data digest {digest!r} must be 64 lowercase hex digits (a SHA-256)")
    if not name or name.startswith(".") or not all(c.isascii() and (c.isalnum() or c in "._-") for c in name):
        raise ValueError(f"task data name {name!r} must be letters, digits, '.', '_' or '-', not starting with '.'")
    return f"{run_prefix(run_id)}/data/{digest}/{name}"
