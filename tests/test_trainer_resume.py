"""Trainer start-up and restart against a hostile or failing bucket (in-process, tiny model)."""

from __future__ import annotations

import pytest

from stoa.bucket import BucketUnreachable, PreconditionFailed, open_bucket
from stoa.config import TrainerConfig
from stoa.contract import RunContract
from stoa.layout import anchor_prefix, contract_key, patch_key
from stoa.trainer.loop import _Trainer, ride_out
from stoa.weights.sync import WeightSync


def make_cfg(bucket: str, **kw) -> TrainerConfig:
    base = dict(bucket=bucket, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                anchor_every=100)
    return TrainerConfig(**{**base, **kw}).validate()


def test_restart_over_a_corrupt_newest_patch_publishes_a_fresh_anchor(tmp_path, stoa_cache):
    from stoa.trainer import checkpoint as ckpt

    url = str(tmp_path / "b")
    t1 = _Trainer(make_cfg(url), echo=lambda *_: None)
    t1.resume()  # fresh run: publishes v1 (an anchor)
    t1.publish(2)  # v2 as a patch
    ckpt.save_checkpoint(t1.bucket, "r", t1.policy.model, t1.opt, version=2, step=1)
    t1.close()  # the first trainer stops (releases the lease)
    bucket = open_bucket(url)
    patch = bytearray(bucket.get(patch_key("r", 2)))
    patch[len(patch) // 2] ^= 0xFF
    bucket.put(patch_key("r", 2), bytes(patch))  # the newest patch no longer verifies

    lines: list[str] = []
    t2 = _Trainer(make_cfg(url), echo=lines.append)
    t2.resume()  # must not raise
    assert t2.version == 2 and t2.publisher.resume_error is not None
    assert t2.lag0_trusted  # its checkpoint is the master of the published v2: lag-0 records can be judged
    assert any("does not verify" in line for line in lines)
    info = t2.publish(3)
    assert info.bytes_anchor > 0 and bucket.exists(anchor_prefix("r", 3) + "manifest.json")
    version, _ = WeightSync(bucket, "r", "bf16").sync()  # a fresh worker reaches v3
    assert version == 3


def test_a_new_run_writes_model_files_before_the_contract(tmp_path, stoa_cache):
    order: list[str] = []
    inner = open_bucket(str(tmp_path / "b"))

    class Spy:
        def __getattr__(self, name):
            return getattr(inner, name)

        def put_create(self, key, data):
            order.append(key)
            return inner.put_create(key, data)

    from stoa.models import resolve_model
    from stoa.tasks import get_task
    from stoa.tokenize import TextCodec
    from stoa.trainer.setup import build_contract, ensure_contract

    cfg = make_cfg(str(tmp_path / "b"))
    model_dir = resolve_model("tiny")
    contract = build_contract(cfg, model_dir, get_task("toy"), TextCodec(model_dir), 512)
    ensure_contract(Spy(), contract, model_dir)
    assert order[-1] == contract_key("r") and any("/model/config.json" in k for k in order[:-1])
    ensure_contract(Spy(), contract, model_dir)  # a restart verifies and re-checks, idempotently


def test_ride_out_retries_outages_but_not_conflicts(monkeypatch):
    monkeypatch.setattr("stoa.trainer.loop.time.sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise BucketUnreachable("endpoint down")
        return "ok"

    assert ride_out(flaky, "x", echo=lambda *_: None) == "ok" and len(calls) == 4

    def conflict():
        raise PreconditionFailed("moved")

    with pytest.raises(PreconditionFailed):
        ride_out(conflict, "x", echo=lambda *_: None)


def test_restart_without_checkpoint_continues_from_the_newest_verified_weights(tmp_path, stoa_cache):
    import torch

    url = str(tmp_path / "b")
    t1 = _Trainer(make_cfg(url), echo=lambda *_: None)
    t1.resume()  # v1 = the base weights
    v1 = {k: v.detach().clone() for k, v in t1.policy.model.named_parameters()}
    with torch.no_grad():
        for p in t1.policy.model.parameters():
            p.add_(0.05)
    t1.publish(2)
    t1.close()
    bucket = open_bucket(url)
    patch = bytearray(bucket.get(patch_key("r", 2)))
    patch[len(patch) // 2] ^= 0xFF
    bucket.put(patch_key("r", 2), bytes(patch))

    lines: list[str] = []
    t2 = _Trainer(make_cfg(url, seed=1), echo=lines.append)
    with torch.no_grad():  # start t2 away from v1, so loading v1 is observable
        for p in t2.policy.model.parameters():
            p.add_(1.0)
    t2.resume()
    assert t2.version == 2 and any("newest verified weights, v1" in line for line in lines), lines
    assert not t2.lag0_trusted  # lag-0 records came from v2, which this trainer cannot reproduce
    for k, v in t2.policy.model.named_parameters():  # the bf16 plane of v1, within bf16 rounding
        torch.testing.assert_close(v.detach(), v1[k], atol=0, rtol=2 ** -8)


def test_restart_with_a_checkpoint_behind_the_pointer_continues_from_the_published_weights(tmp_path, stoa_cache):
    import torch

    from stoa.trainer import checkpoint as ckpt
    from stoa.weights.hashing import state_hash
    from stoa.weights.planes import state_from_f32

    url = str(tmp_path / "b")
    t1 = _Trainer(make_cfg(url), echo=lambda *_: None)
    t1.resume()
    ckpt.save_checkpoint(t1.bucket, "r", t1.policy.model, t1.opt, version=1, step=0)
    with torch.no_grad():
        for p in t1.policy.model.parameters():
            p.add_(0.05)
    t1.publish(2)  # killed before its checkpoint: checkpoint v1, pointer v2
    t1.close()
    t2 = _Trainer(make_cfg(url), echo=lambda *_: None)
    t2.resume()
    _, published = WeightSync(open_bucket(url), "r", "bf16").sync()
    assert t2.version == 2
    assert state_hash(state_from_f32(t2.policy.export_f32(), "bf16")) == state_hash(published)


def new_run(url: str, **kw) -> None:
    """A run with its contract, v1 and a released lease (its trainer stopped)."""
    t = _Trainer(make_cfg(url, **kw), echo=lambda *_: None)
    t.resume()
    t.close()


def test_a_restart_with_only_bucket_and_run_takes_the_contract_settings(tmp_path, stoa_cache):
    from stoa.trainer.setup import resume_config

    url = str(tmp_path / "b")
    new_run(url, n_samples=3, temperature=0.7, max_new_tokens=12, reuse_cap=1, algorithm="dapo", plane="int8g64")
    bare = TrainerConfig(bucket=url, run="r", model="elsewhere").validate()
    cfg = resume_config(bare, {"bucket": "--bucket", "run": "--run"}, echo=lambda *_: None)
    assert (cfg.n_samples, cfg.temperature, cfg.max_new_tokens, cfg.reuse_cap, cfg.plane, cfg.task, cfg.algorithm) \
        == (3, 0.7, 12, 1, "int8g64", "toy", "dapo")
    assert cfg.model == "tiny"  # the last trainer's --model, recorded in its lease
    t = _Trainer(cfg, echo=lambda *_: None)  # the contract it builds equals the run's
    assert t.contract.fingerprint() == RunContract.from_json(open_bucket(url).get(contract_key("r"))).fingerprint()
    t.close()


def test_a_flag_that_contradicts_the_run_is_an_error_showing_both_values(tmp_path, stoa_cache):
    from stoa.contract import ContractMismatch
    from stoa.trainer.setup import resume_config

    url = str(tmp_path / "b")
    new_run(url, n_samples=8)
    with pytest.raises(ContractMismatch, match=r"n_samples \(run 'r' has 8, --n-samples says 6; leave --n-samples"):
        resume_config(make_cfg(url, n_samples=6), {"n_samples": "--n-samples"})
    with pytest.raises(ContractMismatch, match=r"task \(run 'r' has toy .*, --task says arithmetic"):
        resume_config(make_cfg(url, n_samples=8, task="arithmetic"), {"task": "--task"})
    with pytest.raises(ContractMismatch, match=r"algorithm.name \(run 'r' has grpo, --algorithm says dapo"):
        resume_config(make_cfg(url, n_samples=8, algorithm="dapo"), {"algorithm": "--algorithm"})
    with pytest.raises(ContractMismatch, match="model.config_hash"):
        resume_config(make_cfg(url, n_samples=8, model="tiny-qwen2"), {"model": "--model"})
    same = resume_config(make_cfg(url, n_samples=8), {"n_samples": "--n-samples", "model": "--model"})
    assert same.n_samples == 8 and same.model == "tiny"  # agreeing flags are fine


def test_without_a_usable_model_the_run_rebuilds_it_from_the_bucket(tmp_path, stoa_cache):
    from stoa.layout import lease_key
    from stoa.schemas.control import LeaseRecord
    from stoa.trainer.setup import resume_config
    from stoa.weights.hashing import state_hash
    from stoa.weights.planes import state_from_f32

    url = str(tmp_path / "b")
    new_run(url)
    bucket = open_bucket(url)
    rec = LeaseRecord.from_json(bucket.get(lease_key("r")))
    bucket.put(lease_key("r"), LeaseRecord(**{**rec.__dict__, "model": str(tmp_path / "gone")}).to_json())
    cfg = resume_config(TrainerConfig(bucket=url, run="r").validate(), {}, echo=lambda *_: None)
    assert cfg.model.startswith(str(stoa_cache))
    t = _Trainer(cfg, echo=lambda *_: None)
    t.resume()
    _, published = WeightSync(bucket, "r", "bf16").sync()
    assert t.version == 1
    assert state_hash(state_from_f32(t.policy.export_f32(), "bf16")) == state_hash(published)
    t.close()


def test_steps_counts_the_run_total_across_restarts(tmp_path, stoa_cache):
    from stoa.trainer import checkpoint as ckpt

    url = str(tmp_path / "b")
    new_run(url)
    ckpt.write_journal(open_bucket(url), "r", {"version": 1, "step": 3, "pool": {}, "quarantine": {}})
    t = _Trainer(make_cfg(url, steps=3, max_wait_seconds=1, poll_seconds=0.05), echo=lambda *_: None)
    summary = t.run()  # the run already took 3 steps: nothing to do (no wait for records)
    t.close()
    assert summary["step"] == 3 and summary["version"] == 1
