"""MLX generation engine: batched group sampling with a shared-prefix KV cache and exact logprobs."""

from __future__ import annotations

from stoa.worker.tiers import prepare_mlx_blas, warn_if_slow_blas

prepare_mlx_blas()  # must run before the first `import mlx.core` of the process (Linux BLAS, see tiers.py)

import time  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, cast  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from stoa.weights.planes import BITS, GROUP_SIZE, check_plane  # noqa: E402
from stoa.worker.mlx_cpu import use_blas_for_quantized  # noqa: E402
from stoa.worker.types import Completion, GenStats  # noqa: E402

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PREFILL_CHUNK = 2048
"""Prompt tokens per prefill forward (bounds the attention scores' memory on long prompts)."""
_IGNORED_BUFFERS = ("rotary_emb.inv_freq",)
"""Names a model's ``sanitize`` may drop without the state being wrong (recomputed buffers)."""
_QUANT_SUFFIXES = (".scales", ".biases")


def sampling_logprobs_mlx(logits: mx.array, temperature: float, top_p: float) -> mx.array:
    """Log-probabilities of the sampling distribution (temperature, then top-p, renormalised), float32.

    Mirrors ``stoa.worker.sampling.sampling_logprobs_np``: the nucleus is the smallest set of most likely
    tokens whose mass reaches ``top_p`` (the crossing token kept); among tokens of equal probability at the
    edge, lower ids are kept first (numpy's stable sort), whatever the backend's sort does with ties.

    Args:
        logits: [N, V] logits of any float dtype.
        temperature: divides the logits (> 0).
        top_p: nucleus mass in (0, 1].
    """
    z = logits.astype(mx.float32) / temperature
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    if top_p >= 1.0:
        return logp
    sorted_lp = -mx.sort(-logp, axis=-1)
    sorted_p = mx.exp(sorted_lp)
    before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each sorted position
    keep_count = mx.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: before[0] = 0 < top_p
    edge = mx.take_along_axis(sorted_lp, keep_count - 1, axis=-1)  # logprob of the last kept token
    above = logp > edge
    tied = logp == edge
    tie_rank = mx.cumsum(tied.astype(mx.int32), axis=-1)  # 1-based rank by token id among the ties
    keep = above | (tied & (tie_rank <= keep_count - mx.sum(above, axis=-1, keepdims=True)))
    kept = mx.where(keep, logp, -mx.inf)
    return kept - mx.logsumexp(kept, axis=-1, keepdims=True)


def default_dtype() -> str:
    """``bfloat16`` on Metal, ``float32`` elsewhere (MLX's CPU bf16 matmul does not use BLAS)."""
    return "bfloat16" if mx.metal.is_available() else "float32"


def make_key(generator: int | mx.array | None) -> mx.array | None:
    """Turn ``generate``'s ``generator`` into an ``mx.random`` key (None: MLX's global random state).

    Args:
        generator: an int seed, a key from ``mx.random.key``, or None.
    """
    if generator is None:
        return None
    if isinstance(generator, mx.array):
        return generator
    if isinstance(generator, int | np.integer) and not isinstance(generator, bool):
        return mx.random.key(int(generator))
    raise TypeError(f"generator must be an int seed, an mx.random key or None, not {type(generator).__name__}")


def _merge_rows(caches: Sequence[Any], repeat: int) -> Any:
    """One ``BatchKVCache`` from per-prompt ``KVCache``s (any batch each): left-padded, rows repeated.

    Args:
        caches: one prompt's cache for one layer each, in group order.
        repeat: copies of each row (the group size n when one prefill is shared by the group).
    """
    from mlx_lm.models.cache import BatchKVCache

    width = max(c.offset for c in caches)
    keys, values, pad = [], [], []
    for c in caches:
        left = width - c.offset
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        if left:
            widths = [(0, 0), (0, 0), (left, 0), (0, 0)]
            k, v = mx.pad(k, widths), mx.pad(v, widths)
        if repeat > 1:
            k, v = mx.repeat(k, repeat, axis=0), mx.repeat(v, repeat, axis=0)
        keys.append(k)
        values.append(v)
        pad += [left] * k.shape[0]
    merged = BatchKVCache(pad)
    merged.keys = mx.concatenate(keys, axis=0)
    merged.values = mx.concatenate(values, axis=0)
    merged.offset = merged.offset + width
    merged._idx = width
    return merged


