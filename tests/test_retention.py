"""Rollout retention: whole version prefixes below the window minus ``keep_rollout_versions`` go, once."""

from __future__ import annotations

from typing import cast

import pytest

from stoa.bucket import Bucket, BucketUnreachable, open_bucket
from stoa.layout import rollout_key, rollout_version_prefix, rollouts_prefix
from stoa.trainer.demand import RolloutRetention, StatusPublisher


class Spy:
    """A bucket that records the prefixes it deletes and can fail them."""

    def __init__(self, inner, fail_at: int | None = None) -> None:
        self.inner, self.deleted, self.fail_at = inner, [], fail_at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete_prefix(self, prefix):
        if self.fail_at is not None and prefix == rollout_version_prefix("r", self.fail_at):
            self.fail_at = None
            raise BucketUnreachable("injected")
        self.deleted.append(prefix)
        return self.inner.delete_prefix(prefix)


def versions_left(bucket) -> list[int]:
    return sorted({int(i.key.split("/")[3][1:]) for i in bucket.list(rollouts_prefix("r"))})


@pytest.fixture
def bucket(tmp_path):
    b = open_bucket(str(tmp_path))
    for v in range(1, 11):
        for seq in range(2):
            b.put_create(rollout_key("r", v, "w", seq), b"x")
    return b


@pytest.mark.parametrize(("keep", "left"), [(0, list(range(7, 11))), (2, list(range(5, 11))),
                                            (-1, list(range(1, 11)))])
def test_retention_deletes_exactly_the_versions_below_the_window_minus_n(bucket, keep, left):
    spy = Spy(bucket)
    r = RolloutRetention(cast(Bucket, spy), "r", staleness_bound=3, keep_extra=keep)
    deleted = r.collect(10)  # window v7..v10
    assert versions_left(bucket) == left and deleted == 2 * (10 - len(left))


def test_retention_lists_each_old_version_once_and_restarts_where_it_stopped(bucket):
    spy = Spy(bucket)
    r = RolloutRetention(cast(Bucket, spy), "r", staleness_bound=3, keep_extra=0)
    r.collect(8)
    assert spy.deleted == [rollout_version_prefix("r", v) for v in range(1, 5)]
    r.collect(10)
    assert spy.deleted[4:] == [rollout_version_prefix("r", v) for v in (5, 6)]  # never v1..v4 again
    assert r.collect(10) == 0 and len(spy.deleted) == 6
    status = StatusPublisher(bucket, "r", heartbeat_s=10)
    status.write("running", 10, 0, step_s=1.0, kept_from=r.kept_from)
    again = StatusPublisher(bucket, "r", heartbeat_s=10).prior
    assert again is not None and again.rollouts_kept_from == 7  # a restarted trainer starts at v7


def test_a_failed_delete_is_retried_not_skipped(bucket):
    spy = Spy(bucket, fail_at=3)
    r = RolloutRetention(cast(Bucket, spy), "r", staleness_bound=3, keep_extra=0)
    assert r.collect(10) == 4 and r.kept_from == 3  # v1, v2 went; v3 failed and stops here
    assert r.collect(10) == 8 and versions_left(bucket) == list(range(7, 11))


def test_the_trainer_deletes_rollout_versions_that_leave_its_window(tmp_path, stoa_cache):
    """The trainer's step runs retention: after three steps (v4, staleness bound 1, keep 0) v1 and v2 are gone."""
    from stoa.trainer.loop import _Trainer
    from tests.test_lifecycle import make_trainer_cfg
    from tests.test_trainer_overlap import entries

    t = _Trainer(make_trainer_cfg(str(tmp_path / "b"), keep_rollout_versions=0), echo=lambda *_: None)
    try:
        t.open_lifecycle()
        t.last_step_at = 0.0  # set by loop(), which this test drives by hand
        t.resume()  # publishes v1
        for v in range(1, 5):
            for seq in range(2):
                t.bucket.put_create(rollout_key("r", v, "old", seq), b"x")
        for k in range(3):
            t.train(entries(k))
        t.settle_publish()
        assert t.version == 4 and t.retention.kept_from == 3
        assert versions_left(t.bucket) == [3, 4] and t.deleted_objects == 4
    finally:
        t.close()
