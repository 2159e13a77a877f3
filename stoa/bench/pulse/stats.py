"""Measurements of the PULSE benchmark: timing, bit-exactness, changed values and the bf16 flip models."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from stoa.weights.planes import f32_to_bf16_bits

T = TypeVar("T")


def timed_cpu(fn: Callable[[], T], repeat: int) -> tuple[float, float, T]:
    """Run ``fn`` ``repeat`` times; return the median wall and process CPU times and the last result.

    CPU time counts every thread of this process, so on a machine shared with other work it shows what
    the work costs while wall time shows what it took.

    Args:
        fn: the work to time.
        repeat: how many runs (at least 1).
    """
    walls: list[float] = []
    cpus: list[float] = []
    result: T | None = None
    for _ in range(max(1, repeat)):
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    assert result is not None
    return statistics.median(walls), statistics.median(cpus), result


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Run ``fn`` ``repeat`` times; return the median wall time and the last result.

    Args:
        fn: the work to time.
        repeat: how many runs (at least 1).
    """
    wall, _, result = timed_cpu(fn, repeat)
    return wall, result


def states_identical(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Whether two states have the same names, dtypes, shapes and raw bytes.

    Args:
        a: a state.
        b: another state.
    """
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)):
            return False
    return True


def tensor_kind(name: str) -> str:
    """Coarse tensor group for breakdowns: embed, attn, mlp, norm or other.

    Args:
        name: parameter or state tensor name.
    """
    if "embed" in name or "lm_head" in name:
        return "embed"
    if "norm" in name:
        return "norm"
    if "attn" in name:
        return "attn"
    if "mlp" in name:
        return "mlp"
    return "other"


def count_changed(prev: Mapping[str, np.ndarray],
                  new: Mapping[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Changed and total stored values per tensor kind (packed uint32 int8 codes count one per byte).

    Args:
        prev: state before.
        new: state after (same layout).
    """
    out: dict[str, tuple[int, int]] = {}
    for name, a in prev.items():
        b = new[name]
        if a.dtype == np.uint32:  # four int8 codes per word: count codes, not words
            a, b = a.view(np.uint8), b.view(np.uint8)
        c, n = out.get(tensor_kind(name), (0, 0))
        out[tensor_kind(name)] = (c + int(np.count_nonzero(a != b)), n + int(a.size))
    return out


def bf16_flip_model(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
                    lr: float) -> dict[str, float]:
    """Measured bf16 flips of one step next to three models of how many there should be.

    A bf16 value of magnitude in [2^k, 2^(k+1)) has spacing ``ulp = 2^(k-7)`` (relative 2^-8..2^-7). A
    master weight at a uniformly random point of its rounding cell that moves by ``d`` changes its bf16
    bits with probability ``min(1, d / ulp)``. ``uniform_lr`` uses ``d = lr`` (Adam moves every weight by
    about lr, whatever its gradient): only weight magnitudes and the lr enter. ``uniform_delta`` uses the
    measured per-weight ``|delta|``. ``position_lr`` drops the uniform assumption: the mean over weights
    of ``(flip(w + lr) + flip(w - lr)) / 2`` at their actual fp32 positions (a move of lr in a random
    direction). ``on_grid`` is the fraction of master weights exactly on a bf16 value (needs
    ``d >= ulp / 2`` to flip) and ``tie`` the fraction exactly halfway between two (any move away from
    the even neighbour flips it). Exact zeros count as flipping whenever they move.

    Args:
        before: fp32 master weights before the step.
        after: fp32 master weights after the step.
        lr: the step's learning rate.
    """
    n = 0
    sums = dict.fromkeys(("measured", "uniform_lr", "uniform_delta", "position_lr", "on_grid", "tie"), 0.0)
    ratio_sum = 0.0
    near_lr = 0
    chunk = 1 << 22
    step = np.float32(lr)
    for name, w0_all in before.items():
        f0, f1 = w0_all.reshape(-1), after[name].reshape(-1)
        for s in range(0, f0.size, chunk):
            w0, w1 = f0[s : s + chunk], f1[s : s + chunk]
            d = np.abs(w1.astype(np.float64) - w0.astype(np.float64))
            _, e = np.frexp(w0)
            ulp = np.ldexp(1.0, e.astype(np.int32) - 8)
            zero = w0 == 0
            p_lr = np.minimum(1.0, lr / ulp)
            p_d = np.minimum(1.0, d / ulp)
            p_lr[zero] = 1.0
            p_d[zero] = d[zero] > 0
            b0 = f32_to_bf16_bits(w0)
            low = w0.view(np.uint32) & np.uint32(0xFFFF)
            sums["measured"] += np.count_nonzero(b0 != f32_to_bf16_bits(w1))
            sums["uniform_lr"] += float(p_lr.sum())
            sums["uniform_delta"] += float(p_d.sum())
            sums["position_lr"] += 0.5 * (np.count_nonzero(f32_to_bf16_bits(w0 + step) != b0)
                                          + np.count_nonzero(f32_to_bf16_bits(w0 - step) != b0))
            sums["on_grid"] += np.count_nonzero(low == 0)
            sums["tie"] += np.count_nonzero(low == 0x8000)
            ratio_sum += float(d.sum()) / lr
            near_lr += int(np.count_nonzero(d >= 0.5 * lr))
            n += w0.size
    out = {k: float(v) / n for k, v in sums.items()}
    out["mean_abs_delta_over_lr"] = ratio_sum / n
    out["frac_delta_ge_half_lr"] = near_lr / n
    return out


def magnitude_quantiles(named: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Quantiles of |w| over all master weights (a 1-in-17 subsample) and the fraction of exact zeros.

    Args:
        named: fp32 master weights.
    """
    a = np.concatenate([np.abs(v.reshape(-1)[::17]) for v in named.values()])
    out = {f"q{int(q * 100):02d}": float(np.quantile(a, q)) for q in (0.01, 0.1, 0.5, 0.9)}
    out["zero"] = float(np.mean(a == 0))
    return out

