"""Worker start-up checks: contract expectations and model fingerprints, refused with the field named."""

from __future__ import annotations

import json
import shutil

import pytest

from stoa.config import WorkerConfig, load_config
from stoa.contract import ContractMismatch, ModelSpec, RunContract, SamplingSpec
from stoa.worker.loop import check_expectations, check_model, worker_id


def contract(model: ModelSpec | None = None) -> RunContract:
    return RunContract(run_id="r", model=model or ModelSpec("llama", "c", "t", 512), n_samples=4, plane="bf16",
                       task_id="toy", task_spec={}, reward_version="1", sampling=SamplingSpec())


def test_plane_and_group_size_expectations():
    check_expectations(load_config(WorkerConfig, env={}), contract())
    cfg = load_config(WorkerConfig, env={"DRL_PULSE_PLANE": "int8g64", "DRL_N_SAMPLES": "8"})
    with pytest.raises(ContractMismatch) as e:
        check_expectations(cfg, contract())
    assert e.value.fields == ["plane", "n_samples"]


def test_model_that_differs_from_the_contract_is_refused(tiny_dir, tmp_path):
    from stoa.models import model_fingerprint

    fp = model_fingerprint(tiny_dir)
    good = contract(ModelSpec(fp.architecture, fp.config_hash, fp.tokenizer_hash, 512))
    check_model(tiny_dir, good)
    other = tmp_path / "m"
    shutil.copytree(tiny_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    if "rope_parameters" in cfg:
        cfg["rope_parameters"]["rope_theta"] = 1234.0
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ContractMismatch) as e:
        check_model(other, good)
    assert e.value.fields == ["model.config_hash"]


def test_worker_ids_are_key_safe_and_unique():
    a, b = worker_id("my mac/1"), worker_id("my mac/1")
    assert a != b and "/" not in a and " " not in a
