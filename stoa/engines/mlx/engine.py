"""MLX generation engine: batched group sampling with a shared-prefix cache and exact logprobs.

Layers may hold attention KV or a fixed-size conv / linear-attention state (lfm2, qwen3.5): each prompt is
prefilled once, its cache rows repeated per sample for every kind (``stoa.engines.mlx.caches``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from stoa.engines.base import Completion, GenStats, RowLog
from stoa.engines.mlx.adapter import load_adapter, use_adapter
from stoa.engines.mlx.caches import cache_arrays, check_cache_kinds
from stoa.engines.mlx.install import QUANT_SUFFIXES, cast_model, install, quant_prefix
from stoa.engines.mlx.kv import compact, feed, merge_rows
from stoa.engines.mlx.quantized import set_lookup_dtype, use_float32_gather
from stoa.engines.mlx.rounds import Batch, Sampler, check_driver, run_rounds
from stoa.engines.mlx.sampling import Draw, draw, make_key
from stoa.engines.mlx.slots import admit, row_queue
from stoa.engines.mlx_blas import warn_if_slow_blas
from stoa.engines.slots import queues
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.weights.planes import ADAPTER_PLANE, QUANT_BITS, check_plane, state_to_f32

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PREFILL_CHUNK = 2048
"""Prompt tokens per prefill forward (bounds the attention scores' memory on long prompts)."""


def default_dtype() -> str:
    """``bfloat16`` on Metal, ``float32`` elsewhere (MLX's CPU bf16 matmul does not use BLAS)."""
    return "bfloat16" if mx.metal.is_available() else "float32"


def _dtype_name(dtype: str) -> str:
    """The compute dtype's name for ``dtype`` (``auto``: :func:`default_dtype`); ValueError if unknown."""
    name = default_dtype() if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return name


def _check_generate_args(prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float,
                         top_p: float, vocab_size: int) -> None:
    """Refuse arguments ``generate`` cannot honour, naming the bad value (ValueError)."""
    if len(prompts) == 0 or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {temperature}, {top_p}")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab_size})")


