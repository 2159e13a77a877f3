"""One cell of the hostile matrix: a planted object, a client started against it, and the checks.

A cell's sandbox is a fresh directory: ``bucket/`` (a copy of the base run's, the object planted in it),
``cache/`` (``STOA_CACHE``), ``home/`` (``HOME``, XDG dirs, ``TMPDIR``), ``keys/`` (``STOA_KEY_DIR``: the run's
key and the keys trusted on first use), ``out/`` (plot and export outputs), ``logs/``; and, where nothing may be
written, ``cwd/`` (the client's working directory) and ``canary/`` (what traversal variants point at).
Pass: no traceback, no hang, a documented exit code other than 1 with at most one error line (or, for a worker, still
running at its timeout with a ``[worker] refused ...`` note as its last line: it waits for the trainer's next
publish, as documented), nothing written
outside the allowed directories, the canary never copied into the bucket, and the run's acknowledged data
(model files, task data, index, anchors and patches, consumed records) unchanged and its pointer still verifying.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from stoa.cli import EXIT_CODES
from tests.hostile import bases, runner
from tests.hostile import variants as v
from tests.hostile.objects import CHEAP, RUN, ObjectType, Plant, key_plants, plants_for

ALLOWED = ("bucket", "cache", "home", "keys", "out", "logs")
"""Sandbox directories a client may write."""
TIMEOUTS = {"trainer": 45.0, "worker": 25.0, "eval": 25.0, **{c: 30.0 for c in CHEAP}}
IMMUTABLE = ("model/", "data/", "retriever/", "weights/anchors/", "weights/versions/", "rollouts/", "run.json")
"""Prefixes (under ``runs/r/``) of acknowledged objects: never changed, deleted only by the trainer's retention."""


@dataclass
class CellResult:
    """A cell's outcome and what failed.

    Args:
        obj: object type name (or ``key_names``).
        variant: the variant.
        client: the client started.
        outcome: what it did.
        problems: every failed check (empty: the cell passes).
    """

    obj: str
    variant: str
    client: str
    outcome: runner.Outcome
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def _digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def _files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every file under ``root`` (relative path -> content digest), top-level names in ``skip`` left out."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in skip or p.is_dir() or p.is_symlink():
            continue
        out[str(rel)] = _digest(p)
    return out


def client_argv(client: str, box: Path, base: bases.Base) -> list[str]:
    """The command line of ``client`` against the sandbox's bucket."""
    b, run = str(box / "bucket"), ["--run", RUN]
    return {
        "status": ["status", "--bucket", b, *run],
        "runs": ["runs", "--bucket", b],
        "plot": ["plot", str(box / "out" / "plot.png"), "--bucket", b, *run],
        "export": ["export", str(box / "out" / "export"), "--bucket", b, *run],
        "join-card": ["join-card", "--bucket", b, *run],
        "eval": ["eval", "--bucket", b, *run, "--engine", "torch", "--threads", "1", "--eval-n", "2",
                 "--max-new-tokens", "4", "--wait-seconds", "5", "--poll-seconds", "0.2"],
        "worker": bases.worker_argv(box / "bucket", "hw", 1, wait=5),
        "trainer": base.trainer_argv(box / "bucket", bases.STEPS + 1, wait=8),
    }[client]


