"""The MLX engine samples what it records: logprobs agree with a torch recompute, greedy tokens with the
torch engine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.engines.nucleus import MAX_EDGE_SHARE

pytestmark = pytest.mark.mlx

PROMPTS = [[5, 6, 7, 8, 9, 40, 41], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 300, 301]]
# ~3% of the ids per step: some rows stop early, others run to length (rows get dropped)
EOS = tuple(range(3, 20))
TOL = 1e-4


def _recompute(model, prompt: list[int], completions: list[list[int]], temperature: float,
               top_p: float, recorded: list[list[float]]) -> tuple[list[np.ndarray], int]:
    """|recorded - torch recompute| of each completion after ``prompt`` (one full forward of the group
    right-padded, which a causal model cannot see; tests/engines/nucleus.py's top-p edge allowance), and the
    positions that used the allowance."""
    import torch

    from tests.engines.nucleus import edge_aware_gaps

    width = len(prompt) + max(len(c) for c in completions)
    ids = torch.zeros((len(completions), width), dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(prompt) + len(c)] = torch.tensor(prompt + c)
    with torch.no_grad():
        logits = model(ids).logits.float()
    out, edge = [], 0
    for i, c in enumerate(completions):
        rows = logits[i, len(prompt) - 1 : len(prompt) - 1 + len(c)]
        gaps, on_edge = edge_aware_gaps(rows, c, np.array(recorded[i], dtype=np.float64), temperature, top_p,
                                         TOL)
        out.append(gaps)
        edge += on_edge
    return out, edge


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_recorded_logprobs_match_torch_recompute(mlx_engine, torch_engine, temperature, top_p) -> None:
    groups, stats = mlx_engine.generate(PROMPTS, 4, max_new_tokens=24, temperature=temperature, top_p=top_p,
                                        eos_ids=EOS, generator=11)
    assert len(groups) == len(PROMPTS) and all(len(g) == 4 for g in groups)
    worst, edge = 0.0, 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            assert len(c.tokens) == len(c.logprobs) >= 1
            assert np.isfinite(c.logprobs).all()
        gaps, on_edge = _recompute(torch_engine.model, prompt, [c.tokens for c in group], temperature, top_p,
                                   [c.logprobs for c in group])
        worst = max([worst, *(float(g.max()) for g in gaps)])
        edge += on_edge
    assert worst <= TOL, f"max |MLX - torch| logprob difference {worst:.2e} > {TOL}"
    assert edge <= MAX_EDGE_SHARE * stats.new_tokens, f"{edge} tokens needed the nucleus-edge allowance"
    finish = [c.finish_reason for g in groups for c in g]
    assert "stop" in finish and "length" in finish, finish  # row dropping was exercised
    assert stats.new_tokens == sum(len(c.tokens) for g in groups for c in g)
    assert stats.extra["prompt_tokens"] == sum(len(p) for p in PROMPTS)


def test_greedy_tokens_identical_to_torch_engine(mlx_engine, torch_engine) -> None:
    a, _ = mlx_engine.generate(PROMPTS, 2, max_new_tokens=20, greedy=True, temperature=0.8)
    b, _ = torch_engine.generate(PROMPTS, 2, max_new_tokens=20, greedy=True, temperature=0.8)
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            assert ca.tokens == cb.tokens
            assert ca.finish_reason == cb.finish_reason
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=TOL)


def test_eos_rows_stop_and_others_run_to_length(mlx_engine) -> None:
    groups, stats = mlx_engine.generate(PROMPTS, 3, max_new_tokens=12, eos_ids=EOS, generator=2)
    eos = set(EOS)
    for c in (c for g in groups for c in g):
        if c.finish_reason == "stop":
            assert c.tokens[-1] in eos and not eos & set(c.tokens[:-1])
        else:
            assert c.finish_reason == "length" and len(c.tokens) == 12 and not eos & set(c.tokens)
    assert stats.steps <= 12


def test_seeded_sampling_is_reproducible(mlx_engine) -> None:
    def run(gen):
        groups, _ = mlx_engine.generate(PROMPTS, 4, max_new_tokens=10, temperature=1.5, generator=gen)
        return [c.tokens for g in groups for c in g]

    assert run(5) == run(5)
    assert run(5) == run(mx.random.key(5))
    assert run(5) != run(6)
    rows = run(5)
    assert len({tuple(r) for r in rows}) > 1  # the n rows of a group are sampled independently


def test_shared_prefix_equals_per_row_prefill(mlx_engine) -> None:
    a, sa = mlx_engine.generate(PROMPTS, 3, max_new_tokens=8, greedy=True)
    b, sb = mlx_engine.generate(PROMPTS, 3, max_new_tokens=8, greedy=True, share_prefix=False)
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            assert ca.tokens == cb.tokens
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-5)
    assert sb.extra["prompt_tokens"] == 3 * sa.extra["prompt_tokens"]


def test_single_prompt_single_sample(mlx_engine) -> None:
    groups, stats = mlx_engine.generate([[42]], 1, max_new_tokens=3, greedy=True)
    assert len(groups) == 1 and len(groups[0]) == 1 and len(groups[0][0].tokens) == 3
    assert stats.steps == 3 and stats.new_tokens == 3


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([], {}, "at least one token"),
        ([[1, 2], []], {}, "at least one token"),
        ([[1, 99999]], {}, "outside the vocabulary"),
        ([[1, -1]], {}, "outside the vocabulary"),
        ([[1, 2]], {"n": 0}, "must be >= 1"),
        ([[1, 2]], {"max_new_tokens": 0}, "must be >= 1"),
        ([[1, 2]], {"temperature": 0.0}, "temperature"),
        ([[1, 2]], {"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_generate_arguments(mlx_engine, prompts, kwargs, match) -> None:
    args = {"n": 2, "max_new_tokens": 4} | kwargs
    n = args.pop("n")
    with pytest.raises(ValueError, match=match):
        mlx_engine.generate(prompts, n, **args)


def test_vocab_size(mlx_engine, torch_engine) -> None:
    assert mlx_engine.vocab_size == torch_engine.vocab_size


def test_unknown_dtype(tiny_dir) -> None:
    from stoa.engines.mlx.engine import MLXEngine

    with pytest.raises(ValueError, match="dtype"):
        MLXEngine(tiny_dir, dtype="int8")


def test_engine_without_weights_builds_from_config(tiny_dir, tmp_path, tiny_weights) -> None:
    import shutil

    from stoa.engines.mlx.engine import MLXEngine

    for f in tiny_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    eng = MLXEngine(tmp_path, dtype="float32")
    eng.load_weights(tiny_weights)
    ref = MLXEngine(tiny_dir, dtype="float32")
    a, _ = eng.generate(PROMPTS, 2, max_new_tokens=6, greedy=True)
    b, _ = ref.generate(PROMPTS, 2, max_new_tokens=6, greedy=True)
    assert [c.tokens for g in a for c in g] == [c.tokens for g in b for c in g]


def test_qwen2_with_qkv_biases_matches_torch(tmp_path_factory) -> None:
    pytest.importorskip("torch", reason="the comparison needs torch")
    from safetensors.numpy import load_file

    from stoa.engines.mlx.engine import MLXEngine
    from stoa.engines.torch import TorchEngine
    from stoa.models import resolve_model
    from stoa.weights.planes import state_from_f32, state_to_f32

    d = resolve_model("tiny-qwen2", cache_dir=tmp_path_factory.mktemp("stoa-cache"))
    me, te = MLXEngine(d, dtype="float32"), TorchEngine(d, device="cpu")
    state = state_from_f32(load_file(str(d / "model.safetensors")), "bf16")
    me.load_state(state, "bf16")
    te.load_weights(state_to_f32(state, "bf16"))
    a, _ = me.generate(PROMPTS, 2, max_new_tokens=12, greedy=True)
    b, _ = te.generate(PROMPTS, 2, max_new_tokens=12, greedy=True)
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            assert ca.tokens == cb.tokens
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=TOL)


def test_models_without_plain_kv_caches_are_refused(tiny_dir, tmp_path) -> None:
    import json
    import shutil

    from stoa.engines.mlx.engine import MLXEngine

    for f in tiny_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="RotatingKVCache"):
        MLXEngine(tmp_path, dtype="float32")


def test_mlx_engine_fits_the_protocol_and_seeds_the_global_stream(mlx_engine) -> None:
    from stoa.engines import Engine

    assert isinstance(mlx_engine, Engine) and mlx_engine.dtype_name == "float32"

    def run(seed):
        gen = mlx_engine.make_generator(seed)
        groups, _ = mlx_engine.generate(PROMPTS, 3, max_new_tokens=8, temperature=1.5, generator=gen)
        return [c.tokens for g in groups for c in g]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_an_engine_around_a_loaded_model_shares_its_weights(mlx_engine) -> None:
    from stoa.engines import engine_from_model
    from stoa.engines.mlx.engine import MLXEngine

    wrapped = engine_from_model(mlx_engine.model, mlx_engine.config, "float32")
    assert isinstance(wrapped, MLXEngine) and wrapped.model is mlx_engine.model
    assert wrapped.vocab_size == mlx_engine.vocab_size and wrapped.dtype_name == "float32"
    a, _ = wrapped.generate(PROMPTS, 2, max_new_tokens=6, greedy=True)
    b, _ = mlx_engine.generate(PROMPTS, 2, max_new_tokens=6, greedy=True)
    assert [c.tokens for g in a for c in g] == [c.tokens for g in b for c in g]
    with pytest.raises(ValueError, match="config"):
        engine_from_model(mlx_engine.model)