class MLXEngine:
    """Samples groups of completions from an mlx-lm model; the ``Engine`` protocol, torch-free.

    Args:
        model_dir: HF directory with config.json (weights optional: ``load_state``/``load_weights`` fill
            them; safetensors present in the directory are loaded).
        dtype: ``auto`` (bf16 on Metal, fp32 on CPU), ``float32`` (exact agreement with torch),
            ``bfloat16`` or ``float16``: the compute dtype of every unquantized weight and activation.
    """

    batch_resumes: bool = True
    """Feed all rows resumed in a round in one forward (``rounds.feed_together``); False: one at a time."""
    refill: bool = True
    """Resume rows that pause while others decode before the next step, joining the batch (``rounds.decode_round``;
    attention-only models); False: resume only when no row decodes (one tool request per round)."""
    decode_slots: int = 0
    """Continuous batching (``stoa.engines.mlx.slots``): below the rows of a ``generate_episodes`` call, at most this
    many rows decode or wait for a tool at once; the other episodes queue and take the slots of rows that end (a
    hybrid's once every row of the batch has ended); 0: every row at once."""

    def __init__(self, model_dir: str | Path, dtype: str = "auto"):
        from mlx_lm.utils import load_model

        name = _dtype_name(dtype)
        model_dir = Path(model_dir)
        has_weights = any(model_dir.glob("model*.safetensors"))
        model, config = load_model(model_dir, lazy=True, strict=has_weights)
        check_cache_kinds(model, config.get("model_type"))
        cast_model(model, DTYPES[name])
        use_float32_gather(model)
        model.eval()
        mx.eval(model.parameters())
        self._setup(model, config, name)
        warn_if_slow_blas()

    @classmethod
    def from_model(cls, model: nn.Module, config: Mapping[str, Any], dtype: str = "auto") -> MLXEngine:
        """Sample from an mlx-lm model already loaded (local mode's policy): no second copy of the weights.

        Args:
            model: the model, used as it is (dtype, quantization and adapters kept).
            config: its config.json as a dict.
            dtype: the dtype the model computes in (``auto``: the default for this machine), for reports
                and later loads.
        """
        check_cache_kinds(model, config.get("model_type"))
        self = cls.__new__(cls)
        use_float32_gather(model)
        self._setup(model, config, _dtype_name(dtype))
        return self

    def _setup(self, model: nn.Module, config: Mapping[str, Any], dtype_name: str) -> None:
        self.model: Any = model
        self.config: Mapping[str, Any] = config
        text = config.get("text_config") or {}  # qwen3.5 nests the language model's fields
        self.vocab_size = int(config.get("vocab_size") or text["vocab_size"])
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]

    def make_generator(self, seed: int | None) -> None:
        """Seed MLX's global random stream and return None, the ``generator`` that draws from it.

        A key passed to ``generate`` restarts with every call (the same seed gives the same completions),
        so a worker seeds the global stream once instead.

        Args:
            seed: the seed; None leaves the stream as it is.
        """
        if seed is not None:
            mx.random.seed(seed)
        return None

    # ----------------------------------------------------------------------------------------- weights
    def load_state(self, state: Mapping[str, np.ndarray], plane: str) -> None:
        """Load a published weight state (stored bits) straight into MLX arrays.

        bf16 plane: uint16 bits become ``bfloat16`` arrays (widened to float32 when the engine runs in
        fp32). int8g64 plane: ``<p>.weight`` (uint32 codes), ``<p>.scales`` and ``<p>.biases`` (bf16 bits)
        go into quantized layers (``nn.quantize(group_size=64, bits=8)``), the layout of ``mx.quantize``;
        a fused 3-D expert tensor ``<p>.experts.gate_up_proj`` quantizes likewise, its scales named
        ``<p>.experts.gate_up_proj.scales`` (``stoa.engines.mlx.install``); everything else is bf16 bits. int4g64 (a
        LoRA run's base): the same with ``bits=4``, so mlx's quantized matmul runs on the published bits.

        Args:
            state: tensor name (torch/HF ``named_parameters`` naming) -> stored bits.
            plane: ``bf16``, ``int8g64`` or ``int4g64``; or ``adapter``: a LoRA run's adapter tensors, after
                :meth:`use_adapter`.

        Raises:
            ValueError: on an unknown plane or a missing, unexpected, misshaped or wrongly typed tensor
                (naming it); nothing is loaded then.
        """
        check_plane(plane)
        if plane == ADAPTER_PLANE:
            load_adapter(self.model, state_to_f32(state, plane), self.dtype)
            return
        arrays: dict[str, mx.array] = {}
        quant_bits = QUANT_BITS.get(plane, 0)
        for name, a in state.items():
            a = np.asarray(a)
            codes = not name.endswith(QUANT_SUFFIXES) and f"{quant_prefix(name)}.scales" in state
            if quant_bits and codes:
                if a.dtype != np.uint32:
                    raise ValueError(f"{name}: {plane} codes must be uint32, got {a.dtype}")
                arrays[name] = mx.array(a)
            elif a.dtype == np.uint16:
                bits = mx.array(a).view(mx.bfloat16)
                keep_bf16 = bool(quant_bits) and name.endswith(QUANT_SUFFIXES)
                arrays[name] = bits if keep_bf16 else bits.astype(self.dtype)
            else:
                raise ValueError(f"{name}: dtype {a.dtype} is not stored bits of plane {plane!r} "
                                 "(uint16 bf16 bits)")
        self._install(arrays, quant_bits or 8)

    def use_adapter(self, rank: int, alpha: float, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Add LoRA layers to the loaded base (``stoa.engines.mlx.adapter``: the trainer's LoRA forward), zero until
        an adapter version loads; the adapted linears' shapes, module path -> (out, in).

        Args:
            rank: the adapter's rank.
            alpha: LoRA alpha.
            targets: module-name suffixes.
        """
        return use_adapter(self.model, rank, alpha, targets, self.dtype)

    def load_weights(self, named: Mapping[str, np.ndarray]) -> None:
        """Copy float32 arrays into the model (names as in torch's ``named_parameters``).

        Args:
            named: parameter name -> float32 array of the parameter's shape.

        Raises:
            ValueError: on a missing, unexpected or misshaped tensor (never loads partially).
        """
        arrays = {}
        for name, a in named.items():
            a = np.asarray(a)
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"{name}: expected float values, got {a.dtype}")
            arrays[name] = mx.array(a.astype(np.float32, copy=False)).astype(self.dtype)
        self._install(arrays)

    def _install(self, arrays: dict[str, mx.array], bits: int = 8) -> None:
        """Check every name, shape and dtype against the model, then load all at once (``stoa.engines.mlx.install``;
        quantized layers with ``bits`` per code)."""
        install(self.model, arrays, bits)
        set_lookup_dtype(self.model, self.dtype)  # quantized embeddings: rows in the compute dtype, as the head's

    # -------------------------------------------------------------------------------------- generation
    def _prefill(self, prompt: Sequence[int], rows: int) -> tuple[list[Any], mx.array]:
        """Run one prompt through the model at batch ``rows`` (no padding); return its per-layer caches and logits."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        ids = mx.repeat(mx.array(list(prompt), dtype=mx.int32)[None], rows, axis=0)
        return cache, feed(self.model, cache, ids, PREFILL_CHUNK)

    def _prefill_groups(self, prompts: Sequence[Sequence[int]], n: int, share_prefix: bool,
                        stats: GenStats) -> tuple[list[Any], mx.array]:
        """Prefill every prompt and merge the caches into one batch of ``len(prompts) * n`` rows.

        Args:
            prompts: token ids of each prompt.
            n: rows per prompt.
            share_prefix: prefill each prompt once and repeat its KV rows (False: prefill n copies).
            stats: receives ``extra["prompt_tokens"]``, the prompt tokens run through the model.

        Returns:
            the per-layer ``BatchKVCache`` / ``ArraysCache`` and the last-position logits of every row.
        """
        per_prompt = [self._prefill(p, 1 if share_prefix else n) for p in prompts]
        mx.eval([lg for _, lg in per_prompt])
        stats.extra["prompt_tokens"] = float(sum(len(p) for p in prompts) * (1 if share_prefix else n))
        repeat = n if share_prefix else 1
        layers = len(per_prompt[0][0])
        cache = [merge_rows([c[layer] for c, _ in per_prompt], repeat) for layer in range(layers)]
        logits = mx.concatenate([lg for _, lg in per_prompt], axis=0)
        if repeat > 1:
            logits = mx.repeat(logits, repeat, axis=0)
        return cache, logits

    def _start(self, prompts: Sequence[Sequence[int]], n: int, share_prefix: bool, sample: Sampler,
               key: mx.array | None, stats: GenStats) -> tuple[list[Any], Draw]:
        """Prefill the groups (``_prefill_groups``) and draw every row's first token; sets ``prefill_s``."""
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        cache, logits = self._prefill_groups(prompts, n, share_prefix, stats)
        first = sample(logits, key)
        mx.eval(first.tokens, first.logprobs, cache_arrays(cache))
        stats.prefill_s = time.perf_counter() - t0
        return cache, first

    def _decode(self, cache: list[Any], first: Draw, sample: Sampler, max_new_tokens: int, eos: set[int],
                stats: GenStats) -> RowLog:
        """Decode until every row has stopped or reached ``max_new_tokens``, dropping finished rows.

        Each step queues the next forward and draw before reading its own tokens (overlapping Python with
        compute).

        Args:
            cache: the batch's per-layer KV cache after the prefill.
            first: the draw from the prefill logits (one row per completion).
            sample: the step's draw.
            max_new_tokens: length cap.
            eos: tokens that end a row.
            stats: receives steps and new tokens.
        """
        log = RowLog(first.tokens.shape[0])
        active = list(range(first.tokens.shape[0]))
        cur = nxt = first
        for step in range(max_new_tokens):
            last = step == max_new_tokens - 1
            if not last:
                nxt = sample(self.model(cur.tokens[:, None], cache=cache)[:, -1, :], cur.key)
                mx.async_eval(nxt.tokens, nxt.logprobs)
            stats.steps += 1
            keep = log.record(active, cast(list, cur.tokens.tolist()), cast(list, cur.logprobs.tolist()), eos)
            stats.new_tokens += len(active)
            if last or not keep:
                break
            if len(keep) < len(active):
                active, nxt = compact(cache, active, keep, nxt)
            cur = nxt
        return log

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_ids: Sequence[int] = (),
        generator: int | mx.array | None = None,
        greedy: bool = False,
        share_prefix: bool = True,
    ) -> tuple[list[list[Completion]], GenStats]:
        """Sample ``n`` completions for each prompt; each prompt is prefilled once and its KV shared.

        Args:
            prompts: token ids of each prompt (one group per prompt).
            n: completions per prompt.
            max_new_tokens: length cap.
            temperature: sampling temperature.
            top_p: nucleus mass.
            eos_ids: tokens that end a completion (included in the completion).
            generator: an int seed or an ``mx.random.key`` for reproducible sampling (the key is split
                once per decode step; the same seed, model, dtype and device give the same completions);
                None draws from MLX's global random state (``mx.random.seed``, ``make_generator``).
            greedy: take the argmax instead of sampling (for evaluation); logprobs stay those of
                the temperature/top-p distribution.
            share_prefix: prefill each prompt once at batch 1 and repeat its KV rows n times (the
                ``paged_prefix`` KV mode); False prefills the n copies as a batch (for benchmarks only:
                same result, n times the prefill work).

        Returns:
            per prompt, its ``n`` completions; and timing figures (``extra``: prompt tokens prefilled,
            peak MLX memory in MB).
        """
        from mlx_lm.generate import wired_limit

        _check_generate_args(prompts, n, max_new_tokens, temperature, top_p, self.vocab_size)
        stats = GenStats()
        key = make_key(generator)
        sample: Sampler = partial(draw, temperature=temperature, top_p=top_p, greedy=greedy)
        with wired_limit(self.model):
            cache, first = self._start(prompts, n, share_prefix, sample, key, stats)
            t1 = time.perf_counter()
            log = self._decode(cache, first, sample, max_new_tokens, {int(t) for t in eos_ids}, stats)
            stats.decode_s = time.perf_counter() - t1
            stats.extra["peak_memory_mb"] = mx.get_peak_memory() / 1e6
        return log.groups(n), stats

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        driver: EpisodeDriver,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: int | mx.array | None = None,
        greedy: bool = False,
    ) -> tuple[list[list[Episode]], GenStats]:
        """Run ``n`` multi-turn episodes for each prompt; each prompt is prefilled once and its KV shared.

        Rows decode until each ends or pauses (the driver decides); the tools of all paused rows run in one
        request, and the resumed rows are fed their observations in one forward (``batch_resumes``; else each in its
        own cache at batch 1; ``stoa.engines.mlx.rounds``). With ``decode_slots`` below the rows, at most that many
        rows decode at once and queued episodes (prefilled when admitted) take the slots of rows that end.

        Args:
            prompts: token ids of each prompt (one group per prompt).
            n: episodes per prompt.
            driver: one environment per row (row ``g * n + j``), the tools, the limits and EOS ids.
            temperature: sampling temperature.
            top_p: nucleus mass.
            generator: an int seed, an ``mx.random.key`` or None (as in ``generate``).
            greedy: take the argmax (evaluation); logprobs stay those of the temperature/top-p distribution.

        Returns:
            per prompt, its ``n`` episodes; and timing figures (``prefill_s`` counts the prompts' and the
            observations' prefill, as the torch engine; ``extra``: the driver's stats, rounds, ``resume_s``,
            ``obs_prefill_tokens``, ``obs_prefill_s``, prompt tokens, peak MLX memory in MB; with a queue
            ``admitted`` (rows admitted after the first step) and ``admit_prefill_s``, within ``prefill_s``).

        Raises:
            ToolUnavailable: the tools could not answer (the driver's episodes stay unfinished).
        """
        from mlx_lm.generate import wired_limit

        _check_generate_args(prompts, n, 1, temperature, top_p, self.vocab_size)
        check_driver(driver, prompts, n)
        stats = GenStats()
        sample: Sampler = partial(draw, temperature=temperature, top_p=top_p, greedy=greedy)
        history = (lambda r: [*prompts[r // n], *driver.episode(r).tokens]) if self.batch_resumes else None
        with wired_limit(self.model):
            if queues(self.decode_slots, driver.rows):
                mx.reset_peak_memory()
                stats.extra.update(admitted=0.0, admit_prefill_s=0.0, prompt_tokens=0.0)
                slots = partial(admit, row_queue(self, prompts, n, stats), self.decode_slots, sample, stats)
                run_rounds(self.model, None, sample, driver, self.vocab_size, PREFILL_CHUNK, stats, history,
                           self.refill, slots, make_key(generator))
            else:
                cache, first = self._start(prompts, n, True, sample, make_key(generator), stats)
                run_rounds(self.model, Batch(cache, list(range(driver.rows)), first), sample, driver,
                           self.vocab_size, PREFILL_CHUNK, stats, history, self.refill)
            stats.extra["peak_memory_mb"] = mx.get_peak_memory() / 1e6
        stats.prefill_s += stats.extra["obs_prefill_s"]
        stats.extra.update(driver.stats)
        return driver.episodes(n), stats
