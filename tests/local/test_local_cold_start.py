"""Local mode's cold start on the tiny model: loss on action tokens only, learning on both backends, backends
agree, the stage before RL in a new run, resume never redoes it, an unfinished stage refuses, bad files."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from stoa.algorithms.batch import micro_batches
from stoa.config import ConfigError
from stoa.episodes.demo_rows import SftRow, build_rows
from stoa.local import saved as ckpt
from stoa.local.coldstart import MARKER, read_marker
from stoa.local.loop import make_backend, run_local
from stoa.local.torch_backend import TorchBackend
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED
from stoa.tasks.arithmetic import ArithmeticTask
from stoa.telemetry.metrics import read_metrics
from stoa.tokenize import TextCodec

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]
A, M, E = ROLE_ACTION, ROLE_MASKED, ROLE_ECHO


def _backend(name, make_cfg, tiny_dir, **kw):
    if name == "mlx":
        pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    return make_backend(make_cfg(backend=name, **({"dtype": "float32"} if name == "mlx" else {}), **kw), tiny_dir)


def _demo_rows(tiny_dir, n=8) -> list[SftRow]:
    task = ArithmeticTask()
    rows, dropped = build_rows(task.demonstrations(n, np.random.default_rng(0)), task, TextCodec(tiny_dir), None,
                               16, strict=True)
    assert dropped == 0 and len(rows) == n
    return rows


def _loss(backend, rows) -> tuple[float, int]:
    """Loss and tokens of one step at lr 0 (AdamW without weight decay moves nothing)."""
    r = backend.sft_step(rows, micro_batches(len(rows), 0), 0.0)
    return r.loss, r.tokens


@pytest.mark.parametrize("name", BACKENDS)
def test_loss_falls_over_steps(name, make_cfg, tiny_dir):
    b = _backend(name, make_cfg, tiny_dir)
    rows = _demo_rows(tiny_dir)
    before = {k: v.copy() for k, v in b.adapter_arrays().items()}  # torch on CPU: views of the live adapters
    losses = [b.sft_step(rows, micro_batches(len(rows), 3), 3e-2) for _ in range(6)]
    assert losses[-1].loss < 0.8 * losses[0].loss, [x.loss for x in losses]  # LoRA on a 64-wide model
    assert all(x.tokens == sum(len(r.tokens) for r in rows) for x in losses)  # single-turn: every token acts
    assert b.optimizer_arrays()[1] == 0  # the RL optimizer never stepped: RL starts with fresh moments
    assert any(not np.array_equal(v, before[k]) for k, v in b.adapter_arrays().items())


@pytest.mark.parametrize("name", BACKENDS)
def test_only_action_tokens_carry_loss(name, make_cfg, tiny_dir):
    b = _backend(name, make_cfg, tiny_dir)
    row = SftRow(np.array([5, 9, 11], np.int32), np.array([20, 21, 22, 23, 24, 25, 26], np.int32),
                 np.array([A, M, E, A, A, M, M], np.int8))
    base, n = _loss(b, [row])
    assert n == 3
    obs = row._replace(tokens=np.array([20, 21, 22, 23, 24, 99, 98], np.int32))  # the observation tail
    assert _loss(b, [obs])[0] == pytest.approx(base, rel=1e-6)
    act = row._replace(tokens=np.array([20, 21, 22, 23, 99, 25, 26], np.int32))  # the last action token
    assert abs(_loss(b, [act])[0] - base) > 1e-3
    every = row._replace(roles=np.full(7, A, np.int8))  # the masked and echo tokens, counted, weigh in
    loss_all, n_all = _loss(b, [every])
    assert n_all == 7 and abs(loss_all * 7 - base * 3) > 1e-3


@pytest.mark.mlx
def test_torch_and_mlx_sft_losses_agree(make_cfg, tiny_dir):
    """Same 4-bit base and adapters, same rows: the cold-start losses of three steps agree."""
    t = _backend("torch", make_cfg, tiny_dir)
    m = _backend("mlx", make_cfg, tiny_dir)
    m.load_adapter_arrays(t.adapter_arrays())
    rows = _demo_rows(tiny_dir)
    micro = micro_batches(len(rows), 4)
    lt = [t.sft_step(rows, micro, 3e-2).loss for _ in range(3)]
    lm = [m.sft_step(rows, micro, 3e-2).loss for _ in range(3)]
    np.testing.assert_allclose(lm, lt, rtol=1e-3)
    assert lt[-1] < lt[0]


def _cfg(make_cfg, out, **kw):
    base = {"task": "arithmetic", "max_new_tokens": 16, "cold_start": "demos", "cold_start_steps": 3,
            "cold_start_examples": 8, "cold_start_batch": 4, "cold_start_lr": 3e-2, "steps": 1, "eval_n": 4,
            "output_dir": str(out)}
    return make_cfg(**{**base, **kw})


def test_a_new_run_cold_starts_before_rl_and_a_resumed_run_never_redoes_it(make_cfg, tmp_path, monkeypatch):
    out, lines = tmp_path / "run", []
    summary = run_local(_cfg(make_cfg, out), echo=lines.append)
    marker = read_marker(out)
    assert marker is not None and marker["state"] == "done" and marker["steps"] == 3 and marker["source"] == "demos"
    cs = summary["cold_start"]
    assert cs["steps"] == 3 and cs["examples"] == 8 and cs["loss_last"] < cs["loss_first"]
    assert cs["eval"]["eval/n"] == 4
    assert [e["label"] for e in summary["evals"]] == ["before", "cold start", "after"]
    rows = read_metrics(out / "metrics.jsonl")
    sft = [r for r in rows if "sft/loss" in r]
    assert [(r["step"], r["sft/step"]) for r in sft] == [(0, 1), (0, 2), (0, 3)]
    assert all(r["sft/tokens"] > 0 and r["sft/seconds"] > 0 for r in sft)
    assert [x.split(":")[0] for x in lines if "cold start step" in x] == [f"[local] cold start step {i}/3"
                                                                          for i in (1, 2, 3)]
    first = ckpt.find_latest(out)
    assert first is not None and first.step == 1
    state = json.loads((out / "checkpoints" / "step-000000" / "state.json").read_text())
    assert state["step"] == 0 and state["optimizer_step"] == 0  # the cold-started adapters, fresh RL moments

    def never(*_a, **_k):
        raise AssertionError("a resumed run ran the cold start again")

    monkeypatch.setattr(TorchBackend, "sft_step", never)
    lines.clear()
    again = run_local(_cfg(make_cfg, out, steps=2), echo=lines.append)
    assert again["step"] == 2 and again["cold_start"]["loss_last"] == cs["loss_last"]
    assert not any("cold start" in x for x in lines) and any("resumed" in x for x in lines)


def test_a_run_stopped_mid_stage_is_refused_with_the_fix(make_cfg, tmp_path, monkeypatch):
    out, lines = tmp_path / "run", []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("[local] cold start step 1/"):
            os.kill(os.getpid(), signal.SIGINT)  # the first signal ends the stage after this step

    summary = run_local(_cfg(make_cfg, out, cold_start_steps=8), echo=echo)
    assert summary["interrupted"] and summary["cold_start"] is None and summary["step"] == 0
    assert (read_marker(out) or {}).get("state") == "started" and ckpt.find_latest(out) is None
    assert any("cold start stopped after 1/8 steps" in x for x in lines)
    with pytest.raises(SystemExit, match=rf"cold start did not finish .*use another output_dir, or delete "
                                         rf"{out / MARKER}"):
        run_local(_cfg(make_cfg, out), echo=lambda _s: None)
    (out / MARKER).unlink()  # the fix the line names
    def killed(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(TorchBackend, "sft_step", killed)
    with pytest.raises(KeyboardInterrupt):  # a second signal: killed inside a step
        run_local(_cfg(make_cfg, out), echo=lambda _s: None)
    with pytest.raises(SystemExit, match="cold start did not finish"):
        run_local(_cfg(make_cfg, out), echo=lambda _s: None)


def test_a_run_stopped_before_the_stage_leaves_no_marker(make_cfg, tmp_path):
    out = tmp_path / "run"

    def echo(line: str) -> None:
        if line.startswith("[local] eval (before"):
            os.kill(os.getpid(), signal.SIGINT)

    summary = run_local(_cfg(make_cfg, out), echo=echo)
    assert summary["interrupted"] and summary["cold_start"] is None and read_marker(out) is None
    again = run_local(_cfg(make_cfg, out), echo=lambda _s: None)  # nothing trained: the next start is a new run
    assert again["cold_start"]["steps"] == 3 and again["step"] == 1


def test_a_bad_demonstrations_file_names_its_line_and_trains_nothing(make_cfg, tmp_path):
    path, out = tmp_path / "demos.jsonl", tmp_path / "run"
    good = json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                    {"role": "assistant", "content": "2"}]})
    path.write_text(good + "\n" + good[:-3] + "\n")
    lines: list[str] = []
    with pytest.raises(SystemExit, match=rf"^stoa local train: cold_start: {path}:2: .*nothing was trained"):
        run_local(_cfg(make_cfg, out, cold_start=str(path)), echo=lines.append)
    assert read_marker(out) is None and ckpt.find_latest(out) is None
    assert not any(r for r in read_metrics(out / "metrics.jsonl") if "sft/loss" in r or "eval/n" in r)
    long = json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                    {"role": "assistant", "content": "2 " * 40}]})
    path.write_text(good + "\n" + long + "\n")  # well-formed, but over max_new_tokens = 16
    with pytest.raises(SystemExit, match=rf"{path}:2: turn 0 is \d+ tokens, over max_new_tokens = 16"):
        run_local(_cfg(make_cfg, out, cold_start=str(path)), echo=lines.append)
    assert read_marker(out) is None and ckpt.find_latest(out) is None
    path.write_text(good + "\n" + good + "\n")  # fixed: the same directory starts the run
    summary = run_local(_cfg(make_cfg, out, cold_start=str(path)), echo=lambda _s: None)
    assert summary["cold_start"]["source"] == str(path) and summary["cold_start"]["examples"] == 2
    assert len(summary["cold_start"]["sha256"]) == 64


def test_a_task_without_demonstrations_is_one_line_naming_the_other_ways(make_cfg, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"^stoa local train: cold_start: task 'toy' builds no demonstrations; "
                                         r"give cold_start a JSONL file"):
        run_local(_cfg(make_cfg, out, task="toy"), echo=lambda _s: None)
    assert read_marker(out) is None


def test_cold_start_settings_are_checked_naming_the_field(make_cfg, tmp_path):
    for kw, field in (({"cold_start_steps": 0}, "cold_start_steps"), ({"cold_start_batch": 0}, "cold_start_batch"),
                      ({"cold_start": "demo"}, "cold_start"), ({"cold_start_lr": -1.0}, "cold_start_lr")):
        with pytest.raises(ConfigError) as e:
            _cfg(make_cfg, tmp_path, **kw)
        assert e.value.field == field


def test_a_multi_turn_task_cold_starts_with_its_tools_and_observations_carry_no_loss(make_cfg, tiny_dir, tmp_path):
    """The walk (tiny model's letter variant): each demonstration moves twice, reads the observations the task's
    own tools and environment build, and answers; only the three turns train."""
    from stoa.episodes.task_tools import open_task_tools
    from stoa.local.coldstart import prepare
    from stoa.tasks.demos import Demo
    from tests.local.test_local_multiturn import WALK, LetterWalk

    class DemoWalk(LetterWalk):
        def demonstrations(self, n, rng):
            return [Demo(self.sample_train(rng), ("ba", "be", "Ann")) for _ in range(n)]

    task = DemoWalk(max_turns=3, max_total_tokens=64)
    cfg = _cfg(make_cfg, tmp_path / "run", task=WALK, max_new_tokens=8, max_prompt_tokens=256)
    b = make_backend(cfg, tiny_dir)
    tools = open_task_tools(task, cfg.retriever, role="local", corpus="cached").tools
    rows = prepare(cfg, task, TextCodec(tiny_dir), tools).rows
    assert len(rows) == 8 and all((r.roles != A).any() for r in rows)  # observations between the turns
    result = b.sft_step(rows, micro_batches(len(rows), 0), 0.0)
    assert result.tokens == sum(int((r.roles == A).sum()) for r in rows) < sum(len(r.tokens) for r in rows)
    # the summed loss splits exactly into the action part and the observation part (which it leaves out)
    obs = [r._replace(roles=np.where(r.roles == A, M, A).astype(np.int8)) for r in rows]
    every = [r._replace(roles=np.full(len(r.roles), A, np.int8)) for r in rows]
    parts = [b.sft_step(x, micro_batches(len(x), 0), 0.0) for x in (obs, every)]
    assert result.loss * result.tokens + parts[0].loss * parts[0].tokens == pytest.approx(
        parts[1].loss * parts[1].tokens, rel=1e-5)
    summary = run_local(cfg, echo=lambda _s: None, task=task)
    assert summary["cold_start"]["steps"] == 3 and summary["cold_start"]["dropped"] == 0
    assert summary["cold_start"]["loss_last"] < summary["cold_start"]["loss_first"]


def test_dry_run_shows_the_cold_start(tiny_dir, capsys):
    import argparse

    from stoa.cli import local as cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["local", "train", "--model", str(tiny_dir), "--task", "arithmetic", "--cold-start",
                              "demos", "--cold-start-steps", "4", "--dry-run"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert 'cold_start = "demos"' in out and "cold_start_steps = 4" in out and "cold_start_lr = 0.0001" in out
    assert "# cold start: 4 AdamW steps of 8 demonstrations (up to 256, built by the task) at lr 0.0001" in out