def sandbox(box: Path, base: bases.Base) -> None:
    """A fresh cell directory holding a live copy of ``base``."""
    if box.exists():
        shutil.rmtree(box)
    box.mkdir(parents=True)
    shutil.copytree(base.bucket, box / "bucket")
    shutil.copytree(base.root / "cache", box / "cache")
    _copy_keys(base, box)
    for d in ("home", "out", "logs", "cwd", "canary"):
        (box / d).mkdir()
    rows = [{"question": f"{v.CANARY_TOKEN} {i}?", "answer": f"#### {i}"} for i in range(len(bases.PROBLEMS))]
    (box / "canary" / "secret.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # as many as the run's
    bases.make_live(box / "bucket")


def _copy_keys(base: bases.Base, box: Path) -> None:
    """The base run's key directory, its names moved to the sandbox's bucket URL (a run's key file and its
    trusted-on-first-use line are named after a digest of the bucket URL)."""
    from stoa.contract import digest_hex

    keys = box / "keys"
    keys.mkdir()
    if not (base.root / "keys").exists():
        return
    from stoa.bucket import open_bucket

    old, new = (digest_hex(open_bucket(str(b)).url.encode())[:12] for b in (base.bucket, box / "bucket"))
    for f in (base.root / "keys").iterdir():
        (keys / f.name.replace(old, new)).write_bytes(f.read_bytes().replace(old.encode(), new.encode()))
        (keys / f.name.replace(old, new)).chmod(0o600)


def plant(box: Path, obj: ObjectType | None, variant: str, huge_cache: Path) -> list[Plant]:
    """Write ``obj``'s ``variant`` (``obj`` None: the key-name variant ``variant``) into the sandbox's bucket."""
    bucket = box / "bucket"

    def ctx(key: str) -> v.PlantContext:
        return v.PlantContext(box / "canary", key.count("/"), huge_cache)

    plants = key_plants(bucket, variant) if obj is None else plants_for(obj, variant, bucket, ctx)
    for p in plants:
        dest = bucket / p.key
        if len(p.data) >= v.HUGE_BYTES:
            v.huge_link(p.data, ctx(p.key), f"{obj.name if obj else 'key'}-{variant}", dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.unlink(missing_ok=True)
            dest.write_bytes(p.data)
    return plants


def check(result: CellResult, box: Path, base: bases.Base, before: dict[str, str], plants: list[Plant]) -> None:
    """Fill ``result.problems`` from the outcome and the sandbox after the client ran."""
    o, problems = result.outcome, result.problems
    waits = result.client == "worker" and o.retrying  # goes on: refuses each read and waits for the trainer
    if o.code == runner.HANG and not waits:
        problems.append(f"hang past {TIMEOUTS[result.client]:.0f}s")
    if o.traceback:
        problems.append("traceback")
    if (o.code not in EXIT_CODES or o.code in (1, 130)) and not waits:
        problems.append(f"exit code {o.code}")
    if len(o.error_lines) > 1:
        problems.append(f"{len(o.error_lines)} error lines")
    outside = _files(box, ALLOWED)
    if outside != before:
        changed = sorted(set(outside.items()) ^ set(before.items()))
        problems.append(f"wrote outside the bucket and cache: {sorted({k for k, _ in changed})[:3]}")
    problems.extend(_acknowledged(box, base, plants, result.client == "trainer"))


def _acknowledged(box: Path, base: bases.Base, plants: list[Plant], retention: bool) -> list[str]:
    """Problems with the run's acknowledged data once the planted objects are taken out again."""
    bucket, problems = box / "bucket", []
    for p in plants:  # put the honest objects back (or take the planted ones away)
        honest = base.bucket / p.key
        dest = bucket / p.key
        dest.unlink(missing_ok=True)
        if honest.is_file():
            shutil.copyfile(honest, dest)
    token = v.CANARY_TOKEN.encode()
    if any(token in f.read_bytes() for f in bucket.rglob("*") if f.is_file() and f.stat().st_size < 1 << 24):
        problems.append("canary content copied into the bucket")
    run = base.bucket / "runs" / RUN
    for f in sorted(run.rglob("*")):
        rel = str(f.relative_to(run))
        if f.is_dir() or not rel.startswith(IMMUTABLE):
            continue
        mine = bucket / "runs" / RUN / rel
        if not mine.is_file():
            if not (retention and rel.startswith(("rollouts/", "weights/"))):
                problems.append(f"acknowledged {rel} deleted")
        elif _digest(mine) != _digest(f):
            problems.append(f"acknowledged {rel} changed")
    problem = _pointer_problem(bucket, base)
    return problems + ([problem] if problem else [])


def _pointer_problem(bucket: Path, base: bases.Base) -> str | None:
    """None when the run's pointer still verifies and its weights rebuild at or past the base version."""
    from stoa.bucket import open_bucket
    from stoa.contract import RunContract
    from stoa.layout import contract_key
    from stoa.weights.sync import WeightSync

    b = open_bucket(str(bucket))
    try:
        contract = RunContract.from_json(b.get(contract_key(RUN)))
        version, _ = WeightSync(b, RUN, contract.plane, run_key=contract.run_key).sync()
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return f"published weights no longer verify: {type(e).__name__}: {str(e)[:120]}"
    published = json.loads((base.bucket / "runs" / RUN / "weights" / "current.json").read_bytes())["version"]
    return None if version >= published else f"pointer went back from v{published} to v{version}"


def run_cell(obj: ObjectType | None, variant: str, client: str, base: bases.Base, box: Path, huge_cache: Path,
             spawn: bool = False) -> CellResult | None:
    """Plant ``obj``'s ``variant`` in a live copy of ``base`` and start ``client`` against it.

    Returns None when the variant does not apply to the object (nothing planted).

    Args:
        obj: the object type; None for the hostile key names (``variant`` a key of ``KEY_NAMES``).
        variant: the variant name.
        client: a client of ``ALL_CLIENTS``.
        base: the base run.
        box: the cell's sandbox directory (recreated).
        huge_cache: where 64 MiB bodies are kept between cells.
        spawn: start the client as a fresh ``python -m stoa`` process instead of a fork of the warm server.
    """
    sandbox(box, base)
    plants = plant(box, obj, variant, huge_cache)
    if not plants:
        return None
    before = _files(box, ALLOWED)
    env = bases.base_env(box, box / "cache", box / "keys", box / "home")
    outcome = runner.run(client_argv(client, box, base), env, box / "cwd", box / "logs", client,
                         TIMEOUTS[client], spawn=spawn, retried=3 if client == "worker" else 0)
    result = CellResult(obj.name if obj else "key_names", variant, client, outcome)
    check(result, box, base, before, plants)
    if obj is not None and client in obj.must_refuse and outcome.code == 0:
        result.problems.append(f"{client} followed the planted {obj.name} (exit 0)")
    return result