class MLXEngine:
    """Samples groups of completions from an mlx-lm model; the torch engine's interface, torch-free.

    Args:
        model_dir: HF directory with config.json (weights optional: ``load_state``/``load_weights`` fill
            them; safetensors present in the directory are loaded).
        dtype: ``auto`` (bf16 on Metal, fp32 on CPU), ``float32`` (exact agreement with torch),
            ``bfloat16`` or ``float16``: the compute dtype of every unquantized weight and activation.
    """

    def __init__(self, model_dir: str | Path, dtype: str = "auto"):
        from mlx_lm.utils import load_model

        name = default_dtype() if dtype == "auto" else dtype
        if name not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
        self.dtype_name = name
        self.dtype = DTYPES[name]
        model_dir = Path(model_dir)
        has_weights = any(model_dir.glob("model*.safetensors"))
        model, config = load_model(model_dir, lazy=True, strict=has_weights)
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
        if kinds:
            raise ValueError(f"{config.get('model_type')!r} models use {', '.join(kinds)} caches; the MLX engine "
                             "supports full-attention models (plain KVCache per layer), e.g. llama and qwen2")
        model.set_dtype(self.dtype)
        model.eval()
        mx.eval(model.parameters())
        self.model: Any = model
        self.config: dict[str, Any] = config
        self.vocab_size = int(config["vocab_size"])
        warn_if_slow_blas()

    # ----------------------------------------------------------------------------------------- weights
    def load_state(self, state: Mapping[str, np.ndarray], plane: str) -> None:
        """Load a published weight state (stored bits) straight into MLX arrays.

        bf16 plane: uint16 bits become ``bfloat16`` arrays (widened to float32 when the engine runs in
        fp32). int8g64 plane: ``<p>.weight`` (uint32 codes), ``<p>.scales`` and ``<p>.biases`` (bf16 bits)
        go into quantized layers (``nn.quantize(group_size=64, bits=8)``), the layout of ``mx.quantize``;
        everything else is bf16 bits as above.

        Args:
            state: tensor name (torch/HF ``named_parameters`` naming) -> stored bits.
            plane: ``bf16`` or ``int8g64``.

        Raises:
            ValueError: on an unknown plane or a missing, unexpected, misshaped or wrongly typed tensor
                (naming it); nothing is loaded then.
        """
        check_plane(plane)
        arrays: dict[str, mx.array] = {}
        for name, a in state.items():
            a = np.asarray(a)
            if plane == "int8g64" and name.endswith(".weight") and f"{name[:-7]}.scales" in state:
                if a.dtype != np.uint32:
                    raise ValueError(f"{name}: int8g64 codes must be uint32, got {a.dtype}")
                arrays[name] = mx.array(a)
            elif a.dtype == np.uint16:
                bits = mx.array(a).view(mx.bfloat16)
                keep_bf16 = plane == "int8g64" and name.endswith(_QUANT_SUFFIXES)
                arrays[name] = bits if keep_bf16 else bits.astype(self.dtype)
            else:
                raise ValueError(f"{name}: dtype {a.dtype} is not stored bits of plane {plane!r} (uint16 bf16 bits)")
        self._install(arrays)

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

    def _sanitize(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map torch/HF names onto the model's with its ``sanitize``; a dropped real tensor is an error."""
        if not hasattr(self.model, "sanitize"):
            return arrays
        out = self.model.sanitize(dict(arrays))
        dropped = sorted(k for k in set(arrays) - set(out) if not k.endswith(_IGNORED_BUFFERS))
        if dropped and not set(out) - set(arrays):
            tied = " (the model ties its embeddings)" if "lm_head.weight" in dropped else ""
            raise ValueError(f"unexpected tensor {dropped[0]!r}{tied}; unexpected: {dropped[:5]}")
        return out

    def _install(self, arrays: dict[str, mx.array]) -> None:
        """Check every name, shape and dtype against the model, then load all at once."""
        arrays = self._sanitize(arrays)
        quant = {k[: -len(".scales")] for k in arrays if k.endswith(".scales")}
        expected: dict[str, tuple[tuple[int, ...], str]] = {
            k: (tuple(v.shape), "uint32" if v.dtype == mx.uint32 else "float")
            for k, v in cast(list[tuple[str, mx.array]], tree_flatten(self.model.parameters()))
        }
        to_quantize: set[str] = set()
        for path, module in self.model.named_modules():
            is_q = isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
            if path in quant and not is_q:
                if not hasattr(module, "to_quantized"):
                    raise ValueError(f"{path}.scales: layer {path!r} ({type(module).__name__}) cannot be quantized")
                rows, cols = module.weight.shape
                if cols % GROUP_SIZE:
                    raise ValueError(f"{path}.weight: input dimension {cols} is not a multiple of {GROUP_SIZE}")
                expected[f"{path}.weight"] = ((rows, cols * BITS // 32), "uint32")
                for suffix in _QUANT_SUFFIXES:
                    expected[path + suffix] = ((rows, cols // GROUP_SIZE), "float")
                to_quantize.add(path)
            elif is_q and path not in quant:
                raise ValueError(f"{path}.scales: missing; this engine already holds int8g64 layers "
                                 "(build a new engine to load another plane)")
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        if missing or extra:
            first = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {extra[0]!r}"
            raise ValueError(f"weights do not match the model: {first}; missing={missing[:5]} unexpected={extra[:5]}")
        for name, (shape, kind) in expected.items():
            a = arrays[name]
            if tuple(a.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(a.shape)} != model {shape}")
            if (a.dtype == mx.uint32) != (kind == "uint32"):
                raise ValueError(f"{name}: dtype {a.dtype} does not fit the model's layer ({kind})")
        if to_quantize:
            nn.quantize(self.model, group_size=GROUP_SIZE, bits=BITS, class_predicate=lambda p, m: p in to_quantize)
            use_blas_for_quantized(self.model)
        self.model.load_weights(list(arrays.items()), strict=True)
        mx.eval(self.model.parameters())

    # -------------------------------------------------------------------------------------- generation
    def _prefill(self, prompt: Sequence[int], rows: int) -> tuple[list[Any], mx.array]:
        """Run one prompt through the model at batch ``rows``; return its per-layer KV caches and logits."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        ids = mx.array(list(prompt), dtype=mx.int32)[None]
        if rows > 1:
            ids = mx.repeat(ids, rows, axis=0)
        # Everything but the last token only fills the cache: the vocabulary projection is never evaluated.
        for start in range(0, ids.shape[1] - 1, PREFILL_CHUNK):
            self.model(ids[:, start : min(start + PREFILL_CHUNK, ids.shape[1] - 1)], cache=cache)
            mx.eval([c.state for c in cache])
        logits = self.model(ids[:, -1:], cache=cache)[:, -1, :]
        return cache, logits

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
                None draws from MLX's global random state (``mx.random.seed``).
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

        k = len(prompts)
        if k == 0 or min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
        if temperature <= 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {temperature}, {top_p}")
        bad = [t for p in prompts for t in p if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        stats = GenStats()
        key = make_key(generator)
        eos = set(int(t) for t in eos_ids)

        def sample(logits: mx.array, key: mx.array | None) -> tuple[mx.array, mx.array, mx.array | None]:
            logp = sampling_logprobs_mlx(logits, temperature, top_p)
            if greedy:
                tok = mx.argmax(logp, axis=-1)
            elif key is None:
                tok = mx.random.categorical(logp)
            else:
                key, sub = mx.random.split(key)
                tok = mx.random.categorical(logp, key=sub)
            lp = mx.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
            return tok, lp, key

        with wired_limit(self.model):
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            per_prompt = [self._prefill(p, 1 if share_prefix else n) for p in prompts]
            mx.eval([lg for _, lg in per_prompt])
            stats.extra["prompt_tokens"] = float(sum(len(p) for p in prompts) * (1 if share_prefix else n))
            repeat = n if share_prefix else 1
            cache = [_merge_rows([c[layer] for c, _ in per_prompt], repeat) for layer in range(len(per_prompt[0][0]))]
            logits = mx.concatenate([lg for _, lg in per_prompt], axis=0)
            if repeat > 1:
                logits = mx.repeat(logits, repeat, axis=0)
            del per_prompt
            tok, lp, key = sample(logits, key)
            mx.eval(tok, lp, [c.state for c in cache])
            stats.prefill_s = time.perf_counter() - t0

            rows = k * n
            tokens: list[list[int]] = [[] for _ in range(rows)]
            lps: list[list[float]] = [[] for _ in range(rows)]
            finish = ["length"] * rows
            active = list(range(rows))
            ntok, nlp = tok, lp
            t1 = time.perf_counter()
            for step in range(max_new_tokens):
                last = step == max_new_tokens - 1
                if not last:  # queue the next step before reading this one (overlaps Python with compute)
                    nlogits = self.model(tok[:, None], cache=cache)[:, -1, :]
                    ntok, nlp, key = sample(nlogits, key)
                    mx.async_eval(ntok, nlp)
                stats.steps += 1
                keep: list[int] = []
                for i, (r, t, v) in enumerate(zip(active, cast(list, tok.tolist()), cast(list, lp.tolist()), strict=True)):
                    tokens[r].append(t)
                    lps[r].append(v)
                    if t in eos:
                        finish[r] = "stop"
                    else:
                        keep.append(i)
                stats.new_tokens += len(active)
                if last or not keep:
                    break
                if len(keep) < len(active):  # drop finished rows from the batch and the cache
                    idx = mx.array(keep, dtype=mx.int32)
                    for c in cache:
                        c.filter(idx)
                    active = [active[i] for i in keep]
                    ntok, nlp = ntok[idx], nlp[idx]
                tok, lp = ntok, nlp
            stats.decode_s = time.perf_counter() - t1
            stats.extra["peak_memory_mb"] = mx.get_peak_memory() / 1e6
        groups = [
            [Completion(tokens[g * n + j], lps[g * n + j], finish[g * n + j]) for j in range(n)]
            for g in range(k)
        ]
        return groups, stats
