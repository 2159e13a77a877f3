"""A signed run's join card carries its public key, and the worker it launches pins it."""

from __future__ import annotations

import json
import time

import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.join.card import CardError, card_text, card_toml, make_card, read_card
from stoa.join.launch import worker_argv
from stoa.layout import contract_key
from stoa.weights.signing import create_key


def test_a_signed_runs_card_carries_its_key_to_the_worker(local_bucket, tmp_path):
    signer = create_key(tmp_path / "k")
    contract = RunContract(run_id="r1", model=ModelSpec("llama", "c" * 32, "t" * 32, 512), n_samples=4, plane="bf16",
                           task_id="toy", task_spec={}, reward_version="1", sampling=SamplingSpec(),
                           created_at=time.time())
    open_bucket(local_bucket).put_create(contract_key("r1"), signer.sign_contract(contract).to_json())
    out = tmp_path / "card.toml"
    assert main(["join-card", "--bucket", local_bucket, "--run", "r1", "--out", str(out), "--no-worker-key"]) == 0
    card = read_card(out)
    assert card.run_key == signer.public_hex and card == make_card(local_bucket, "r1", env={})
    argv = worker_argv(card)
    assert argv[argv.index("--run-key-pub") + 1] == signer.public_hex
    assert signer.public_hex in card_text(card, "card.toml") and signer.public_hex in card_toml(card)


@pytest.mark.parametrize("bad", ["ab" * 31, "AB" * 32, 7, 0, "g" * 64])
def test_a_card_with_a_malformed_key_is_refused(tmp_path, bad):
    data = {"card_version": 1, "bucket": "b", "run": "r", "n_samples": 2, "plane": "bf16", "task": "toy",
            "contract": "c", "search": False, "retriever": "", "credentials": [], "run_key": bad}
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(CardError, match="'run_key'"):
        read_card(tmp_path / "c.json")
