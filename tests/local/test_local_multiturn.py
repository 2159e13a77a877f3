"""Local mode on multi-turn tasks (tiny model): episodes with tools in the loop, the loss on multi-turn batches
(actions, ECHO, GiGPO) in both backends, metrics, evaluation, resume, and the preflight's episode length.

The random tiny model never writes ``</move>`` or ``</search>``, so the walk and search tasks here get
environments whose turns end at the letters it writes often ('a', 'e'): every turn is a tool call, episodes
really have several turns, observations hold echo tokens and anchor states recur.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from stoa.config import ConfigError
from stoa.local import saved as ckpt
from stoa.local.loop import run_local
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ToolCall
from stoa.tasks.base import Prompt
from stoa.tasks.search import SearchEnv, SearchTask
from stoa.tasks.walk import WalkEnv, WalkTask
from stoa.telemetry.metrics import read_metrics

WALK = "walk:max_turns=3,max_total_tokens=64"
SEARCH = "search:entities=20,shots=0,max_turns=2,max_obs_tokens=48,max_total_tokens=96,max_doc_chars=60,topk=1"


class LetterWalkEnv(WalkEnv):
    """A walk whose turns end at 'a' or 'e'; 'a' moves left, anything else right; 'Ann' answers."""

    stop_strings: tuple[str, ...] = ("a", "e")

    def parse(self, turn_text: str) -> ToolCall | None:
        if "Ann" in turn_text:
            return None
        return ToolCall("move", "left" if turn_text.endswith("a") else "right")


class LetterWalk(WalkTask):
    """``walk`` with ``LetterWalkEnv``; reward: the share of 'e' in the episode text (varies within groups)."""

    def make_env(self, prompt: Prompt, seed: int) -> WalkEnv:
        return LetterWalkEnv(self.problem(prompt.id)[0], self.size)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return min(1.0, completion.count("e") / 4)

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        return self.reward(prompt, completion) >= 0.5


class LetterSearchEnv(SearchEnv):
    """Search-R1's env whose turns end at 'a' or 'e' and are the query."""

    stop_strings: tuple[str, ...] = ("a", "e")

    def parse(self, turn_text: str) -> ToolCall | None:
        return None if "Ann" in turn_text else ToolCall("search", turn_text.strip() or "e")


class LetterSearch(SearchTask):
    def make_env(self, prompt: Prompt, seed: int) -> SearchEnv:
        return LetterSearchEnv()


def _walk(spec: str = WALK) -> LetterWalk:
    from stoa.tasks import parse_task_spec

    return LetterWalk(**parse_task_spec(spec)[1])  # type: ignore[arg-type]


def _cfg(make_cfg, **kw: Any):
    base = {"task": WALK, "max_new_tokens": 8, "max_prompt_tokens": 256, "n_samples": 4, "groups_per_step": 2,
            "kl_beta": 0.0, "lr": 1e-2}
    return make_cfg(**{**base, **kw})


def _rows(out) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward_mean" in r]


def _finite(row: dict[str, Any]) -> None:
    bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, bad


@pytest.mark.parametrize(("backend", "old_logprobs"),
                         [("torch", "forward"), pytest.param("mlx", "reuse", marks=pytest.mark.mlx)])
