"""``stoa runs`` and ``stoa runs rm``: runs read from a bucket alone (hand-written runs with exact figures,
hostile objects), deletion that asks, refuses a live trainer, a missing run and a non-terminal without --yes,
and the same on moto S3."""

from __future__ import annotations

import io
import json
import time
from datetime import UTC, datetime

import pytest

from stoa.bucket import Bucket, open_bucket
from stoa.cli import main
from stoa.layout import contract_key, lease_key, model_file_key, parse_run_key, pointer_key, rollout_key, status_key
from stoa.observe.runs import MAX_SMALL_BYTES, list_runs, render
from stoa.schemas.control import LeaseRecord, RunStatus
from stoa.trainer.lease import DEFAULT_TTL_S
from stoa.weights.pointer import Pointer
from tests.bucket.conftest import TEST_BUCKET, moto_endpoint, moto_env  # noqa: F401 - fixture used below

NOW = 1_800_000_000.0
CONTRACT = json.dumps({"model": {"architecture": "llama"}}).encode()


def _pointer(run: str, version: int, now: float) -> bytes:
    iso = datetime.fromtimestamp(now - 5, UTC).isoformat(timespec="milliseconds")
    return Pointer(run, version, 1, "bf16", "h" * 32, iso).to_json()


def _lease(heartbeat: float, released: bool = False) -> bytes:
    return LeaseRecord("abc", "gpu-box", 4242, heartbeat - 500, heartbeat, 1, "tiny", released).to_json()


def write_runs(bucket: Bucket, now: float | None = None) -> None:
    """``live`` (running, lease 2 s old), ``done`` (finished at v3, released), ``done2`` (a name that extends
    ``done``), ``stale`` (says running, lease older than the TTL), ``junk`` (garbage run.json, lease and
    pointer, a status over the size cap), and two keys under runs/ that name no run (``now``: the clock)."""
    now = time.time() if now is None else now
    for run, state, version, beat, released in (("live", "running", 7, now - 2, False),
                                                 ("done", "finished", 3, now - 60, True),
                                                 ("done2", "finished", 1, now - 60, True),
                                                 ("stale", "running", 2, now - DEFAULT_TTL_S - 1, False)):
        bucket.put_create(contract_key(run), CONTRACT)
        bucket.put_create(model_file_key(run, "config.json"), b"{}")
        bucket.put(status_key(run), RunStatus(state, version, beat, beat, None).to_json())
        bucket.put(pointer_key(run), _pointer(run, version, now))
        bucket.put(lease_key(run), _lease(beat, released))
        bucket.put_create(rollout_key(run, 1, "w1", 0), b"x" * 1000)
    bucket.put_create(contract_key("junk"), b"{not json")
    bucket.put(status_key("junk"), b'{"state": "running"' + b" " * MAX_SMALL_BYTES + b"}")
    bucket.put(lease_key("junk"), b"[" * 5000 + b"]" * 5000)
    bucket.put(pointer_key("junk"), b"\xff\xfe")
    bucket.put_create("runs/stray-object", b"abc")
    bucket.put_create("runs/alone.json", b"abc")


