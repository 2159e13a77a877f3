"""Object names are untrusted: whatever bytes a key holds, listing it never raises, every parser answers (None for
a foreign key), the trainer counts it (``rollout/rejected/key``) and retention deletes it by its listed name."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

import stoa.layout as L
from stoa.bucket import AccessDenied, open_bucket
from stoa.bucket.base import check_listed_key
from stoa.config import TrainerConfig, WorkerConfig, load_config
from stoa.layout import (
    anchors_prefix,
    checkpoint_files_prefix,
    metrics_prefix,
    patches_prefix,
    rollout_version_prefix,
    rollouts_prefix,
)
from stoa.telemetry.metrics import read_bucket_metrics
from stoa.trainer.demand import RolloutRetention
from tests.bucket.conftest import (  # noqa: F401 (fixtures)
    MOTO_SECRET,
    SEAWEED_KEY,
    SEAWEED_SECRET,
    TEST_BUCKET,
    moto_endpoint,
    moto_env,
    seaweed,
    seaweed_env,
)

HOSTILE_NAMES = [
    "a\\b.rec",  # backslash
    "a\nb.rec",  # newline
    "a\rb", "a\tb", "a\x01b", "a\x1fb", "a\x7fb",  # other control characters
    "..x", ".hidden", "x.", "...",  # dots that are not path segments
    "w-00000001.rec ", " w-00000001.rec", "w-00000001.rec\n",  # a record key with a space or newline around it
    "w-99999999999999999999.rec", "w--0000001.rec", "w-0000001.rec", "w-000000001.rec",  # garbage sequences
    "\u00e9-00000001.rec", "e\u0301-00000001.rec",  # the same name in NFC and NFD
    "W-00000001.REC", "w\u2010x-00000001.rec",  # case, a unicode hyphen
    "w-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661.rec",  # Arabic-Indic digits
    "x" * 250,  # a long name (a whole key of 1,000+ characters is planted below)
]
"""Names planted inside a version's prefix of a local bucket (one file each)."""


def long_name() -> str:
    """A name of 1,000+ characters made of nested directories (one segment may hold at most 255 bytes)."""
    return "/".join(["d" * 200] * 5) + "/x.rec"


