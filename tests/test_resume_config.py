"""A run keeps its whole trainer configuration: stored at start, merged on restart (refused or logged changes)."""

from __future__ import annotations

import json

import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.config import ConfigError, TrainerConfig
from stoa.contract import ContractMismatch
from stoa.layout import contract_key, trainer_config_key
from stoa.trainer.resume import Change, config_bytes, merge, parse_config, stored_settings
from tests.test_trainer_resume import make_cfg, new_run


def stored(**kw) -> dict:
    return stored_settings(TrainerConfig(**{"task": "toy", "lr": 1e-3, "groups_per_step": 4, "steps": 30, **kw}))


def test_stored_settings_hold_neither_secrets_nor_machine_local_fields():
    cfg = TrainerConfig(bucket="s3://b/prefix", run="r", log_dir="/home/me/logs", retriever="http://u:p@h:1",
                        model="/home/me/model", device="cuda:3", available_memory_gb=80.0)
    doc = json.loads(config_bytes(cfg))
    assert set(doc["settings"]).isdisjoint({"bucket", "run", "log_dir", "retriever", "model", "device",
                                             "available_memory_gb"})
    text = config_bytes(cfg).decode()
    assert "s3://b" not in text and "/home/me" not in text and "u:p" not in text
    assert doc["settings"]["lr"] == 1e-5 and doc["settings"]["groups_per_step"] == 8
    assert parse_config(config_bytes(cfg), "r") == stored_settings(cfg)  # round trip


def test_a_bare_restart_takes_every_stored_setting():
    merged = merge(TrainerConfig(run="r", task="toy"), stored(), {"bucket": "--bucket", "run": "--run"})
    assert (merged.cfg.lr, merged.cfg.groups_per_step, merged.cfg.steps) == (1e-3, 4, 30)
    assert merged.changes == []


def test_a_given_setting_that_agrees_is_fine_and_one_that_differs_is_refused_naming_both_values():
    same = merge(TrainerConfig(run="r", task="toy", lr=1e-3), stored(), {"lr": "--lr"})
    assert same.cfg.lr == 1e-3 and same.changes == []
    with pytest.raises(ContractMismatch, match=r"lr \(run 'r' has 0.001, --lr says 1e-05; leave --lr out"):
        merge(TrainerConfig(run="r", task="toy"), stored(), {"lr": "--lr"})
    with pytest.raises(ContractMismatch, match=r"groups_per_step \(run 'r' has 4, groups_per_step in a.toml says 8"):
        merge(TrainerConfig(run="r", task="toy"), stored(), {"groups_per_step": "groups_per_step in a.toml"})
    with pytest.raises(ContractMismatch, match=r"skip_uniform_groups \(run 'r' has True, DRL_X says False"):
        merge(TrainerConfig(run="r", task="toy", skip_uniform_groups=False), stored(), {"skip_uniform_groups": "DRL_X"})


def test_settings_that_may_change_take_the_new_value_and_are_reported():
    cfg = TrainerConfig(run="r", task="toy", steps=60, checkpoint_minutes=5.0, eval_every=10)
    merged = merge(cfg, stored(), {"steps": "--steps", "checkpoint_minutes": "DRL_X", "eval_every": "--eval-every"})
    assert (merged.cfg.steps, merged.cfg.checkpoint_minutes, merged.cfg.eval_every, merged.cfg.lr) == (60, 5.0, 10,
                                                                                                      1e-3)
    assert merged.changes == [Change("steps", 30, 60, "--steps"), Change("eval_every", 0, 10, "--eval-every"),
                              Change("checkpoint_minutes", 30.0, 5.0, "DRL_X")]


def test_contract_settings_are_left_to_the_contract():
    merged = merge(TrainerConfig(run="r", task="arithmetic", n_samples=4), stored(n_samples=6),
                   {"n_samples": "--n-samples", "task": "--task"})
    assert (merged.cfg.n_samples, merged.cfg.task) == (4, "arithmetic")  # resume_config checked them already


@pytest.mark.parametrize("data", [b"not json", b"[]", b'{"format": "other", "settings": {}}',
                                  b'{"format": "stoa-trainer-config-1", "settings": {"lr": "fast"}}',
                                  b'{"format": "stoa-trainer-config-1", "settings": []}'])
def test_a_malformed_stored_config_is_a_config_error(data):
    with pytest.raises(ConfigError):
        parse_config(data, "r")


def test_settings_this_version_does_not_know_are_dropped():
    data = json.dumps({"format": "stoa-trainer-config-1", "settings": {"lr": 0.01, "warp_drive": 9}}).encode()
    assert parse_config(data, "r") == {"lr": 0.01}


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_a_new_run_stores_its_config_and_a_bare_restart_resumes_with_it(tmp_path, stoa_cache, capsys):
    url = str(tmp_path / "b")
    new_run(url, lr=1e-3, groups_per_step=4, steps=30)
    assert json.loads(open_bucket(url).get(trainer_config_key("r")))["settings"]["lr"] == 1e-3
    code, out, _ = _cli(["trainer", "--dry-run", "--bucket", url, "--run", "r"], capsys)
    assert code == 0
    assert "lr = 0.001\n" in out and "groups_per_step = 4\n" in out and "steps = 30\n" in out
    assert "# [trainer] run 'r': resuming with its stored settings\n" in out
    code, out, _ = _cli(["trainer", "--dry-run", "--bucket", url, "--run", "r", "--steps", "50"], capsys)
    assert code == 0 and "steps = 50\n" in out
    assert "resuming with its stored settings, changed: steps 30 -> 50 (--steps)" in out