def test_runs_are_listed_with_state_version_age_size_and_question_marks(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    write_runs(bucket, NOW)
    listing = list_runs(bucket, now=NOW)
    rows = {r.run: r for r in listing.runs}
    assert list(rows) == ["done", "done2", "junk", "live", "stale"] and listing.stray == 2
    assert (rows["live"].state, rows["live"].version, rows["live"].live, rows["live"].age_s) == ("running", 7, True, 2)
    assert (rows["done"].state, rows["done"].version, rows["done"].live) == ("finished", 3, False)
    assert (rows["stale"].state, rows["stale"].live) == ("stale", False)
    assert rows["live"].objects == 6 and rows["live"].nbytes == sum(
        o.size for o in bucket.list("runs/live/")) and rows["live"].model == "llama"
    junk = rows["junk"]
    assert (junk.state, junk.version, junk.age_s, junk.live, junk.model, junk.objects) == ("?", None, None, False,
                                                                                          "?", 4)
    text = render(listing)
    assert text.splitlines()[0].split() == ["RUN", "STATE", "VERSION", "AGE", "SIZE", "OBJECTS", "MODEL"]
    assert text.splitlines()[3].split() == ["junk", "?", "?", "?", f"{junk.nbytes / 1e3:.1f}", "kB", "4", "?"]
    assert "2 objects under runs/ belong to no run" in text


def test_parse_run_key_names_a_run_only_with_something_under_it():
    assert parse_run_key("runs/a/run.json") == "a"
    assert parse_run_key("runs/a.b-c/x/y") == "a.b-c"
    for key in ("runs/a", "runs/a/", "runs//x", "runs/", "other/a/b", "runsx/a/b"):
        assert parse_run_key(key) is None, key


def test_a_hostile_run_id_prints_escaped(tmp_path, capsys):
    open_bucket(str(tmp_path / "b"))  # the bucket API refuses control characters; another writer may not
    (tmp_path / "b" / "runs" / "evil\x1b[2J").mkdir(parents=True)
    (tmp_path / "b" / "runs" / "evil\x1b[2J" / "run.json").write_bytes(b"{}")
    assert main(["runs", "--bucket", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "'evil\\x1b[2J'" in out


def test_rm_of_a_run_holding_keys_stoa_would_not_write_deletes_them_by_their_listed_names(tmp_path, capsys):
    url = str(tmp_path / "b")
    write_runs(open_bucket(url))
    for name in ("ctl\x01", "back\\slash", "new\nline"):  # another tool (or a worker's credentials) wrote them
        (tmp_path / "b" / "runs" / "done" / name).write_bytes(b"?")
    assert main(["runs", "rm", "--bucket", url, "done", "--yes"]) == 0
    assert "deleted 9 objects of run done" in capsys.readouterr().out
    assert "done" not in {r.run for r in list_runs(open_bucket(url)).runs}


def test_rm_deletes_every_object_of_the_run_only(tmp_path, capsys):
    url = str(tmp_path / "b")
    write_runs(open_bucket(url))
    before = {o.key for o in open_bucket(url).list("")}
    assert main(["runs", "rm", "--bucket", url, "done", "--yes"]) == 0
    after = {o.key for o in open_bucket(url).list("")}
    assert before - after == {k for k in before if k.startswith("runs/done/")} and len(before - after) == 6
    assert "deleted 6 objects of run done" in capsys.readouterr().out
    assert not (tmp_path / "b" / "runs" / "done").exists()  # no empty folders left behind
    assert any(k.startswith("runs/done2/") for k in after)


def _refused(tmp_path, capsys, argv: list[str], code: int, stdin: io.StringIO | None = None,
             monkeypatch: pytest.MonkeyPatch | None = None) -> str:
    url = str(tmp_path / "b")
    write_runs(open_bucket(url))
    before = {(o.key, o.size) for o in open_bucket(url).list("")}
    if stdin is not None and monkeypatch is not None:
        monkeypatch.setattr("sys.stdin", stdin)
    assert main(["runs", "rm", "--bucket", url, *argv]) == code
    assert {(o.key, o.size) for o in open_bucket(url).list("")} == before  # nothing deleted or written
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


def test_rm_refuses_a_run_whose_trainer_is_live(tmp_path, capsys):
    err = _refused(tmp_path, capsys, ["live", "--yes"], 6)
    assert "a trainer holds run live" in err and "stop the trainer" in err


def test_rm_of_a_missing_run_is_exit_12(tmp_path, capsys):
    assert "no run 'nope'" in _refused(tmp_path, capsys, ["nope", "--yes"], 12)


@pytest.mark.parametrize("run", ["done/x", "", "done/", "do\x1bne"])
def test_rm_refuses_a_run_argument_that_names_no_single_run(tmp_path, capsys, run):
    assert "is not a run id" in _refused(tmp_path, capsys, [run, "--yes"], 2)


def test_rm_without_yes_refuses_when_stdin_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    err = _refused(tmp_path, capsys, ["done"], 2, io.StringIO("y\n"), monkeypatch)
    assert "stdin is not a terminal" in err and "--yes" in err


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rm_asks_on_a_terminal(tmp_path, capsys, monkeypatch):
    url = str(tmp_path / "b")
    write_runs(open_bucket(url))
    monkeypatch.setattr("sys.stdin", _Tty("n\n"))
    assert main(["runs", "rm", "--bucket", url, "done"]) == 0
    assert open_bucket(url).exists(contract_key("done"))
    monkeypatch.setattr("sys.stdin", _Tty("y\n"))
    assert main(["runs", "rm", "--bucket", url, "done"]) == 0
    assert not list(open_bucket(url).list("runs/done/"))
    assert "delete run done (6 objects" in capsys.readouterr().out


def test_runs_needs_a_bucket(capsys):
    with pytest.raises(SystemExit) as e:
        main(["runs"])
    assert e.value.code == 2 and "--bucket" in capsys.readouterr().err


def test_an_empty_bucket_has_no_runs(tmp_path, capsys):
    open_bucket(str(tmp_path / "b"))
    assert main(["runs", "--bucket", str(tmp_path / "b"), "--json"]) == 0
    assert capsys.readouterr().out == ""
    assert render(list_runs(open_bucket(str(tmp_path / "b")))) == "no runs in this bucket"


def test_list_and_rm_on_moto_with_keys_stoa_never_writes(moto_endpoint, monkeypatch, capsys):  # noqa: F811
    import uuid

    import boto3

    for k, v in moto_env(moto_endpoint).items():
        monkeypatch.setenv(k, v)
    prefix = f"runs-{uuid.uuid4().hex[:8]}"
    url = f"s3://{TEST_BUCKET}/{prefix}"
    write_runs(open_bucket(url))
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, aws_access_key_id="moto", aws_secret_access_key="x",
                      region_name="us-east-1")
    for odd in ("runs/nameless", "runs/stale/status.json/x", "runs/stale/\u00fc ber", "runs/stale/a//b",
                "runs/stale/c\x01d", "runs/stale/../e", "runs/stale/f/"):  # obstore cannot parse the last four
        s3.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{odd}", Body=b"?")  # keys stoa itself never writes
    assert main(["runs", "--bucket", url, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["run"], r["state"], r["version"]) for r in rows] == [
        ("done", "finished", 3), ("done2", "finished", 1), ("junk", "?", None), ("live", "running", 7),
        ("stale", "stale", 2)]
    assert [r["objects"] for r in rows if r["run"] == "stale"] == [12]
    assert main(["runs", "rm", "--bucket", url, "stale", "--yes"]) == 0
    assert not s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=f"{prefix}/runs/stale/").get("Contents")
    assert main(["runs", "rm", "--bucket", url, "live", "--yes"]) == 6
    left = {r.run for r in list_runs(open_bucket(url)).runs}
    assert left == {"done", "done2", "junk", "live"}