def plant(root: Path, key: str, data: bytes = b"hostile") -> None:
    """Write ``key`` straight into a local bucket's directory, as any process with access could."""
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def plant_bytes(root: Path, rel: bytes) -> None:
    """Write a file whose name is not UTF-8 (a local bucket lists it with surrogate escapes)."""
    path = os.path.join(os.fsencode(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"hostile")


def plant_everywhere(root: Path, version: int) -> int:
    """Plant every hostile name under the rollouts prefix of ``version``; returns how many objects."""
    prefix = rollout_version_prefix("r", version)
    for name in HOSTILE_NAMES:
        plant(root, prefix + name)
    plant(root, prefix + long_name())
    plant_bytes(root, os.fsencode(prefix) + b"w\xff\xfe-00000001.rec")
    return len(HOSTILE_NAMES) + 2


def test_a_local_listing_returns_every_hostile_name_and_retention_deletes_them(tmp_path):
    bucket = open_bucket(str(tmp_path))
    planted = plant_everywhere(tmp_path, 1)
    keys = [i.key for i in bucket.list(rollouts_prefix("r"))]
    assert len(keys) == planted and keys == sorted(keys)
    assert rollout_version_prefix("r", 1) + long_name() in keys and len(max(keys, key=len)) > 1000
    assert all(L.parse_rollout_key("r", k) is None for k in keys if "W-" not in k)
    retention = RolloutRetention(bucket, "r", staleness_bound=0, keep_extra=0)
    assert retention.collect(2) == planted and retention.kept_from == 2 and retention.skipped == 0
    assert list(bucket.list("")) == [] and sorted(os.listdir(tmp_path)) == [".stoa"]  # empty dirs pruned too


def test_retention_skips_and_counts_a_version_the_bucket_cannot_delete(tmp_path):
    class Refusing:
        def __init__(self) -> None:
            self.prefixes: list[str] = []

        def delete_prefix(self, prefix: str) -> int:
            self.prefixes.append(prefix)
            if prefix == rollout_version_prefix("r", 2):
                raise ValueError("bucket key 'x\\y' must not contain backslashes")
            return 1

    bucket = Refusing()
    retention = RolloutRetention(bucket, "r", staleness_bound=0, keep_extra=0)  # type: ignore[arg-type]
    assert retention.collect(4) == 2 and retention.skipped == 1 and retention.kept_from == 4
    assert retention.collect(5) == 1 and bucket.prefixes.count(rollout_version_prefix("r", 2)) == 1  # never again


def test_a_listed_key_outside_the_root_is_never_deleted(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    plant(tmp_path, "outside")
    for key in ("../outside", "a/../../outside", "/etc/passwd", ".stoa/locks/000.lock", "a//b", "a/./b", "", "a\0b",
                "trailing/"):
        with pytest.raises(ValueError):
            bucket.delete(key)
        with pytest.raises(ValueError):
            check_listed_key(key)
    assert (tmp_path / "outside").exists()
    assert check_listed_key("a\\b\n\x01") == "a\\b\n\x01"


def test_every_parser_is_total_and_takes_only_ascii_digits():
    odd = ["", "/", "//", "runs/", "runs//x", "runs/r", "runs/r/", "\0", "\udcff", "x" * 5000, "runs/r/rollouts/",
           "runs/r/rollouts/v00000001/", "runs/r/rollouts/v-0000001/w-00000001.rec",
           "runs/r/rollouts/v99999999999999999999/w-00000001.rec", "runs/r/rollouts/v0000001/w-00000001.rec",
           "runs/r/weights/versions/v\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661.patch",
           "runs/r/weights/versions/v-0000001.patch", "runs/r/weights/versions/v000000001.patch",
           "runs/r/weights/anchors/v\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661/manifest.json",
           "runs/r/weights/anchors/v00000001", "runs/r/metrics/trainer-00000000001-00000001.jsonl",
           "runs/r/metrics/trainer-\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661-00000001.jsonl"]
    for key in odd + [rollout_version_prefix("r", 1) + n for n in HOSTILE_NAMES if "W-" not in n]:
        assert L.parse_rollout_key("r", key) is None
        assert L.parse_patch_key("r", key) is None
        assert L.parse_anchor_key("r", key) is None
        assert L.parse_metrics_chunk_key("r", key) is None
        assert L.parse_run_key(key) in (None, "r") and isinstance(L.rollout_label(key), str)
        assert L.rollout_worker(key) is None or isinstance(L.rollout_worker(key), str)  # lenient: admitted keys
    assert L.parse_patch_key("r", L.patch_key("r", 7)) == 7
    assert L.parse_anchor_key("r", L.anchor_prefix("r", 7) + "manifest.json") == L.AnchorObject(7, "manifest.json")
    pub = "ab" * 32
    for key in odd + [L.identities_prefix("r") + n for n in ("a/" + pub.upper() + ".json", "a/" + pub + ".json\n",
                                                            "\u0661/" + pub + ".json", "a/b/" + pub + ".json",
                                                            "a/" + pub[:-1] + "\u0661.json", "/" + pub + ".json")]:
        assert L.parse_identity_key("r", key) is None and L.parse_revocation_key("r", key) is None
    assert L.parse_identity_key("r", L.identity_key("r", "a.b-c", pub)) == L.IdentityKey("a.b-c", pub)
    assert L.parse_revocation_key("r", L.revocation_key("r", pub) + "\n") is None
    assert not any(L.is_file_name(n) for n in ["", ".", "..", ".x", "a/b", "a\\b", "a\nb", "config.json\n", "x" * 256])
    assert L.is_file_name("tokenizer_config.json") and L.is_file_name("merges.txt")


def trainer_cfg(url: str) -> TrainerConfig:
    return TrainerConfig(bucket=url, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                         anchor_every=2, keep_versions=2, groups_per_step=1, staleness_bound=1,
                         keep_rollout_versions=0, steps=4, poll_seconds=0.02, max_wait_seconds=120,
                         metrics_flush_rows=1, log_dir="").validate()


def worker_cfg(url: str, tiny_dir: Path, logs: Path) -> WorkerConfig:
    return load_config(WorkerConfig, env={}, overrides={
        "bucket": url, "run": "r", "name": "w", "model": str(tiny_dir), "engine": "torch", "threads": 1,
        "groups_in_flight": 1, "poll_seconds": 0.02, "wait_seconds": 120, "seed": 1, "status_seconds": 0.02,
        "log_dir": str(logs)})


@pytest.mark.slow  # a trainer and a worker in-process: about 6 s alone, 15 s on a busy machine
def test_a_live_run_counts_hostile_keys_and_keeps_stepping_past_their_retention(tmp_path, tiny_dir, stoa_cache):
    from stoa.trainer.loop import _Trainer
    from stoa.worker.loop import run_worker

    root = tmp_path / "b"
    url = str(root)
    planted = sum(plant_everywhere(root, v) for v in (1, 2, 3))
    for prefix in (patches_prefix("r"), anchors_prefix("r"), metrics_prefix("r"), checkpoint_files_prefix("r")):
        for name in ("a\\b", "a\nb", "v00000001.patch\n", "v99999999999999999999.patch", "v00000001/a\x01b"):
            plant(root, prefix + name)
    t = _Trainer(trainer_cfg(url), echo=lambda *_: None)
    worker = threading.Thread(target=run_worker, args=(worker_cfg(url, tiny_dir, tmp_path / "logs"),),
                              kwargs={"echo": lambda *_: None}, daemon=True)
    worker.start()
    try:
        summary = t.run()
    finally:
        t.close()
    worker.join(timeout=60)
    assert not worker.is_alive()  # it saw the run finish
    assert summary["step"] == 4 and summary["version"] == 5
    rows = [r for r in read_bucket_metrics(open_bucket(url), "r") if "rollout/keys" in r]
    assert len(rows) == 4
    assert sum(r.get("rollout/rejected/key", 0) for r in rows) == planted
    assert (t.retention.kept_from, t.retention.skipped) == (4, 0)  # v1..v3 deleted, hostile names and all
    left = [i.key for i in open_bucket(url).list(rollouts_prefix("r"))]
    assert all(L.parse_rollout_key("r", k) is not None for k in left)  # (the worker may upload to v3 after)
    weights = [i.key for i in open_bucket(url).list(anchors_prefix("r"))]
    assert not [k for k in weights if k.startswith(L.anchor_prefix("r", 1))]  # the old anchor, its planted key too
    assert L.anchor_prefix("r", 2) + "manifest.json" in weights
    other_clients_read_the_run(url, planted)


def other_clients_read_the_run(url: str, rejected: int) -> None:
    """``stoa status``, ``stoa runs``, ``stoa plot``'s data, a worker's weight sync, ``stoa runs rm``: hostile keys
    left under the run's prefixes (and a version's prefix planted again) are skipped, never raised on."""
    from stoa.observe.plotdata import listed_records, read_sourced_rows
    from stoa.observe.runs import delete_run, list_runs
    from stoa.observe.snapshot import take_snapshot
    from stoa.weights.sync import WeightSync

    bucket = open_bucket(url)
    again = plant_everywhere(Path(url), 5)
    for version in ("v99999999999999999999", "v-0000001", "v000000001", "v0000001", "v" + "\u0661" * 8):
        plant(Path(url), f"{rollouts_prefix('r')}{version}/w-00000001.rec")  # versions no stoa writes
    plant(Path(url), L.run_prefix("r") + "/a\b\n\x01")
    snap = take_snapshot(bucket, "r")
    assert snap.rejected == {"key": rejected} and snap.version == 5
    plant(Path(url), "runs/stray\x01")  # names no run
    plant(Path(url), "runs/q\\\n/x")  # a run id no stoa writes
    listing = list_runs(bucket)
    assert [(row.run, row.objects > again) for row in listing.runs] == [("q\\\n", False), ("r", True)]
    assert listing.stray == 1
    # no planted one (a worker lagging on a loaded machine may still upload to a version retention deleted)
    assert all(1 <= v <= 5 and w.startswith("w-") for v, w in listed_records(bucket, "r"))
    assert {source for source, _ in read_sourced_rows(bucket, "r")} >= {"trainer"}
    assert WeightSync(bucket, "r", "bf16").sync()[0] == 5
    assert delete_run(bucket, "r") > again and not list(bucket.list("runs/r/"))


def test_a_worker_copies_only_plain_model_file_names(tmp_path, tiny_dir):
    from stoa.contract import download_model_files, upload_model_files

    bucket = open_bucket(str(tmp_path / "b"))
    uploaded = sorted(k[len(L.model_prefix("r")):] for k in upload_model_files(bucket, "r", tiny_dir))
    for name in ("a\\b", "a\nb", "config.json\n", ".env", "-x", "sub/dir.json", "\u00e9.json"):
        plant(tmp_path / "b", L.model_prefix("r") + name)
    out = download_model_files(bucket, "r", tmp_path / "m")
    assert sorted(p.name for p in out.iterdir()) == uploaded and "config.json" in uploaded


S3_NAMES = [
    "a\\b.rec", "a\x01b.rec", "a\tb", "a\rb", "a\x7fb",  # backslash, control characters
    "a//b.rec", "../x", "./x", "x/../y", "x/./y", "dir/",  # empty, '.' and '..' segments, a trailing '/'
    "x" * 1000,  # the whole key over S3's 1,024 bytes (moto stores it)
    "\u00e9-00000001.rec", "e\u0301-00000001.rec", "a%2Fb", "w-99999999999999999999.rec", "v9/w-00000001.rec",
    "W-00000001.rec",  # a record key of another worker id: read, and rejected for its content
]
"""Names planted under a version's prefix of an S3 bucket (moto refuses a key holding a newline: 404)."""


@pytest.mark.parametrize("listing", ["server", "client"])
def test_s3_lists_counts_and_deletes_keys_obstore_cannot_parse(moto_endpoint, listing, tiny_dir):  # noqa: F811
    import boto3

    from stoa.contract import ModelSpec, RunContract, SamplingSpec
    from stoa.tasks import get_task
    from stoa.tokenize import TextCodec
    from stoa.trainer.pool import RecordPool
    from stoa.weights.pointer import list_anchors, list_patches
    from tests.test_pool import put

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    bucket = open_bucket(f"s3://{TEST_BUCKET}/{prefix}", {**moto_env(moto_endpoint), "STOA_S3_LISTING": listing,
                                                             "STOA_BUCKET_RETRY_TIMEOUT_S": "2"})
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, aws_access_key_id="moto", region_name="us-east-1",
                      aws_secret_access_key=MOTO_SECRET)
    for name in S3_NAMES:
        s3.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{rollout_version_prefix('r', 1)}{name}", Body=b"hostile")
    for head in (patches_prefix("r"), anchors_prefix("r"), metrics_prefix("r")):
        for name in ("a\x01b", "v00000001/../x", "v00000001.patch/"):
            s3.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{head}{name}", Body=b"hostile")
    codec, task = TextCodec(tiny_dir), get_task("toy")
    contract = RunContract(
        run_id="r", model=ModelSpec("llama", "c", "t", vocab_size=512, eos_token_ids=codec.eos_ids), n_samples=2,
        plane="bf16", task_id="toy", task_spec=task.spec(), reward_version=task.reward_version,
        sampling=SamplingSpec(1.0, 1.0, 8))
    good = put(bucket, contract, task, codec)
    listed = [i.key for i in bucket.list(rollout_version_prefix("r", 1))]
    assert sorted(listed) == listed and len(listed) == len(S3_NAMES) + 1
    assert {k[len(rollout_version_prefix("r", 1)):] for k in listed} == {*S3_NAMES, good.rsplit("/", 1)[1]}
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=1, reuse_cap=1)
    assert pool.refresh(1) == 1 and pool.stats.rejected["key"] == len(S3_NAMES) - 1
    assert sum(pool.stats.rejected.values()) == len(S3_NAMES)
    assert list_patches(bucket, "r") == {} and list_anchors(bucket, "r") == {}
    assert read_bucket_metrics(bucket, "r", None) == []
    retention = RolloutRetention(bucket, "r", staleness_bound=0, keep_extra=0)
    assert retention.collect(2) == len(S3_NAMES) + 1 and retention.skipped == 0
    assert "Contents" not in s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=f"{prefix}/runs/r/rollouts/")
    bucket.delete(metrics_prefix("r") + "a\x01b")  # one listed key deleted by its name
    assert bucket.delete_prefix("runs/") == 8 and "Contents" not in s3.list_objects_v2(Bucket=TEST_BUCKET,
                                                                                         Prefix=f"{prefix}/")


