"""A checkpoint's files come from the bucket: loading one never runs code they ask for.

DCP unpickles ``.metadata`` and the optimizer's non-tensor items; a planted pickle that calls ``os.mkdir`` is
refused (exit 13 naming the fix) before anything unpickles it, and a real checkpoint still round-trips.
"""

from __future__ import annotations

import io
import os
import pickle
import types
from pathlib import Path

import pytest
import torch

from stoa.bucket import open_bucket
from stoa.layout import checkpoint_files_prefix
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.dcp_safe import SafeLoadPlanner, metadata_problem

RUN = "r1"


class _Mkdir:
    """Unpickling this calls ``os.mkdir(path)``: what a planted pickle could do with any function."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    return m, opt


def test_a_real_checkpoint_loads_with_the_safe_planner(tmp_path: Path) -> None:
    bucket = open_bucket(str(tmp_path / "b"))
    m, opt = _model()
    ckpt.save_checkpoint(bucket, RUN, m, opt, version=3, step=2, echo=lambda s: None)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5e-1)
    restored = ckpt.load_checkpoint(bucket, RUN, m2, opt2, echo=lambda s: None)
    assert restored is not None and (restored.version, restored.step) == (3, 2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    version, params = ckpt.checkpoint_params(bucket, RUN) or (0, {})
    assert version == 3 and torch.equal(params["0.weight"], m[0].weight.detach())


def test_planted_metadata_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    from stoa.cli import user_error

    bucket = open_bucket(str(tmp_path / "b"))
    m, opt = _model()
    ckpt.save_checkpoint(bucket, RUN, m, opt, version=3, step=2, echo=lambda s: None)
    ref = ckpt.read_pointer(bucket, RUN)
    assert ref is not None
    marker = tmp_path / "ran"
    evil = pickle.dumps(_Mkdir(str(marker)))
    bucket.put(checkpoint_files_prefix(RUN, ref.tag) + ".metadata", evil)
    bucket.put("runs/r1/trainer/checkpoint.json", ckpt.CheckpointRef(ref.tag, 3, 2, 1, {**ref.files, ".metadata": len(
        evil)}).to_json())
    with pytest.raises(ckpt.CheckpointError) as ei:
        ckpt.load_checkpoint(bucket, RUN, *_model(), echo=lambda s: None)
    assert not marker.exists() and "is not DCP metadata (UnpicklingError: refers to posix.mkdir)" in str(ei.value)
    row = user_error(ei.value)
    assert row is not None and row.code == 13
    with pytest.raises(ckpt.CheckpointError):
        ckpt.checkpoint_params(bucket, RUN)
    assert not marker.exists()


def test_metadata_problem_and_safe_bytes(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for data in (pickle.dumps(_Mkdir(str(marker))), b"garbage", b"", pickle.dumps(print)):
        (tmp_path / "m").write_bytes(data)
        assert metadata_problem(str(tmp_path / "m")) is not None
    buf = io.BytesIO()
    torch.save({"x": _Mkdir(str(marker))}, buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optim.param_groups"))
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buf)  # type: ignore[arg-type]
    assert not marker.exists()


def test_legacy_checkpoint_metadata_is_parsed_totally() -> None:
    key = "runs/r1/trainer/checkpoint.safetensors"
    assert ckpt._legacy_meta({"opt_steps": '{"w": 3}', "version": "4", "step": "5"}, key) == ({"w": 3.0}, 4, 5)
    for meta in ({"opt_steps": "[" * 100_000, "version": "4", "step": "5"}, {"version": "9" * 5000, "step": "1"},
                 {"opt_steps": '{"w": NaN}', "version": "1", "step": "1"}, {"version": "-1", "step": "1"},
                 {"version": "١", "step": "1"}, {}):
        with pytest.raises(ckpt.CheckpointError, match="has malformed metadata"):
            ckpt._legacy_meta(meta, key)


@pytest.fixture(scope="module")
def run_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run at v2 with a checkpoint, its trainer stopped (the model files come from the session cache)."""
    from test_trainer_resume import make_cfg

    from stoa.trainer.loop import _Trainer

    url = str(tmp_path_factory.mktemp("run") / "b")
    t1 = _Trainer(make_cfg(url), echo=lambda *_: None)
    t1.resume()
    t1.publish(2)
    ckpt.save_checkpoint(t1.bucket, "r", t1.policy.model, t1.opt, version=2, step=1, echo=lambda s: None)
    ckpt.write_journal(t1.bucket, "r", {"version": 2, "step": 1, "pool": {}, "quarantine": {}})
    t1.close()
    return url


def _restart(url: str, tmp_path: Path, plant: dict[str, bytes]) -> tuple[object, list[str]]:
    """Copy the run, plant objects, restart a trainer on the copy; (the trainer or the error, its lines)."""
    import shutil

    from test_trainer_resume import make_cfg

    from stoa.trainer.loop import _Trainer

    copy = str(tmp_path / "copy")
    shutil.copytree(url, copy)
    bucket = open_bucket(copy)
    for key, data in plant.items():
        bucket.put(key, data)
    lines: list[str] = []
    t2 = _Trainer(make_cfg(copy), echo=lines.append)
    try:
        t2.resume()
        return t2, lines
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return e, lines
    finally:
        t2.close()


def test_a_restart_over_a_planted_pointer_stops_with_one_line(run_url: str, tmp_path: Path, stoa_cache) -> None:
    from stoa.untrusted import BadBucketObject
    from stoa.weights.pointer import Pointer

    p = Pointer.from_json(open_bucket(run_url).get("runs/r/weights/current.json"))
    ahead = Pointer("r", 2**63 - 1, p.anchor_version, "bf16", p.state_hash, p.updated_at).to_json()
    got, _ = _restart(run_url, tmp_path, {"runs/r/weights/current.json": ahead})
    assert isinstance(got, BadBucketObject) and "is ahead of the published weights" in str(got)


def test_a_restart_ignores_a_hostile_journal_and_stops_on_a_hostile_checkpoint_pointer(
        run_url: str, tmp_path: Path, stoa_cache, caplog) -> None:
    got, lines = _restart(run_url, tmp_path / "j", {"runs/r/trainer/journal.json": b"[1, 2]"})
    assert not isinstance(got, Exception) and got.step == 1 and got.version == 2  # the checkpoint's step
    assert "ignoring runs/r/trainer/journal.json" in caplog.text
    got, _ = _restart(run_url, tmp_path / "c", {"runs/r/trainer/checkpoint.json": b"[" * 100_000})
    assert isinstance(got, ckpt.CheckpointError) and "delete trainer/checkpoint.json" in str(got)
