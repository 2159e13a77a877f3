"""The trainer step on multi-turn episodes: roles from the record, turns and anchor states from the trainer's
replay; the loss reads action tokens for the ratio and echo tokens for ECHO only; every forward path agrees."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.episodes.replay import replay_group
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, EpisodeLimits
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tokenize import TextCodec
from stoa.trainer.policy import Policy, Scores
from stoa.trainer.pool import Entry, PoolStats
from stoa.trainer.step import entries_batch, episode_figures, train_step
from tests.envs.fakes import FakeTools, SearchEnv, honest_sample

GOOD = ["<search>color of y</search>", "<answer>blue</answer>"]
WRONG = ["<search>color of y</search>", "<answer>red</answer>"]
DIRECT = ["<answer>red</answer>"]
OTHER = ["<search>capital of x</search>", "<answer>X city</answer>"]
LIMITS = EpisodeLimits(max_turns=3, max_turn_tokens=64, max_obs_tokens=64, max_total_tokens=256)
GROUPS = [[GOOD, WRONG, DIRECT], [OTHER, DIRECT, GOOD], [WRONG, OTHER, GOOD]]
REWARDS = [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]


@pytest.fixture(scope="module")
def codec(tiny_dir) -> TextCodec:
    return TextCodec(tiny_dir)


def episode_entry(codec, turns_of_rows, rewards, g: int, seed: int = 3) -> Entry:
    """An honest group of episodes (the engines' recording), replayed as the pool replays it."""
    samples = [honest_sample(turns, codec, seed=seed, reward=r) for turns, r in zip(turns_of_rows, rewards,
                                                                                    strict=True)]
    replayed = replay_group([SearchEnv(seed) for _ in samples], samples, FakeTools(), codec, LIMITS)
    prompt = np.array(codec.encode_prompt(({"role": "user", "content": f"Question {g}?"},)), np.int32)
    rec = RolloutRecord("w", g, 1, "f", "searchtoy", f"train:{g}", prompt, samples, env_seed=seed)
    return Entry(f"k{g}", rec, np.array(rewards, np.float32), replayed=replayed)


def make_entries(tiny_dir, codec, seed: int = 0) -> list[Entry]:
    """Three groups whose action logprobs are the policy's own plus noise (so ratios are near 1, unclipped)."""
    entries = [episode_entry(codec, rows, r, g) for g, (rows, r) in enumerate(zip(GROUPS, REWARDS, strict=True))]
    pol = Policy(tiny_dir, torch.device("cpu"), trainable=False)
    rng = np.random.default_rng(seed)
    for e in entries:
        with torch.no_grad():
            lp = pol.group_logprobs(e.record.prompt_tokens, [s.tokens for s in e.record.samples], 200).numpy()
        for i, s in enumerate(e.record.samples):
            act = s.role_array() == ROLE_ACTION
            noise = rng.normal(0.0, 0.05, act.sum()).astype(np.float32)
            s.logprobs = np.zeros(s.tokens.size, np.float32)
            s.logprobs[act] = lp[i, : s.tokens.size][act] + noise
    return entries


@pytest.fixture(scope="module")
def entries(tiny_dir, codec) -> list[Entry]:
    return make_entries(tiny_dir, codec)


class Step:
    """One optimizer step (SGD, lr 1) from fresh weights: its metrics, parameter deltas and the policy's
    logprobs tensors (with their gradients) of every forward."""

    def __init__(self, tiny_dir, entries, algo: dict, **kw):
        torch.manual_seed(0)
        pol = Policy(tiny_dir, torch.device("cpu"))
        before = {k: v.detach().clone() for k, v in pol.model.named_parameters()}
        self.forwards: list[torch.Tensor] = []
        for name in ("score", "group_score", "logprobs", "group_logprobs"):
            setattr(pol, name, self._kept(getattr(pol, name)))
        opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)
        cfg = AlgoConfig.from_dict({"kl_beta": 0.0, "gate": "none", **algo})
        kw = {"micro_batch": 4, "shared_prefix": False, **kw}
        self.m = train_step(pol, None, opt, get_algorithm(cfg, "torch"), entries, current_version=1, grad_clip=0.0,
                            **kw)
        self.delta = {k: v.detach() - before[k] for k, v in pol.model.named_parameters()}

    def _kept(self, fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            logp = out.logp if isinstance(out, Scores) else out
            if logp.requires_grad and not any(f is logp for f in self.forwards):
                logp.retain_grad()
                self.forwards.append(logp)
            return out
        return call

    def grads(self, batch_rows: int) -> list[np.ndarray]:
        """The gradient of the loss w.r.t. each forward's logprobs, as numpy."""
        assert self.forwards and sum(f.shape[0] for f in self.forwards) == batch_rows
        return [f.grad.numpy() if f.grad is not None else np.zeros(tuple(f.shape), np.float32)
                for f in self.forwards]


def assert_same_update(a: Step, b: Step, atol: float = 2e-6) -> None:
    for k in a.delta:
        torch.testing.assert_close(a.delta[k], b.delta[k], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("algo", [{"name": "grpo", "echo_alpha": 0.5},
                                  {"name": "gigpo", "gigpo_gamma": 0.5, "echo_alpha": 0.3}])
def test_micro_batched_whole_and_shared_prefix_steps_agree(tiny_dir, entries, algo):
    whole = Step(tiny_dir, entries, algo, micro_batch=100)
    micro = Step(tiny_dir, entries, algo, micro_batch=2)
    shared = Step(tiny_dir, entries, algo, shared_prefix=True)
    assert max(float(v.abs().max()) for v in whole.delta.values()) > 0
    assert len(whole.forwards) == 1 and len(micro.forwards) == 5 and len(shared.forwards) == 3
    for other in (micro, shared):
        assert_same_update(other, whole)
        for k in ("loss", "pg_loss", "loss_echo", "echo_acc", "echo_tokens", "tokens"):
            assert other.m[k] == pytest.approx(whole.m[k], rel=1e-4, abs=1e-6), k
    assert whole.m["echo_tokens"] > 0 and 0 <= whole.m["echo_acc"] <= 1


def roles_of(entries) -> np.ndarray:
    """[B, T] roles of the batch's rows (-1 padding)."""
    rows = [s.role_array() for e in entries for s in e.record.samples]
    out = np.full((len(rows), max(r.size for r in rows)), -1)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


def row_grads(step: Step, entries) -> np.ndarray:
    """The loss gradient w.r.t. the logprobs of every row, in batch row order (a shared-prefix step's forwards
    are its groups, in order)."""
    return np.concatenate(step.grads(9))[:, : roles_of(entries).shape[1]]


def test_observation_tokens_carry_no_gradient_and_echo_tokens_only_under_echo(tiny_dir, entries):
    roles = roles_of(entries)
    off = Step(tiny_dir, entries, {"name": "grpo"}, shared_prefix=True)
    on = Step(tiny_dir, entries, {"name": "grpo", "echo_alpha": 0.5}, shared_prefix=True)
    g_off, g_on = row_grads(off, entries), row_grads(on, entries)
    action, echo, masked = roles == ROLE_ACTION, roles == ROLE_ECHO, roles == ROLE_MASKED
    assert echo.sum() > 0 and masked.sum() > 0
    assert np.abs(g_off[action]).max() > 0
    assert not g_off[echo].any() and not g_off[masked].any()
    assert not g_on[masked].any() and (g_on[echo] != 0).all()
    np.testing.assert_allclose(g_on[action], g_off[action], rtol=1e-5, atol=1e-9)  # ECHO adds, never reweights
    assert "echo_acc" not in off.m and off.m["loss_echo"] > 0 and off.m["echo_alpha"] == 0
    assert on.m["loss_echo"] == pytest.approx(off.m["loss_echo"]) and 0 <= on.m["echo_acc"] <= 1
    assert on.m["loss"] == pytest.approx(off.m["loss"] + 0.5 * on.m["loss_echo"], rel=1e-5)
    assert max(float((on.delta[k] - off.delta[k]).abs().max()) for k in on.delta) > 1e-4


def relabel(entries: list[Entry], old: int, new: int) -> list[Entry]:
    """Copies of the entries whose samples have role ``old`` turned into ``new`` (the replay is kept)."""
    out = []
    for e in entries:
        samples = []
        for s in e.record.samples:
            roles = s.role_array().copy()
            roles[roles == old] = new
            samples.append(Sample(s.tokens, s.logprobs, s.reward, s.finish_reason, roles=roles,
                                  turn_starts=s.turn_starts, calls=s.calls, digests=s.digests, end_reason=s.end_reason))
        rec = e.record
        out.append(Entry(e.key, RolloutRecord(rec.worker_id, rec.seq, rec.policy_version, rec.contract_fingerprint,
                                              rec.task_id, rec.prompt_id, rec.prompt_tokens, samples), e.rewards,
                         replayed=e.replayed))
    return out


def junk_observation_logprobs(entries: list[Entry]) -> list[Entry]:
    """Copies of the entries whose samples claim junk logprobs on every observation token."""
    out = relabel(entries, ROLE_ACTION, ROLE_ACTION)
    for e in out:
        for s in e.record.samples:
            s.logprobs = np.where(s.role_array() == ROLE_ACTION, s.logprobs, 7.5).astype(np.float32)
    return out


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_without_echo_observation_logprobs_and_the_echo_mask_change_nothing(tiny_dir, entries, shared_prefix):
    base = Step(tiny_dir, entries, {"name": "grpo"}, shared_prefix=shared_prefix)
    for changed in (junk_observation_logprobs(entries), relabel(entries, ROLE_ECHO, ROLE_MASKED),
                    relabel(entries, ROLE_MASKED, ROLE_ECHO)):
        other = Step(tiny_dir, changed, {"name": "grpo"}, shared_prefix=shared_prefix)
        assert_same_update(other, base, atol=1e-7)
        for k in ("loss", "pg_loss", "tokens", "ratio_mean"):
            assert other.m[k] == pytest.approx(base.m[k], rel=1e-6), k


def test_a_linear_taper_sets_this_steps_echo_coefficient(tiny_dir, entries):
    algo = {"name": "grpo", "echo_alpha": 0.8, "echo_schedule": "linear_taper_to_zero"}
    mid = Step(tiny_dir, entries, algo, step=3, total_steps=4, micro_batch=100)
    assert mid.m["echo_alpha"] == pytest.approx(0.2)
    assert mid.m["loss"] == pytest.approx(mid.m["pg_loss"] + 0.2 * mid.m["loss_echo"], rel=1e-5)
    end = Step(tiny_dir, entries, algo, step=4, total_steps=4, micro_batch=100)
    assert end.m["echo_alpha"] == 0 and "echo_acc" not in end.m


def test_entries_batch_takes_roles_from_the_record_and_turns_and_states_from_the_replay(entries):
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
    b = entries_batch(entries, algo, current_version=2)
    roles = roles_of(entries)
    np.testing.assert_array_equal(b.mask, (roles == ROLE_ACTION).astype(np.float32))
    np.testing.assert_array_equal(b.echo_mask, (roles == ROLE_ECHO).astype(np.float32))
    assert b.echo_normalizer == float((roles == ROLE_ECHO).sum())
    first, replayed = b.rows[0], entries[0].replayed  # GOOD: two turns, the second after the observation
    assert replayed is not None and first.turn_of_token is not None
    assert first.states == replayed[0].states and len(first.states) == 2
    np.testing.assert_array_equal(first.turn_of_token, replayed[0].turn_of_token)
    assert set(first.turn_of_token.tolist()) == {-1, 0, 1}
    assert not b.rollout_logp[roles != ROLE_ACTION].any()
    bad = Entry("k", entries[0].record, entries[0].rewards, replayed=replayed[:2])
    with pytest.raises(ValueError, match="^replayed: 2 replays for 3 samples"):
        entries_batch([bad], algo, current_version=2)


def test_gigpo_token_advantages_differ_per_turn_as_the_golden_case(tiny_dir, codec):
    """The golden GiGPO case on real episodes: rows GOOD (reward 1), WRONG, DIRECT share the start state; GOOD
    and WRONG also share the state after their search; gamma 0.5, omega 0.5."""
    entry = episode_entry(codec, GROUPS[0], REWARDS[0], 0)
    cfg = {"name": "gigpo", "kl_beta": 0.0, "gate": "none", "gigpo_gamma": 0.5, "gigpo_omega": 0.5}
    algo = get_algorithm(AlgoConfig.from_dict(cfg), "torch")
    b = entries_batch([entry], algo, current_version=1)
    std = math.sqrt(2 / 9) + 1e-6
    a0, a1 = (2 / 3) / std, (-1 / 3) / std  # GRPO's episode advantages of rewards (1, 0, 0)
    s0, sx, w = math.sqrt(1 / 18) + 1e-6, 0.5 + 1e-6, 0.5
    want = [[a0 + w * (1 / 3) / s0, a0 + w * 0.5 / sx], [a1 + w * (-1 / 6) / s0, a1 - w * 0.5 / sx],
            [a1 + w * (-1 / 6) / s0]]
    assert b.token_advantages is not None
    for i, turns in enumerate(want):
        t = b.rows[i].turn_of_token
        assert t is not None
        for k, value in enumerate(turns):
            np.testing.assert_allclose(b.token_advantages[i, : t.size][t == k], value, rtol=1e-5)
    seen: list[torch.Tensor] = []
    gigpo = get_algorithm(AlgoConfig.from_dict(cfg), "torch")
    real = gigpo.loss

    def loss(inp):
        seen.append(inp.token_advantages)
        return real(inp)

    gigpo.loss = loss  # type: ignore[method-assign]
    pol = Policy(tiny_dir, torch.device("cpu"))
    train_step(pol, None, torch.optim.SGD(pol.model.parameters(), lr=0.1), gigpo, [entry], current_version=1,
               micro_batch=0, grad_clip=0.0, shared_prefix=False)
    assert len(seen) == 1 and seen[0] is not None
    np.testing.assert_array_equal(seen[0].numpy(), b.token_advantages)


def test_episode_figures_of_a_step(entries):
    ps = PoolStats(replay_s=1.0, tool_calls=7)
    fig = episode_figures(entries, ps, step_s=3.0)
    assert fig["train/replay_share"] == pytest.approx(0.25) and fig["train/replay_s"] == 1.0
    assert fig["rollout/tool_calls"] == 7
    assert fig["rollout/search_rate"] == pytest.approx(7 / 9)  # DIRECT (2 of the 9 episodes) never searched
    assert fig["rollout/turns_mean"] == pytest.approx((7 * 2 + 2) / 9)
    assert fig["rollout/tool_calls_mean"] == pytest.approx(7 / 9) and fig["rollout/end/stop"] == 1.0
    single = Entry("k", entries[0].record, entries[0].rewards)  # not replayed: a single-turn task's entry
    assert episode_figures([single], ps, 3.0) == {}


def test_provenance_names_each_groups_replay_and_its_tool_calls(entries):
    from stoa.trainer.provenance import step_provenance
    from stoa.trainer.step import GroupCheck, entry_worker

    checks = {0: GroupCheck(0.01, False), 1: GroupCheck(5.0, True)}  # group 2: lagged, not judged
    rows = step_provenance(entries, checks, step=4, version=1, replay=True, worker_of=entry_worker)
    assert [(r.step, r.worker, r.version, r.lag) for r in rows] == [(4, "w", 1, 0)] * 3
    assert [(r.replay, r.tool_calls) for r in rows] == [("ok", 2), ("ok", 2), ("ok", 3)]  # one per <search>
    assert [(r.recompute, r.residual) for r in rows] == [("ok", 0.01), ("rejected", 5.0), ("lagged", None)]
    off = step_provenance(entries, {}, step=4, version=1, replay=False, worker_of=entry_worker)
    assert {r.replay for r in off} == {"unreplayed"}
