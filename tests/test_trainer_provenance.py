"""The trainer writes each step's provenance and ``stoa audit`` reads it back: the workers, versions, lags and
steps of the groups it trained on, and the liar's disagreement next to the honest worker's (in-process trainer,
tiny model, local bucket)."""

from __future__ import annotations

import json

import pytest

from stoa.bucket import BucketUnreachable, open_bucket
from stoa.cli import main
from stoa.layout import provenance_key, provenance_prefix
from stoa.observe.audit import read_audit
from tests.test_lifecycle import make_trainer_cfg
from tests.test_trainer_quarantine import OFF, lag0_entries


@pytest.fixture
def trainer(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(make_trainer_cfg(str(tmp_path / "b")), echo=lambda *_: None)
    t.open_lifecycle()
    t.last_step_at = 0.0  # set by loop(), which these tests drive by hand
    yield t
    t.close()


class FailingProvenance:
    """The trainer's bucket with every provenance upload failing."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_create(self, key, data):
        if key.startswith(provenance_prefix("r")):
            raise BucketUnreachable("injected: provenance upload down")
        return self.inner.put_create(key, data)


def _two_steps(t) -> None:
    """Step 1: an honest and a lying worker at lag 0; step 2: the honest worker's step-1 version (lag 1)."""
    t.resume()  # publishes v1
    t.train(lag0_entries(t, "honest", 0.0, seed=1) + lag0_entries(t, "liar", -OFF, seed=2))
    t.settle_publish()
    late = lag0_entries(t, "late", 0.0, seed=3)  # sampled at v2 ...
    t.train(lag0_entries(t, "honest", 0.0, seed=4)[:1] + late[:1])
    t.settle_publish()


def test_audit_names_each_steps_workers_versions_lags_and_the_liars_disagreement(trainer, capsys):
    t = trainer
    _two_steps(t)
    audit = read_audit(open_bucket(t.cfg.bucket), "r")
    assert (audit.objects, audit.skipped_lines, audit.skipped_objects) == (2, 0, 0)
    got = [(r.step, r.worker, r.version, r.lag, r.recompute) for r in audit.rows]
    assert got == [(1, "honest", 1, 0, "ok"), (1, "honest", 1, 0, "ok"), (1, "liar", 1, 0, "ok"),
                   (1, "liar", 1, 0, "ok"), (2, "honest", 2, 0, "ok"), (2, "late", 2, 0, "ok")]
    by = {(r.step, r.worker): r for r in audit.rows}
    assert by[(1, "liar")].residual == pytest.approx(2.718281828 ** OFF - 1, rel=0.05)  # exp(0.7) - 1 = 1.01
    assert (by[(1, "honest")].residual or 0.0) < 0.05 and by[(1, "honest")].residual is not None
    assert {r.signature for r in audit.rows} == {"unsigned"} and {r.replay for r in audit.rows} == {"-"}
    assert [r.record for r in audit.rows][:2] == ["v00000001/honest-00000000.rec", "v00000001/honest-00000001.rec"]
    assert read_audit(open_bucket(t.cfg.bucket), "r", step=2).rows == audit.rows[4:]


def test_a_lagged_group_is_not_judged_and_says_so(trainer):
    t = trainer
    t.resume()
    old = lag0_entries(t, "slow", 0.0, seed=5)  # sampled at v1, trained at v2: lag 1
    t.train(lag0_entries(t, "honest", 0.0, seed=1))
    t.train(old)
    t.settle_publish()
    rows = [r for r in read_audit(open_bucket(t.cfg.bucket), "r").rows if r.worker == "slow"]
    assert [(r.step, r.version, r.lag, r.recompute, r.residual) for r in rows] == [(2, 1, 1, "lagged", None)] * 2


def test_the_audit_command_prints_the_table_and_exports_jsonl(trainer, capsys, tmp_path):
    t = trainer
    _two_steps(t)
    assert main(["audit", "--bucket", t.cfg.bucket, "--run", "r"]) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines()]
    assert table[0] == ["step", "worker", "version", "lag", "replay", "recompute", "residual", "signature", "record"]
    liar = next(cells for cells in table if cells[:2] == ["1", "liar"])
    assert liar[2:6] == ["v1", "0", "-", "ok"] and 0.9 < float(liar[6]) < 1.1 and liar[7] == "unsigned"
    assert "worker liar: 2 groups" in out and "run r: 6 groups over 2 steps (2 objects)" in out
    dest = tmp_path / "audit.jsonl"
    assert main(["audit", "--bucket", t.cfg.bucket, "--run", "r", "--jsonl", "--out", str(dest)]) == 0
    lines = [json.loads(line) for line in dest.read_text().splitlines()]
    assert [(d["step"], d["worker"], d["version"], d["lag"]) for d in lines][-2:] == [(2, "honest", 2, 0),
                                                                                      (2, "late", 2, 0)]


def test_a_provenance_write_that_fails_is_counted_and_training_goes_on(trainer):
    t = trainer
    t.provenance.bucket = FailingProvenance(t.bucket)
    rows, log = [], t.metrics.log
    t.metrics.log = lambda row, **kw: (rows.append(row), log(row, **kw))
    t.resume()
    t.train(lag0_entries(t, "honest", 0.0, seed=1))
    t.train(lag0_entries(t, "honest", 0.0, seed=2))
    t.settle_publish()
    assert (t.step, t.version, t.provenance.failed, t.provenance.written) == (2, 3, 2, 0)
    assert [r["train/provenance_unwritten"] for r in rows if "train/provenance_unwritten" in r] == [0, 1]
    assert not open_bucket(t.cfg.bucket).exists(provenance_key("r", 1))


def test_a_group_the_recompute_check_drops_reads_rejected(trainer):
    t = trainer
    t.resume()
    t.train(lag0_entries(t, "honest", 0.0, seed=1)[:1] + lag0_entries(t, "forger", -2.0, seed=2)[:1])
    t.settle_publish()
    rows = {r.worker: r for r in read_audit(open_bucket(t.cfg.bucket), "r").rows}
    assert rows["forger"].recompute == "rejected" and (rows["forger"].residual or 0.0) > 3.0  # exp(2) - 1 = 6.4
    assert rows["honest"].recompute == "ok"
