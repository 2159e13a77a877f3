"""Bucket keys: every key of a run as docs/architecture.md spells it, and the parsers of listed keys."""

from __future__ import annotations

import pytest

from stoa import layout
from stoa.layout import AnchorObject, RolloutKey


def test_every_key_of_a_run_as_documented():
    r = "r1"
    assert [
        layout.run_prefix(r),
        layout.contract_key(r),
        layout.model_prefix(r),
        layout.model_file_key(r, "tokenizer.json"),
        layout.weights_prefix(r),
        layout.pointer_key(r),
        layout.anchors_prefix(r),
        layout.anchor_prefix(r, 20) + layout.ANCHOR_FILE,
        layout.anchor_prefix(r, 20) + layout.ANCHOR_MANIFEST,
        layout.patches_prefix(r),
        layout.patch_key(r, 21),
        layout.rollouts_prefix(r),
        layout.rollout_version_prefix(r, 42),
        layout.rollout_key(r, 42, "w-1", 7),
        layout.trainer_prefix(r),
        layout.checkpoint_key(r),
        layout.journal_key(r),
        layout.lease_key(r),
        layout.metrics_prefix(r),
        layout.logs_prefix(r),
        layout.status_key(r),
        layout.metrics_chunk_key(r, "trainer", 1764552000, 3),
        layout.provenance_key(r, 12),
    ] == [
        "runs/r1",
        "runs/r1/run.json",
        "runs/r1/model/",
        "runs/r1/model/tokenizer.json",
        "runs/r1/weights/",
        "runs/r1/weights/current.json",
        "runs/r1/weights/anchors/",
        "runs/r1/weights/anchors/v00000020/model.safetensors",
        "runs/r1/weights/anchors/v00000020/manifest.json",
        "runs/r1/weights/versions/",
        "runs/r1/weights/versions/v00000021.patch",
        "runs/r1/rollouts/",
        "runs/r1/rollouts/v00000042/",
        "runs/r1/rollouts/v00000042/w-1-00000007.rec",
        "runs/r1/trainer/",
        "runs/r1/trainer/checkpoint.safetensors",
        "runs/r1/trainer/journal.json",
        "runs/r1/trainer/lease.json",
        "runs/r1/metrics/",
        "runs/r1/logs/",
        "runs/r1/status.json",
        "runs/r1/metrics/trainer-1764552000-00000003.jsonl",
        "runs/r1/trainer/provenance/s00000012.jsonl",
    ]


def test_listing_order_is_version_order():
    keys = [layout.patch_key("r", v) for v in (1, 9, 10, 123)]
    assert sorted(keys) == keys
    assert sorted(layout.rollout_version_prefix("r", v) for v in (10, 2)) == [
        layout.rollout_version_prefix("r", 2), layout.rollout_version_prefix("r", 10)]


def test_parsers_invert_the_key_functions():
    assert layout.parse_rollout_key("r", layout.rollout_key("r", 42, "host-a.b_c-1", 7)) == RolloutKey(
        42, "host-a.b_c-1", 7)
    assert layout.parse_patch_key("r", layout.patch_key("r", 21)) == 21
    assert layout.parse_anchor_key("r", layout.anchor_prefix("r", 20) + "manifest.json") == AnchorObject(
        20, "manifest.json")


@pytest.mark.parametrize("key", [
    "runs/r2/rollouts/v00000001/w-00000001.rec",  # another run
    "runs/x/rollouts/v00000001/w-00000001.rec",  # another run, same id length
    "runs/rr/rollouts/v00000001/w-00000001.rec",  # a run whose id starts with the same letter
    "runs/r/rollouts/v1/w-00000001.rec",  # unpadded version
    "runs/r/rollouts/v00000001/-w-00000001.rec",  # worker id starting with '-'
    "runs/r/rollouts/v00000001/w/x-00000001.rec",  # a nested path
    "runs/r/rollouts/v00000001/w-00000001.rec.tmp",
    "runs/r/weights/versions/v00000001.patch",
])
def test_parse_rollout_key_refuses_other_keys(key):
    assert layout.parse_rollout_key("r", key) is None


@pytest.mark.parametrize("key", [
    "runs/r2/weights/versions/v00000001.patch", "runs/x/weights/versions/v00000001.patch",
    "runs/r/weights/versions/v1.patch",
    "runs/r/weights/versions/v00000001.patch.part", "runs/r/weights/anchors/v00000001/manifest.json",
])
def test_parse_patch_key_refuses_other_keys(key):
    assert layout.parse_patch_key("r", key) is None


@pytest.mark.parametrize("key", [
    "runs/r2/weights/anchors/v00000001/manifest.json", "runs/x/weights/anchors/v00000001/manifest.json",
    "runs/r/weights/anchors/v1/manifest.json",
    "runs/r/weights/anchors/v00000001/sub/manifest.json", "runs/r/weights/anchors/v00000001",
    "runs/r/weights/versions/v00000001.patch",
])
def test_parse_anchor_key_refuses_other_keys(key):
    assert layout.parse_anchor_key("r", key) is None


def test_rollout_worker_and_label():
    key = layout.rollout_key("r", 3, "my-host-a1b2c3", 42)
    assert layout.rollout_worker(key) == "my-host-a1b2c3"
    assert layout.rollout_worker("runs/r/weights/current.json") is None
    assert layout.rollout_label(key) == "v00000003/my-host-a1b2c3-00000042.rec"


def test_metrics_chunk_keys_parse_back_and_other_keys_do_not():
    key = layout.metrics_chunk_key("r", "w-a.1", 1764552000, 12)
    assert layout.parse_metrics_chunk_key("r", key) == layout.MetricsChunk("w-a.1", 1764552000, 12)
    for bad in ("runs/r/metrics/trainer.jsonl", "runs/r/metrics/trainer-1-00000001.jsonl",
                layout.metrics_chunk_key("other", "trainer", 1, 1), key + ".tmp",
                "runs/r/metrics/-0000000001-00000001.jsonl"):
        assert layout.parse_metrics_chunk_key("r", bad) is None, bad


def test_parse_provenance_key_inverts_and_refuses_other_keys():
    assert layout.parse_provenance_key("r", layout.provenance_key("r", 12)) == 12
    for key in ("runs/r2/trainer/provenance/s00000001.jsonl", "runs/r/trainer/provenance/s1.jsonl",
                "runs/r/trainer/provenance/s00000001.jsonl.tmp", "runs/r/trainer/provenance/x/s00000001.jsonl",
                "runs/r/trainer/journal.json"):
        assert layout.parse_provenance_key("r", key) is None
