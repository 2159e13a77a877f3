"""`stoa local-e2e` round-trips validated records through a bucket and always leaves the bucket clean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")

from stoa.bucket import open_bucket  # noqa: E402
from stoa.rollouts.records import RecordRejected  # noqa: E402
from stoa.worker import local_e2e  # noqa: E402
from stoa.worker.local_e2e import run_local_e2e  # noqa: E402

pytestmark = pytest.mark.mlx


def _objects(url: Path) -> list[str]:
    return [o.key for o in open_bucket(str(url)).list("")]


def test_round_trip_on_a_local_bucket(tiny_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    s = run_local_e2e(2, 3, 16, engine="mlx", model=str(tiny_dir), bucket_url=str(tmp_path / "b"), echo=lines.append)
    assert s["validation"] == "ok" and s["records_valid"] == 2 and s["cleaned"] is True
    assert s["new_tokens"] >= 2 * 3 and s["tokens_per_s"] > 0 and s["record_bytes"] > 0
    assert s["prefix"].startswith("local-e2e/")
    assert _objects(tmp_path / "b") == []
    text = "\n".join(lines)
    assert "tok/s" in text and "reward mean" in text and "2/2 records valid" in text


def test_model_from_env_and_temporary_bucket(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL", str(tiny_dir))
    s = run_local_e2e(1, 2, 4, engine="mlx", echo=lambda _: None)
    assert s["model"] == str(tiny_dir) and s["validation"] == "ok"
    assert not Path(s["bucket"]).exists()  # the temporary bucket directory is gone too


def test_failed_validation_still_deletes_the_prefix(tiny_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def reject(*args, **kwargs):
        raise RecordRejected("vocab", "injected")

    monkeypatch.setattr(local_e2e, "validate_record", reject)
    with pytest.raises(RuntimeError, match="injected"):
        run_local_e2e(1, 2, 4, engine="mlx", model=str(tiny_dir), bucket_url=str(tmp_path / "b"), echo=lambda _: None)
    assert _objects(tmp_path / "b") == []


def test_unreachable_bucket_fails_clearly_before_generating(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("STOA_BUCKET_RETRY_TIMEOUT_S", "1")
    monkeypatch.setenv("STOA_BUCKET_CONNECT_TIMEOUT_S", "1")

    def no_engine(*args, **kwargs):
        raise AssertionError("generation started on an unreachable bucket")

    monkeypatch.setattr("stoa.worker.loop.make_engine", no_engine)
    with pytest.raises(RuntimeError, match="unreachable"):
        run_local_e2e(1, 2, 4, engine="mlx", model=str(tiny_dir), bucket_url="s3://stoa-test/e2e", echo=lambda _: None)


@pytest.mark.parametrize("kwargs,match", [({"groups": 0}, "groups"), ({"samples": 0}, "samples"),
                                          ({"tokens": 0}, "tokens"), ({"engine": "jax"}, "engine"),
                                          ({"task": "nope"}, "unknown task")])
def test_bad_arguments(kwargs: dict[str, Any], match: str, tmp_path: Path) -> None:
    given = {k: v for k, v in kwargs.items() if k in ("groups", "samples", "tokens")}
    sizes = {"groups": 1, "samples": 2, "tokens": 4} | given
    opts = {k: v for k, v in kwargs.items() if k not in sizes}
    with pytest.raises(ValueError, match=match):
        run_local_e2e(sizes["groups"], sizes["samples"], sizes["tokens"], bucket_url=str(tmp_path),
                      echo=lambda _: None, **opts)
    assert _objects(tmp_path) == []


def test_malformed_bucket_url_is_refused() -> None:
    with pytest.raises(ValueError, match="scheme"):
        run_local_e2e(1, 2, 4, engine="mlx", bucket_url="ftp://host/dir", echo=lambda _: None)