def test_raw_listing_pages_in_order_and_resumes_after_a_key(moto_endpoint):  # noqa: F811
    import boto3

    from stoa.bucket.s3_raw import RawS3

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    bucket = open_bucket(f"s3://{TEST_BUCKET}/{prefix}", moto_env(moto_endpoint))
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, aws_access_key_id="moto", region_name="us-east-1",
                      aws_secret_access_key=MOTO_SECRET)
    names = sorted(["a\x01", "a//b", "../c", "d/", "e\\f", "g%41", "\u00e9", "x" * 900])
    for name in names:
        s3.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/p/{name}", Body=b"x")
    raw = RawS3(bucket._failures, page_size=3)  # type: ignore[attr-defined]
    assert [i.key for i in raw.list(f"{prefix}/p/", None)] == [f"{prefix}/p/{n}" for n in names]
    assert [i.key for i in raw.list(f"{prefix}/p/", f"{prefix}/p/{names[2]}")] == [f"{prefix}/p/{n}" for n in names[3:]]
    assert [i.key for i in bucket.list("p/", start_after=f"p/{names[4]}")] == [f"p/{n}" for n in names[5:]]
    for name in names:
        raw.delete(f"{prefix}/p/{name}")
    assert list(bucket.list("p/")) == []


@pytest.mark.seaweedfs
def test_seaweedfs_checks_the_signature_of_raw_requests_and_they_list_and_delete_exact_keys(seaweed):  # noqa: F811
    import boto3

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    env = {**seaweed_env(seaweed.endpoint), "STOA_BUCKET_RETRY_TIMEOUT_S": "2"}
    bucket = open_bucket(f"s3://{TEST_BUCKET}/{prefix}", env)
    s3 = boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=SEAWEED_KEY, region_name="us-east-1",
                      aws_secret_access_key=SEAWEED_SECRET)
    names = ["a\nb.rec", "a\tb", "a\rb", "a\x7fb", "w-00000001.rec"]
    for name in names:
        s3.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{rollout_version_prefix('r', 1)}{name}", Body=b"x")
    assert [i.key for i in bucket.list(rollouts_prefix("r"))] == [rollout_version_prefix("r", 1) + n
                                                                  for n in sorted(names)]
    forged = open_bucket(f"s3://{TEST_BUCKET}/{prefix}", {**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    with pytest.raises(AccessDenied):
        forged._raw.delete(f"{prefix}/{rollout_version_prefix('r', 1)}a\tb")  # type: ignore[attr-defined]
    assert RolloutRetention(bucket, "r", staleness_bound=0, keep_extra=0).collect(2) == len(names)
    assert "Contents" not in s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=f"{prefix}/")


@pytest.mark.parametrize(("method", "key", "query"), [
    ("DELETE", "runs/r/rollouts/v00000001/a\tb//../c d+e%f\u00e9*!", []),
    ("GET", "", [("list-type", "2"), ("encoding-type", "url"), ("prefix", "p/a b\x01/"), ("start-after", "p/~x")]),
])
def test_raw_requests_are_signed_as_botocore_signs_them(monkeypatch, method, key, query):
    from datetime import UTC, datetime
    from urllib.parse import quote

    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    import stoa.bucket.s3_raw as raw
    from stoa.bucket.credentials import S3Credentials
    from stoa.bucket.outage import RetryPolicy
    from stoa.bucket.s3_retry import S3Failures

    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    monkeypatch.setattr(raw, "datetime", type("Frozen", (), {"now": staticmethod(lambda tz=None: now)}))
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now.replace(tzinfo=None))
    creds = S3Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", session_token="tok/en+=",
                          endpoint="http://127.0.0.1:9000", region="eu-west-3")
    failures = S3Failures("s3://bkt", "http://127.0.0.1:9000", "bkt", creds, RetryPolicy())
    path = "/bkt/" + quote(key, safe="/-_.~")
    canonical_query = "&".join(f"{raw._enc(k)}={raw._enc(v)}" for k, v in sorted(query))
    ours = raw._signed_headers(failures, method, "127.0.0.1:9000", path, canonical_query)
    request = AWSRequest(method=method, url=f"http://127.0.0.1:9000{path}", params=dict(query))  # botocore encodes
    botocore.auth.S3SigV4Auth(Credentials(creds.access_key_id, creds.secret_access_key, creds.session_token), "s3",
                              "eu-west-3").add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]


