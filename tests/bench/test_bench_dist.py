"""`stoa bench dist`: the torchrun re-launch, MFU arithmetic, the random 1B config's size, and one in-process run
whose published planes equal a second identical run's."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from stoa.bench.dist import (
    Row,
    add_arguments,
    child_argv,
    compare,
    mfu,
    peak_bf16_flops,
    plane_digests,
    run,
    torchrun_argv,
)
from stoa.models.random_llama import llama_1b_config, llama_param_count
from stoa.models.tiny import tiny_config, tiny_weights


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_torchrun_argv_puts_the_benchmark_after_a_double_dash():
    argv = torchrun_argv(["bench", "dist", "--repeats", "2"], 4, "/py")
    assert argv == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "stoa",
                    "--", "bench", "dist", "--repeats", "2"]


def test_child_argv_re_parses_to_the_same_setting_without_compare():
    args = _args("--model", "llama-1b", "--nproc", "8", "--compare", "--device", "cuda", "--dtype", "bfloat16",
                 "--groups", "3", "--lr", "3e-05", "--no-gradient-checkpointing", "--peak-tflops", "500")
    argv = child_argv(args, 8, "/tmp/rows.jsonl", reference="/tmp/ref.npz")
    assert argv[:2] == ["bench", "dist"]
    child = _args(*argv[2:])
    assert (child.nproc, child.out, child.reference, child.child, child.compare) == (8, "/tmp/rows.jsonl",
                                                                                      "/tmp/ref.npz", True, False)
    for key in ("model", "device", "dtype", "groups", "lr", "gradient_checkpointing", "peak_tflops", "n", "tokens"):
        assert getattr(child, key) == getattr(args, key), key
    assert _args(*child_argv(_args(), 1, "o", save_final="f")[2:]).gradient_checkpointing is None


def test_mfu_on_a_hand_computed_example():
    # 6 * 1e8 params * 1e4 tokens = 6e12 FLOPs in 2 s on 2 devices of 1e15 FLOP/s: 3e12 / 2e15 = 1.5e-3
    assert mfu(100_000_000, 10_000, 2.0, 1e15, 2) == pytest.approx(1.5e-3)
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA L4") is None
    assert peak_bf16_flops("NVIDIA L4", 121.0) == 121e12


def test_llama_1b_has_about_a_billion_parameters_counted_from_its_config():
    cfg = llama_1b_config()
    assert 1.0e9 <= llama_param_count(cfg) <= 1.2e9
    # embeddings (tied) + 22 x (q, o; k, v; gate, up, down; 2 norms) + final norm
    assert llama_param_count(cfg) == 49152 * 2048 + 22 * (2 * 2048**2 + 2 * 2048 * 512 + 3 * 2048 * 5632 + 4096) + 2048
    tiny = tiny_config("llama")  # the same formula counts the tiny model's real tensors
    assert llama_param_count(tiny) == sum(a.size for a in tiny_weights(tiny).values())


def test_compare_sees_a_single_flipped_bf16_element():
    w = {"a.weight": np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)}
    row = Row("m", "cpu", "cpu", "fp32", 1, 1, 1, 1, 1, True, False, 1, 128, 1.0, 1.0, 1.0, 1.0, [0.1], None,
              digests=plane_digests(w))
    compare(row, w, {k: v.copy() for k, v in w.items()}, plane_digests(w))
    assert (row.max_abs_delta, row.bf16_mismatch, row.bits_ok) == (0.0, 0, True)
    moved = {"a.weight": w["a.weight"].copy()}
    moved["a.weight"][0, 3] += 0.01
    compare(row, w, moved, plane_digests(moved))
    assert row.bf16_mismatch == 1 and row.planes_equal == {"bf16": False, "int8g64": False}
    assert row.max_abs_delta == pytest.approx(0.01, rel=1e-3)


def test_an_in_process_run_times_steps_and_its_planes_equal_a_second_identical_run(tiny_dir):
    rows = run(_args("--model", str(tiny_dir), "--nproc", "1", "--compare", "--groups", "2", "--n-samples", "2",
                     "--prompt-tokens", "8", "--max-new-tokens", "8", "--repeats", "1", "--lr", "1e-3"))
    assert [r.world for r in rows] == [1, 1]
    first, second = rows
    assert first.step_s > 0 and second.step_s > 0 and first.tokens_per_s > 0
    assert first.peak_gib[0] > 0 and first.mfu is None  # MFU only on CUDA
    assert first.bf16_moved > 0.5  # lr 1e-3 moves most bf16 elements, so equal planes are not the start's
    assert second.bits_ok is True and second.max_abs_delta == 0.0 and second.bf16_mismatch == 0
    assert second.digests == first.digests and set(first.digests) == {"bf16", "int8g64"}
