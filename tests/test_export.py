"""``stoa export`` on the tiny model: the exported directory loads in transformers (no missing or unexpected
keys) and mlx-lm and generates the trainer's greedy tokens (published plane and fp32 checkpoint), older versions,
one-line refusals; and on MoE families, whose fused experts are written under their checkpoint names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.export import export_run
from stoa.layout import anchor_prefix
from stoa.models.hf_dir import ExportError
from stoa.trainer.loop import _Trainer
from stoa.weights.planes import state_from_f32, state_to_f32
from tests.test_trainer_resume import make_cfg

PROMPTS = ["What is 3 + 4?", "Tom has 5 apples", "The answer is"]
NEW_TOKENS = 6


def _perturb(trainer: _Trainer, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def run(tmp_path_factory, stoa_cache):
    """A tiny run at v3 (anchors at v1 and v3), its fp32 master weights at v2 checkpointed, and each
    published version's float weights."""
    from stoa.trainer import checkpoint as ckpt

    url = str(tmp_path_factory.mktemp("export") / "b")
    t = _Trainer(make_cfg(url, anchor_every=3), echo=lambda *_: None)
    t.resume()  # v1: the base weights
    planes = {1: state_to_f32(state_from_f32(t.policy.export_f32(), "bf16"), "bf16")}
    _perturb(t, 1)
    loss = sum((p.float() ** 2).sum() for p in t.policy.model.parameters())
    loss.backward()  # one AdamW step, so the checkpoint holds moments the export must leave behind
    t.opt.step()
    t.opt.zero_grad()
    t.publish(2)
    planes[2] = state_to_f32(state_from_f32(t.policy.export_f32(), "bf16"), "bf16")
    masters = {k: v.copy() for k, v in t.policy.export_f32().items()}
    ckpt.save_checkpoint(t.bucket, "r", t.policy.model, t.opt, version=2, step=1)
    _perturb(t, 2)
    t.publish(3)  # an anchor (anchor_every=3)
    planes[3] = state_to_f32(state_from_f32(t.policy.export_f32(), "bf16"), "bf16")
    return {"trainer": t, "bucket": open_bucket(url), "planes": planes, "masters": masters}


def _prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok.encode(p) for p in PROMPTS]


def _greedy_torch(model, ids: list[int]) -> list[int]:
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def _policy_greedy(trainer: _Trainer, weights: dict[str, np.ndarray],
                   prompts: list[list[int]]) -> list[list[int]]:
    """The trainer policy's greedy tokens with the given float weights loaded (restores its own after)."""
    own = {k: v.copy() for k, v in trainer.policy.export_f32().items()}
    trainer.policy.load_f32(weights)
    try:
        return [_greedy_torch(trainer.policy.model, p) for p in prompts]
    finally:
        trainer.policy.load_f32(own)


def _transformers_greedy(out: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return [_greedy_torch(model.eval(), p) for p in prompts]


def _mlx_greedy(out: Path, prompts: list[list[int]]) -> list[list[int]]:
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    from stoa.engines.mlx_blas import prepare_mlx_blas

    prepare_mlx_blas()
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(out))
    model.set_dtype(mx.float32)  # the same numbers as the bf16 file, computed in fp32 like the trainer
    result = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(NEW_TOKENS):
            seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
        result.append(seq[len(ids):])
    return result


def test_published_export_generates_the_trainers_greedy_tokens(run, tmp_path):
    out = tmp_path / "hf"
    lines: list[str] = []
    result = export_run(run["bucket"], "r", out, echo=lines.append)
    assert result.version == 3 and result.dtype == "bfloat16" and any("verified v3" in line for line in lines)
    prompts = _prompt_ids(out)
    want = _policy_greedy(run["trainer"], run["planes"][3], prompts)
    assert _transformers_greedy(out, prompts) == want