def test_walk_gigpo_echo_two_steps(backend, old_logprobs, make_cfg, tmp_path):
    """GiGPO with a tapered ECHO term on a recurring-state walk: multi-turn rows, echo metrics, the schedule
    read with the local step, the old policy of the multi-turn rows (ratio 1), multi-turn evaluation."""
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    out = tmp_path / backend
    cfg = _cfg(make_cfg, backend=backend, steps=2, algorithm="gigpo", eval_n=2, eval_k=2, output_dir=str(out),
               old_logprobs=old_logprobs, algo={"echo_alpha": 0.5, "echo_schedule": "linear_taper_to_zero"})
    summary = run_local(cfg, echo=lambda _s: None, task=_walk())
    rows = _rows(out)
    assert summary["step"] == 2 and len(rows) == 2
    for row in rows:
        _finite(row)
        assert row["rollout/turns_mean"] > 1.5 and row["rollout/search_rate"] > 0.5
        assert row["rollout/tool_calls_mean"] > 0.5 and row["rollout/obs_tokens"] > 0
        assert sum(row[f"rollout/end/{r}"] for r in ("stop", "length", "max_turns", "max_obs_tokens",
                                                     "max_total_tokens")) == pytest.approx(1.0)
        assert row["train/echo_tokens"] > 0 and row["train/loss_echo"] > 0
        assert 0.0 <= row["train/echo_acc"] <= 1.0
        assert row["train/tokens"] < row["rollout/completion_len"] * 8  # observations are not trained on
        assert row["rollout/decode_vs_forward_logp_max"] < 1e-3
        assert row["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert [r["train/echo_alpha"] for r in rows] == pytest.approx([0.5, 0.25])
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/cover_em" in r]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        _finite(e)
        assert e["eval/n"] == 2 and e["eval/turns_mean"] >= 1 and "eval/pass@2" in e and "eval/em" in e


def test_walk_resume_continues_exactly(make_cfg, tmp_path):
    """2 steps in one go == 1 step, stop, resume to 2 (episodes are a pure function of seed and step)."""
    common = {"algorithm": "gigpo", "algo": {"echo_alpha": 0.3}, "checkpoint_every": 1}
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_local(_cfg(make_cfg, steps=2, output_dir=str(whole), **common), echo=lambda _s: None, task=_walk())
    first = run_local(_cfg(make_cfg, steps=1, output_dir=str(split), **common), echo=lambda _s: None, task=_walk())
    second = run_local(_cfg(make_cfg, steps=2, output_dir=str(split), **common), echo=lambda _s: None, task=_walk())
    assert first["step"] == 1 and second["start_step"] == 1 and second["step"] == 2
    a, b = ckpt.find_latest(whole), ckpt.find_latest(split)
    assert a is not None and b is not None and a.step == b.step == 2
    for k in a.adapters:
        np.testing.assert_array_equal(a.adapters[k], b.adapters[k], err_msg=k)
    ra, rb = _rows(whole), _rows(split)
    for key in ("rollout/reward_mean", "rollout/turns_mean", "train/loss", "train/loss_echo"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key


def test_real_walk_task_from_its_spec(make_cfg, tmp_path):
    """The registered walk task as configured (no injection): episodes, metrics and multi-turn evaluation."""
    out = tmp_path / "walk"
    run_local(_cfg(make_cfg, task=WALK, steps=2, eval_n=2, output_dir=str(out)), echo=lambda _s: None)
    rows = _rows(out)
    assert len(rows) == 2 and all("rollout/turns_mean" in r and "train/loss" in r for r in rows)
    for r in rows:
        _finite(r)
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/cover_em" in r]
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval/search_rate"] == 0.0 for e in evals)


def test_search_one_step_with_its_own_index(make_cfg, tmp_path):
    """The search task's corpus is indexed in-process (BM25, cached); the documents are echo tokens."""
    from stoa.tasks import parse_task_spec

    out = tmp_path / "search"
    task = LetterSearch(**parse_task_spec(SEARCH)[1])  # type: ignore[arg-type]
    cfg = _cfg(make_cfg, task=SEARCH, steps=1, eval_n=2, output_dir=str(out), algo={"echo_alpha": 0.1})
    run_local(cfg, echo=lambda _s: None, task=task)
    (row,) = _rows(out)
    _finite(row)
    assert row["rollout/search_rate"] > 0.5 and row["rollout/tool_s"] >= 0 and row["train/echo_tokens"] > 0
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/cover_em" in r]
    assert [e["step"] for e in evals] == [0, 1] and all(e["eval/search_rate"] > 0 for e in evals)


def _episode_batch(backend, algo, task, codec, cfg):
    from stoa.algorithms.batch import filter_and_build
    from stoa.episodes.collect import collect_episodes
    from stoa.episodes.task_tools import open_task_tools

    rng = np.random.default_rng(3)
    prompts = [(p, codec.encode_prompt(p.messages)) for p in (task.sample_train(rng) for _ in range(2))]
    tools = open_task_tools(task, role="local", corpus="cached").tools
    assert tools is not None
    groups, _ = collect_episodes(backend, task, codec, tools, prompts, cfg, seed=5)
    batch, _ = filter_and_build(groups, algo)
    assert batch is not None
    return batch


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_backend_loss_reads_echo_tokens_and_turn_advantages(backend, make_cfg, tiny_dir):
    """The ECHO term adds alpha x its own gradient (linear in alpha) and reports echo_acc only when on; GiGPO's
    per-token advantages reach the loss; the old policy's logprobs are 0 off the action tokens."""
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    from stoa.algorithms import get_algorithm
    from stoa.algorithms.batch import micro_batches
    from stoa.local.loop import make_backend
    from stoa.tokenize import TextCodec

    cfg = _cfg(make_cfg, backend=backend, algorithm="gigpo", micro_batch=4)
    be, codec = make_backend(cfg, tiny_dir), TextCodec(tiny_dir)
    algo = get_algorithm(cfg.algo_config(), be.name)
    batch = _episode_batch(be, algo, _walk(), codec, cfg)
    assert batch.echo_mask.sum() > 0 and batch.token_advantages is not None
    assert np.abs(batch.token_advantages - batch.advantages[:, None])[batch.mask > 0].max() > 1e-4
    micro = micro_batches(len(batch), cfg.micro_batch)
    old = be.logprobs(batch, micro)
    assert np.all(old[batch.mask == 0] == 0) and np.all(old[batch.mask > 0] < 0)
    batch.old_logp = old

    def grads(alpha: float, b=batch) -> tuple[dict[str, float], np.ndarray]:
        m = be.accumulate(b, micro, algo, echo_alpha=alpha)
        g = np.concatenate([v.ravel() for _, v in sorted(be.grad_arrays().items())])
        be.clear_grads()
        return m, g

    (m0, g0), (m1, g1), (_, g2) = grads(0.0), grads(1.0), grads(2.0)
    assert "echo_acc" not in m0 and 0.0 <= m1["echo_acc"] <= 1.0
    assert m0["loss_echo"] == pytest.approx(m1["loss_echo"], rel=1e-4) and m0["loss_echo"] > 0
    assert np.abs(g1 - g0).max() > 1e-3 * np.abs(g0).max()
    np.testing.assert_allclose(g2 - g0, 2 * (g1 - g0), rtol=1e-2, atol=1e-3 * np.abs(g1 - g0).max())
    _, g_row = grads(0.0, dataclasses.replace(batch, token_advantages=None))
    assert np.abs(g_row - g0).max() > 1e-3 * np.abs(g0).max()


def test_episode_trajectory_turns_and_states():
    """turn_of_token follows the turn starts (not the action runs) and states are one per turn."""
    from stoa.episodes.collect import episode_trajectory, turn_of_token
    from stoa.episodes.driver import Episode

    roles = [ROLE_ACTION] * 3 + [0, ROLE_ECHO, 0] + [ROLE_ACTION] * 2
    assert turn_of_token(roles, [0, 6]).tolist() == [0, 0, 0, -1, -1, -1, 1, 1]
    ep = Episode(tokens=list(range(8)), logprobs=[-1.0] * 3 + [0.0] * 3 + [-2.0] * 2, roles=roles,
                 turn_starts=[0, 6], calls=[ToolCall("move", "left")], digests=["d"], states=["p1", "p0"],
                 end_reason="stop")
    t = episode_trajectory([1, 2], ep, 0.5)
    assert t.states == ("p1", "p0") and t.action_mask.tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert t.echo_mask.tolist() == [0, 0, 0, 0, 1, 0, 0, 0] and t.rollout_logprobs[4] == 0.0


def test_preflight_counts_the_episode_length(make_cfg):
    """A multi-turn row is the prompt plus the task's max_total_tokens: over the model's positions is refused
    naming the task option, and the memory estimate grows with it (its knob is the task option)."""
    from stoa.local.preflight import episode_tokens, estimate_memory, fit, preflight
    from stoa.models.shapes import shape_for

    cfg = _cfg(make_cfg, task="walk")
    shape = shape_for(cfg.model)
    assert shape is not None and episode_tokens(_walk("walk")) == 512 and episode_tokens(object()) is None
    with pytest.raises(ConfigError) as e:
        preflight(cfg, shape, 512)
    assert e.value.field == "task" and "max_total_tokens=256" in str(e.value)
    assert preflight(cfg, shape, 128).fits
    big = dataclasses.replace(cfg, n_samples=64, groups_per_step=8).validate()
    short, long = (estimate_memory(big, shape, total_tokens=t).total_gb for t in (32, 256))
    assert long > short
    as_completion = estimate_memory(dataclasses.replace(big, max_new_tokens=256), shape)
    assert estimate_memory(big, shape, total_tokens=256) == as_completion  # the row is prompt + max_total_tokens
    small = dataclasses.replace(big, micro_batch=1, gradient_checkpointing=True, n_samples=2).validate()
    budget = estimate_memory(small, shape, total_tokens=64).total_gb + 1e-4
    report = fit(small, shape, available_gb=budget, source="test", total_tokens=256)
    assert report.knob == "max_total_tokens" and report.suggested is not None
    assert report.suggested.task == "walk:max_total_tokens=64"
