"""Torch generation engine: batched group sampling with a shared-prefix KV cache and exact logprobs."""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoa.config import WORKER_DTYPES
from stoa.engines.base import Completion, GenStats, RowLog
from stoa.engines.torch_episodes import RowQueue, run_episodes
from stoa.engines.torch_rows import DecodeBatch
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.weights.planes import ADAPTER_PLANE, state_to_f32


def sampling_logprobs_torch(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the sampling distribution (temperature, then top-p, renormalised).

    Mirrors ``stoa.engines.sampling.sampling_logprobs_np`` exactly in its choice of nucleus.

    Args:
        logits: [N, V] float32 logits.
        temperature: divides the logits.
        top_p: nucleus mass in (0, 1].
    """
    z = logits.float()
    logp = torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    sorted_p = sorted_lp.exp()
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= top_p)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def resolve_device(device: str) -> torch.device:
    """Map ``auto`` to cuda when available, else cpu.

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DTYPES = WORKER_DTYPES


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (x86 AVX512-BF16/AMX-BF16, Arm BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: str, device: torch.device, plane: str = "bf16") -> torch.dtype:
    """The engine's compute dtype.

    ``auto`` picks bf16 on CUDA, and on a CPU with native bf16 when the weight plane is bf16 (the plane's
    values are then exact in bf16, and decoding reads half the bytes: 2x tokens/s on SmolLM2, see
    docs/mlx.md); float32 otherwise. bf16 activations move recorded logprobs away from the trainer's
    fp32 recompute (figures in docs/mlx.md); the trust-region gate bounds what that can do.

    Args:
        dtype: ``auto``, ``float32`` or ``bfloat16``.
        device: the engine's device.
        plane: the run's weight plane (``bf16`` or ``int8g64``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if plane == "bf16" and cpu_has_native_bf16() else torch.float32


def sample_step(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the temperature/top-p distribution, and its logprob.

    Sampling inverts the CDF with one uniform per row (``multinomial`` would draw one exponential per
    vocabulary entry), so a generator advances by exactly one number per row and step.

    Args:
        logits: [rows, V] last-position logits.
        temperature: sampling temperature.
        top_p: nucleus mass.
        greedy: take the argmax; the logprob stays that of the distribution.
        generator: torch RNG (None: torch's global one).

    Returns:
        [rows] token ids and [rows] their logprobs.
    """
    logp = sampling_logprobs_torch(logits, temperature, top_p)
    if greedy:
        tok = logp.argmax(dim=-1)
    else:
        cdf = logp.exp().cumsum(dim=-1)
        u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device) * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a published weight state holds: the parameters (tied ones once) and the floating-point buffers the
    checkpoint stores (lfm2-moe's ``expert_bias``: never trained, yet it chooses the experts, so a worker that
    built the model from config alone must receive it).

    Args:
        model: a transformers model.
    """
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    saved = set(model.state_dict())
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    out.update({k: b for k, b in model.named_buffers() if k in saved and k not in params and b.is_floating_point()})
    return out


class TorchEngine:
    """Samples groups of completions from an HF causal LM (float32, or bf16: see ``resolve_dtype``).

    Args:
        model_dir: HF directory with config.json (weights optional: ``load_weights`` fills them).
        device: torch device string.
        threads: CPU threads (0 keeps torch's default).
        dtype: ``float32`` (default), ``bfloat16`` or ``auto`` (see ``resolve_dtype``).
        plane: the run's weight plane, for ``dtype="auto"``.
    """

    batch_resumes: bool = True
    """Feed all rows resumed in a round in one forward (``torch_rows.feed_batch``); False: one at a time."""
    refill: bool = True
    """Resume paused rows while other rows still decode, and decode them with those rows (``torch_episodes``);
    False: resume only when no row decodes (one tool request per round)."""
    refill_share: float = 0.0
    """With ``refill``, resume once the paused rows number ``refill_share`` x the decoding rows (at least one):
    0 resumes a row at the step it pauses (a tool request per such step, the batch never waits); 1 waits until
    as many rows wait as decode (fewer requests, a thinner batch meanwhile)."""
    decode_slots: int = 0
    """Continuous batching of episodes: at most this many rows decode (or wait for a tool) at once, the other
    episodes queue and take the slots of rows that end (``torch_episodes.RowQueue``); 0: every row at once."""

    def __init__(self, model_dir: str | Path, device: str = "auto", threads: int = 0, dtype: str = "float32",
                 plane: str = "bf16"):
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, plane)
        config = AutoConfig.from_pretrained(model_dir)
        has_weights = any(Path(model_dir).glob("*.safetensors"))
        if has_weights:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            # torch's CPU flash-attention kernel is ~5x slower in bf16 than in fp32 for one-token decode
            # steps; the eager path (bf16 matmuls, fp32 softmax) is faster than either.
            if hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation("eager")
            else:  # transformers < 4.56 reads the choice from the config at every forward
                model.config._attn_implementation = "eager"
        self._setup(model)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> TorchEngine:
        """Wrap an already loaded HF model (e.g. the trainer's policy, for evaluation).

        Args:
            model: an HF causal LM; its device and dtype are kept.
        """
        self = cls.__new__(cls)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._setup(model)
        return self

    def _setup(self, model: torch.nn.Module) -> None:
        self.model: Any = model.to(self.device, self.dtype).eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.x renamed past_key_values to cache.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def dtype_name(self) -> str:
        """The compute dtype as a short name (``float32``, ``bfloat16``)."""
        return str(self.dtype).removeprefix("torch.")

    def make_generator(self, seed: int | None) -> torch.Generator:
        """A torch RNG on the engine's device for ``generate``.

        Args:
            seed: the seed; None for a fresh random one.
        """
        g = torch.Generator(device=self.device)
        g.manual_seed(secrets.randbits(62) if seed is None else seed)
        return g

    def load_state(self, state: Mapping[str, np.ndarray], plane: str) -> None:
        """Load a published weight state (the plane's stored bits), widened to float32 first.

        Args:
            state: tensor name -> stored bits.
            plane: ``bf16`` or ``int8g64`` (the whole model), or ``adapter`` (the adapter tensors only, after
                :meth:`use_adapter`).

        Raises:
            ValueError: on an unknown plane or a missing, unexpected or misshaped tensor.
        """

        if plane == ADAPTER_PLANE:
            self.load_adapter(state_to_f32(state, plane))
        else:
            self.load_weights(state_to_f32(state, plane, compute=True))  # int8g64: MLX's quantized matmul values

    def use_adapter(self, rank: int, alpha: float, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Add LoRA adapters to the (loaded) base, the trainer's computation (``stoa.models.lora_torch``: the base
        output plus ``alpha / rank * B(A(x))``), zero until :meth:`load_state` loads an adapter version; the
        adapted linears' shapes, module path -> (out, in).

        Args:
            rank: the adapter's rank.
            alpha: LoRA alpha.
            targets: module-name suffixes to adapt.
        """
        from stoa.models.lora_torch import LoraSpec, adapted_linears, add_lora

        paths = add_lora(self.model, LoraSpec(rank, alpha, tuple(targets)), seed=0)
        self.model.to(self.device, self.dtype)
        self.adapter_names = sorted(f"{p}{s}" for p in paths for s in (".lora_A.weight", ".lora_B.weight"))
        return adapted_linears(self.model, paths)

    def load_adapter(self, named: Mapping[str, np.ndarray]) -> None:
        """Copy float32 adapter tensors into the adapters :meth:`use_adapter` added (never partially).

        Args:
            named: adapter parameter name -> float32 array.

        Raises:
            ValueError: no adapters were added, or the names or shapes are not theirs.
        """
        params = dict(self.model.named_parameters())
        want = getattr(self, "adapter_names", [])
        if not want or sorted(named) != want:
            raise ValueError(f"adapter tensors do not match the model's adapters ({len(named)} vs {len(want)})")
        bad = [k for k in want if tuple(named[k].shape) != tuple(params[k].shape)]
        if bad:
            raise ValueError(f"{bad[0]}: shape {named[bad[0]].shape} != model {tuple(params[bad[0]].shape)}")
        with torch.no_grad():
            for k in want:
                params[k].copy_(torch.from_numpy(np.ascontiguousarray(named[k])).to(params[k].device, params[k].dtype))

    def load_weights(self, named: Mapping[str, np.ndarray]) -> None:
        """Copy float32 arrays into the model's parameters and persistent buffers (``model_tensors``).

        Args:
            named: parameter name -> float32 array of the parameter's shape.

        Raises:
            ValueError: on a missing, unexpected or misshaped tensor (never loads partially).
        """
        params = model_tensors(self.model)
        missing = sorted(set(params) - set(named))
        extra = sorted(set(named) - set(params))
        if missing or extra:
            raise ValueError(f"weights do not match the model: missing={missing[:5]} unexpected={extra[:5]}")
        for name, p in params.items():
            if tuple(named[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {named[name].shape} != model {tuple(p.shape)}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy(np.ascontiguousarray(named[name])).to(p.device, p.dtype))

    def _prefill(self, prompts: Sequence[Sequence[int]], n: int) -> DecodeBatch:
        """Run the prompts (left-padded to one width) once, then repeat every row's KV ``n`` times.

        Args:
            prompts: token ids of each prompt.
            n: rows per prompt.
        """
        from transformers import DynamicCache

        k, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((k, width), dtype=torch.long)
        mask = torch.zeros((k, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every row's last token at the end
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache: Any = DynamicCache(config=self.model.config)  # the config: conv / linear-attention layer kinds
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        # share the prompt's state: one prefill per group, then n rows (reorder_cache: every layer kind has it)
        cache.reorder_cache(torch.arange(k, device=self.device).repeat_interleave(n))
        return DecodeBatch(active=list(range(k * n)), cache=cache, mask=mask.repeat_interleave(n, dim=0),
                           next_pos=pos[:, -1:].repeat_interleave(n, dim=0) + 1,
                           logits=out.logits[:, -1, :].float().repeat_interleave(n, dim=0))

    def _forward(self, batch: DecodeBatch, tok: torch.Tensor) -> None:
        """Feed each row's last token; the batch's logits become the next position's.

        Args:
            batch: the rows still decoding (their mask grows by one position).
            tok: [rows] the token each row just sampled.
        """
        batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=batch.mask, position_ids=batch.next_pos,
                         use_cache=True, **{self._cache_kw: batch.cache})
        batch.logits = out.logits[:, -1, :].float()
        batch.next_pos = batch.next_pos + 1

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> tuple[list[list[Completion]], GenStats]:
        """Sample ``n`` completions for each prompt; each prompt is prefilled once and its KV shared.

        Args:
            prompts: token ids of each prompt (one group per prompt).
            n: completions per prompt.
            max_new_tokens: length cap.
            temperature: sampling temperature.
            top_p: nucleus mass.
            eos_ids: tokens that end a completion (included in the completion).
            generator: torch RNG for reproducible sampling (see ``make_generator``).
            greedy: take the argmax instead of sampling (for evaluation); logprobs stay those of
                the temperature/top-p distribution.

        Returns:
            per prompt, its ``n`` completions; and timing figures.
        """
        if len(prompts) == 0 or min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        stats = GenStats()
        t0 = time.perf_counter()
        batch = self._prefill(prompts, n)
        stats.prefill_s = time.perf_counter() - t0
        log = RowLog(len(prompts) * n)
        eos = set(int(t) for t in eos_ids)
        t1 = time.perf_counter()
        for step in range(max_new_tokens):
            tok, tok_lp = sample_step(batch.logits, temperature, top_p, greedy, generator)
            stats.steps += 1
            keep = log.record(batch.active, tok.tolist(), tok_lp.tolist(), eos)
            stats.new_tokens += len(batch.active)
            if step == max_new_tokens - 1 or not keep:
                break
            if len(keep) < len(batch.active):
                tok = tok[batch.compact(keep)]
            self._forward(batch, tok)
        stats.decode_s = time.perf_counter() - t1
        return log.groups(n), stats

    @torch.inference_mode()
    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        driver: EpisodeDriver,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> tuple[list[list[Episode]], GenStats]:
        """Run ``n`` multi-turn episodes of each prompt in one batch; the driver holds the limits and tools.

        Each prompt is prefilled once and its KV shared by its ``n`` rows. Rows decode until they end or pause;
        the rows that paused at a step (``refill``, ``refill_share``; else once none decodes) have their tools
        run in one request (``driver.resume``), are fed their last sampled token and observation in one forward
        (``batch_resumes``; a hybrid's rows one at a time) and rejoin the decoding rows before the next step
        (``stoa.engines.torch_episodes``). With ``decode_slots`` below the rows, at most that many rows decode at
        once and queued episodes (prefilled when admitted) take the slots of rows that end.

        Args:
            prompts: token ids of each prompt (one group per prompt).
            n: episodes per prompt.
            driver: the episodes of the ``len(prompts) * n`` rows (row ``g * n + j``).
            temperature: sampling temperature.
            top_p: nucleus mass.
            generator: torch RNG for reproducible sampling (see ``make_generator``).
            greedy: take the argmax; logprobs stay those of the temperature/top-p distribution.

        Returns:
            per prompt, its ``n`` episodes; and timing figures (``extra``: the driver's stats, ``rounds`` (tool
            requests), ``refills`` (of them, made while rows still decoded), ``obs_prefill_s``; with a queue
            ``admitted`` (rows admitted after the first step) and ``admit_prefill_s``, within ``prefill_s``).

        Raises:
            ToolUnavailable: the tools could not answer (from ``driver.resume``).
        """
        if len(prompts) == 0 or min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        if driver.rows != len(prompts) * n:
            raise ValueError(f"driver: has {driver.rows} rows, the batch {len(prompts)} prompts x n={n}; "
                             "build one environment per row")
        stats = GenStats(extra={"rounds": 0.0, "obs_prefill_s": 0.0, "refills": 0.0})
        slots = self.decode_slots
        if slots < 0:
            raise ValueError(f"decode_slots: {slots}; use 0 (every row at once) or the most rows decoding at once")
        draw = partial(sample_step, temperature=temperature, top_p=top_p, greedy=greedy, generator=generator)
        if 0 < slots < driver.rows:
            stats.extra.update(admitted=0.0, admit_prefill_s=0.0)
            queue = RowQueue(self, prompts, n)
            run_episodes(self, queue, driver, draw, stats, self.refill, self.refill_share, slots)
        else:
            t0 = time.perf_counter()
            batch = self._prefill(prompts, n)
            stats.prefill_s = time.perf_counter() - t0
            run_episodes(self, batch, driver, draw, stats, self.refill, self.refill_share)
        stats.prefill_s += stats.extra["obs_prefill_s"]
        stats.extra.update(driver.stats)
        return driver.episodes(n), stats