def test_a_contradicting_flag_exits_3_on_one_line_and_writes_nothing(tmp_path, stoa_cache, capsys):
    url = str(tmp_path / "b")
    new_run(url, lr=1e-3)
    capsys.readouterr()
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "b").rglob("*"))
    code, _, err = _cli(["trainer", "--bucket", url, "--run", "r", "--lr", "2e-3"], capsys)
    assert (code, err) == (3, "stoa: run contract mismatch in field(s): lr (run 'r' has 0.001, --lr says 0.002; "
                              "leave --lr out to resume with the run's settings, or start a new --run)\n")
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "b").rglob("*")) == before


def test_a_malformed_stored_config_exits_2_on_one_line(tmp_path, stoa_cache, capsys):
    url = str(tmp_path / "b")
    new_run(url)
    open_bucket(url).put(trainer_config_key("r"), b"{oops")
    capsys.readouterr()
    code, _, err = _cli(["trainer", "--dry-run", "--bucket", url, "--run", "r"], capsys)
    assert code == 2 and err.count("\n") == 1 and "runs/r/config.json is not a stored trainer configuration" in err


def test_a_run_without_stored_config_resumes_as_before_with_one_warning_and_stores_it(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer
    from stoa.trainer.setup import resume_config

    url = str(tmp_path / "b")
    new_run(url, lr=1e-3)
    bucket = open_bucket(url)
    bucket.delete(trainer_config_key("r"))  # a run an older stoa started
    lines: list[str] = []
    cfg = resume_config(TrainerConfig(bucket=url, run="r").validate(), {"run": "--run"}, echo=lines.append)
    assert cfg.lr == 1e-5 and cfg.task == "toy"  # as before: the contract's settings, this command's others
    assert len(lines) == 2 and "has no stored trainer settings" in lines[1]  # lines[0]: the model note
    t = _Trainer(cfg, echo=lambda *_: None)
    t.close()
    assert json.loads(bucket.get(trainer_config_key("r")))["settings"]["lr"] == 1e-5  # the next restart keeps it


def test_the_config_goes_up_before_the_contract(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    url = str(tmp_path / "b")
    order: list[str] = []
    inner = open_bucket(url)
    real_put, real_create = inner.put, inner.put_create
    inner.put = lambda key, data: (order.append(key), real_put(key, data))[1]
    inner.put_create = lambda key, data: (order.append(key), real_create(key, data))[1]
    import stoa.trainer.loop as loop

    orig = loop.open_bucket
    loop.open_bucket = lambda _url: inner
    try:
        _Trainer(make_cfg(url), echo=lambda *_: None).close()
    finally:
        loop.open_bucket = orig
    assert order.index(trainer_config_key("r")) < order.index(contract_key("r"))


def test_trainer_requires_run_and_a_new_run_requires_model(tmp_path, stoa_cache, capsys, monkeypatch):
    url = str(tmp_path / "b")
    monkeypatch.delenv("DRL_RUN", raising=False)
    monkeypatch.delenv("STOA_RUN", raising=False)
    code, _, err = _cli(["trainer", "--dry-run", "--bucket", url, "--model", "tiny"], capsys)  # a dry run refuses too
    assert code == 2 and err.startswith("stoa: invalid setting run: required: name the run with --run")
    code, _, err = _cli(["trainer", "--dry-run", "--bucket", url, "--run", "r"], capsys)
    assert code == 2 and err.startswith("stoa: invalid setting model: required for a new run ('r' is not in")
    code, _, err = _cli(["trainer", "--dry-run", "--bucket", url, "--run", "r", "--model", "smollm"], capsys)
    assert (code, err.count("\n")) == (2, 1) and err.startswith("stoa: unknown model 'smollm'; use a built-in name")
    assert not (tmp_path / "b").exists()  # nothing was created
    monkeypatch.setenv("STOA_RUN", "r")  # an environment variable counts as given, and so does a TOML key
    assert _cli(["trainer", "--dry-run", "--bucket", url, "--model", "tiny", "--task", "toy"], capsys)[0] == 0
    monkeypatch.delenv("STOA_RUN")
    toml = tmp_path / "t.toml"
    toml.write_text('run = "r"\nmodel = "tiny"\n')
    assert _cli(["trainer", "--dry-run", "--bucket", url, "--config", str(toml)], capsys)[0] == 0
    new_run(url)
    assert _cli(["trainer", "--dry-run", "--bucket", url, "--run", "r"], capsys)[0] == 0  # resuming: no --model


def test_worker_requires_run(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DRL_RUN", raising=False)
    monkeypatch.delenv("STOA_RUN", raising=False)
    code, _, err = _cli(["worker", "--bucket", str(tmp_path / "b"), "--dry-run"], capsys)  # a dry run refuses too
    assert (code, err) == (2, "stoa: invalid setting run: required: name the trainer's run with --run NAME (stoa "
                              "runs --bucket B lists them), or set run in --config or STOA_RUN\n")
    assert not (tmp_path / "b").exists()
    monkeypatch.setenv("STOA_RUN", "r")
    assert _cli(["worker", "--bucket", str(tmp_path / "b"), "--dry-run"], capsys)[0] == 0