def test_a_raw_request_to_a_dead_endpoint_is_bucket_unreachable_and_a_refusal_names_the_key(moto_endpoint):  # noqa: F811
    from stoa.bucket import BucketError, BucketUnreachable
    from stoa.bucket.credentials import S3Credentials
    from stoa.bucket.outage import RetryPolicy
    from stoa.bucket.s3_raw import RawS3
    from stoa.bucket.s3_retry import S3Failures
    from tests.bucket.conftest import closed_port

    dead = f"http://127.0.0.1:{closed_port()}"
    creds = S3Credentials("k", "s", endpoint=dead)
    policy = RetryPolicy(total_timeout_s=60, max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
    raw = RawS3(S3Failures("s3://b", dead, "b", creds, policy))
    # the attempt cap, not the clock, ends it: a slow machine still makes all 3 tries
    with pytest.raises(BucketUnreachable, match="delete on s3://b .*after 3 attempt"):
        raw.delete("a\x01b")
    missing = RawS3(S3Failures("s3://nope", moto_endpoint, "no-such-bucket-here", S3Credentials(
        "moto", MOTO_SECRET, endpoint=moto_endpoint), RetryPolicy(total_timeout_s=0.5)))
    with pytest.raises(BucketError, match="list s3://nope key 'p/' .*404"):
        next(iter(missing.list("p/", None)))