def test_published_export_is_the_exact_plane(run, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    export_run(run["bucket"], "r", out, version=2, echo=lambda *_: None)
    loaded = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert set(loaded) == set(run["planes"][2])
    for k, v in run["planes"][2].items():
        np.testing.assert_array_equal(loaded[k].float().numpy(), v, err_msg=k)


@pytest.mark.mlx
def test_mlx_lm_opens_the_export_and_generates_the_same_greedy_tokens(run, tmp_path):
    out = tmp_path / "hf"
    export_run(run["bucket"], "r", out, echo=lambda *_: None)
    prompts = _prompt_ids(out)
    assert _mlx_greedy(out, prompts) == _policy_greedy(run["trainer"], run["planes"][3], prompts)


def test_checkpoint_export_is_the_master_weights(run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    result = export_run(run["bucket"], "r", out, source="checkpoint", echo=lambda *_: None)
    assert result.version == 2 and result.dtype == "float32"
    got = {k: v.numpy() for k, v in load_file(str(out / "model.safetensors")).items()}
    assert set(got) == set(run["masters"])  # no param/ prefix, no exp_avg/ moments
    for k, v in run["masters"].items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    prompts = _prompt_ids(out)
    assert _transformers_greedy(out, prompts) == _policy_greedy(run["trainer"], run["masters"], prompts)


def test_refusals_are_one_line_naming_the_fix(run, tmp_path):
    bucket = run["bucket"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    cases = [
        (dict(run_id="nope", out=tmp_path / "a"), "run 'nope' not found"),
        (dict(run_id="r", out=busy), "is not empty"),
        (dict(run_id="r", out=tmp_path / "b", version=9), "choose --version between 1 and 3"),
        (dict(run_id="r", out=tmp_path / "c", version=2, source="checkpoint"), "--source published only"),
    ]
    for kw, text in cases:
        with pytest.raises(ExportError, match=text) as e:
            export_run(bucket, echo=lambda *_: None, **kw)
        assert "\n" not in str(e.value)


def test_a_version_removed_by_retention_is_named_gone(run, tmp_path):
    import shutil

    bucket = run["bucket"]
    root = Path(run["trainer"].cfg.bucket)
    backup = tmp_path / "backup"
    shutil.copytree(root, backup)
    try:
        run["trainer"].publisher.gc(0)  # keeps anchor v3, deletes anchor v1 and patches v2, v3
        assert not bucket.exists(anchor_prefix("r", 1) + "manifest.json")
        with pytest.raises(ExportError, match=r"version 2 of run 'r' is gone \(retention keeps v3..v3\)"):
            export_run(bucket, "r", tmp_path / "old", version=2, echo=lambda *_: None)
        assert export_run(bucket, "r", tmp_path / "new", version=3, echo=lambda *_: None).version == 3
    finally:
        shutil.rmtree(root)
        shutil.copytree(backup, root)


def test_quickstart_summary_names_the_model_and_an_export_command_that_works(run, tmp_path, capsys,
                                                                              monkeypatch):
    import shlex

    from stoa.cli import main
    from stoa.cli.quickstart import _print_summary

    root = Path(run["trainer"].cfg.bucket)
    _print_summary({"step": 2, "version": 3}, 60.0, root, "r")
    lines = capsys.readouterr().out.splitlines()
    model = next(line for line in lines if line.strip().startswith("model"))
    assert "v3" in model and str(root.resolve()) in model and "trainer/checkpoints" in model
    command = next(line for line in lines if line.strip().startswith("export")).split("export", 1)[1]
    argv = shlex.split(command.split("(")[0])
    assert argv[0] == "stoa"
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    assert (tmp_path / "r-hf" / "model.safetensors").is_file()
    assert main(argv[1:]) == 8  # export refused: a second export into the same directory is refused
    assert "is not empty" in capsys.readouterr().err


def test_an_int8g64_plane_is_written_as_its_exact_mlx_dequantization():
    import torch

    from stoa.export import bf16_tensors
    from stoa.weights.planes import dequantize_int8g64

    rng = np.random.default_rng(0)
    named = {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((8, 128)).astype(np.float32),
             "model.norm.weight": rng.standard_normal(128).astype(np.float32)}
    state = state_from_f32(named, "int8g64")
    got = bf16_tensors(state, "int8g64")
    assert set(got) == set(named) and {t.dtype for t in got.values()} == {torch.bfloat16}
    stem = "model.layers.0.mlp.up_proj"
    want = dequantize_int8g64(state[stem + ".weight"], state[stem + ".scales"], state[stem + ".biases"])
    np.testing.assert_array_equal(got[stem + ".weight"].float().numpy(), want)
    np.testing.assert_array_equal(got["model.norm.weight"].float().numpy(),
                                  state_to_f32({"model.norm.weight": state["model.norm.weight"]}, "bf16")[
                                      "model.norm.weight"])


@pytest.mark.mlx
@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-lfm2-moe"])
def test_moe_exports_load_everywhere_under_checkpoint_names(stoa_cache, tmp_path, family):
    from safetensors import safe_open

    from stoa.models import resolve_model
    from stoa.trainer import checkpoint as ckpt

    url = str(tmp_path / "b")
    t = _Trainer(make_cfg(url, model=family), echo=lambda *_: None)
    t.resume()
    _perturb(t, 3)
    t.publish(2)
    plane = state_to_f32(state_from_f32(t.policy.export_f32(), "bf16"), "bf16")
    masters = {k: v.copy() for k, v in t.policy.export_f32().items()}
    ckpt.save_checkpoint(t.bucket, "r", t.policy.model, t.opt, version=2, step=1)
    base = set(safe_open(str(resolve_model(family, cache_dir=stoa_cache) / "model.safetensors"), "np").keys())
    for source, weights in (("published", plane), ("checkpoint", masters)):
        out = tmp_path / source
        export_run(open_bucket(url), "r", out, source=source, echo=lambda *_: None)
        assert set(safe_open(str(out / "model.safetensors"), "np").keys()) == base, source  # noqa: SIM118
        prompts = _prompt_ids(out)
        want = _policy_greedy(t, weights, prompts)
        assert _transformers_greedy(out, prompts) == want, source
        assert _mlx_greedy(out, prompts) == want, source
