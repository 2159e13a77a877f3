# pyright: reportMissingImports=false, reportAttributeAccessIssue=false
"""Times TRL's own ``GRPOTrainer`` steps (generation apart from the rest) on a shape given as JSON.

Not imported by stoa: ``stoa bench trl`` (``trl_compare.py``) runs this file with the python of TRL's own venv
and reads the ``RESULT {json}`` line it prints. Usage::

    $STOA_CACHE/venvs/trl-<hash>/bin/python benchmarks/trl_driver.py '{"model_dir": ..., "prompts": 8, ...}'

How a step is split: a ``TrainerCallback`` times each optimizer step from ``on_step_begin`` to ``on_step_end``
(generation of the whole batch, rewards, the reference forward, the micro-batches' forward/backward, clipping and the
AdamW update); a ``GRPOTrainer`` subclass times ``_generate`` (prompt tokenization, ``model.generate`` and decoding).
``train_s = step_s - gen_s`` is TRL's step without generation: reference forward, loss, backward and update.
TRL's own ``profiling/Time taken`` timers (``transformers.generate``, ``GRPOTrainer._prepare_inputs``) are kept too.

With ``lora_rank`` > 0 the trainer gets ``peft_config=peft.LoraConfig(**lora_kwargs(spec))``: the rank, alpha and
target modules our side adapts, no dropout, no bias. TRL then wraps the model with ``get_peft_model`` (only the
adapters train) and, with beta > 0, holds no reference model: its reference logprobs are the policy's with the
adapters disabled (``use_adapter(model, None)`` -> ``model.disable_adapter()``), as our ``BaseView``.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from typing import Any

FILLER = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the valley and the "
          "river runs past old mills, quiet bridges and green fields under a pale morning sky near the town. ")


def make_prompts(tokenizer: Any, count: int, length: int) -> list[str]:
    """``count`` distinct plain-text prompts of about ``length`` tokens (windows of a filler text)."""
    ids = tokenizer(FILLER * (2 + length // 20), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[i:i + length]) for i in range(count)]


def length_reward(completions: list[str], **_kwargs: Any) -> list[float]:
    """A cheap reward: the completion's length in characters / 100."""
    return [len(c) / 100.0 for c in completions]


def lora_kwargs(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The ``peft.LoraConfig`` keywords of the spec's adapter (None: full fine-tune): our side's rank, alpha and
    targets, no dropout, no bias, a causal LM."""
    if not spec.get("lora_rank"):
        return None
    alpha = spec["lora_alpha"]
    return {"r": spec["lora_rank"], "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "target_modules": list(spec["lora_targets"]), "lora_dropout": 0.0, "bias": "none",
            "task_type": "CAUSAL_LM"}


def build_trainer(spec: dict[str, Any], out_dir: str, timings: dict[str, list[float]]) -> Any:
    """TRL's GRPOTrainer on the spec's shape: full fine-tune or the spec's LoRA (``lora_kwargs``), fp32 masters on the
    CPU (``trl_bf16``: bf16=True, autocast on them), micro-batches accumulated into one
    optimizer step per ``prompts x generations`` batch, completions forced to ``tokens`` tokens."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = spec["prompts"] * spec["generations"]
    micro = min(spec["micro_batch"], rows)
    if rows % micro:
        raise ValueError(f"micro_batch {micro} must divide prompts x generations {rows}")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"
    steps = spec["warmup"] + spec["steps"]
    dataset = Dataset.from_dict({"prompt": make_prompts(tokenizer, spec["prompts"] * steps, spec["prompt_tokens"])})
    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=bool(spec["trl_bf16"]), fp16=False, gradient_checkpointing=False,
        seed=spec["seed"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
        steps_per_generation=rows // micro, num_generations=spec["generations"],
        max_completion_length=spec["tokens"], generation_kwargs={"min_new_tokens": spec["tokens"]},
        temperature=1.0, top_p=1.0, beta=spec["beta"], loss_type="grpo", learning_rate=spec["lr"],
        max_grad_norm=1.0, optim="adamw_torch", max_steps=steps, logging_steps=1, report_to="none",
        save_strategy="no", shuffle_dataset=False, dataloader_num_workers=0, disable_dropout=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    lora = lora_kwargs(spec)
    peft_config = None
    if lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(**lora)

    class Timed(GRPOTrainer):
        def _generate(self, prompts: list) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            out = super()._generate(prompts)
            timings["gen_s"].append(time.perf_counter() - t0)
            timings["gen_cpu_s"].append(time.process_time() - c0)
            timings["gen_tokens"].append(float(sum(len(c) for c in out[1])))
            timings["prompt_tokens"].append(float(max(len(p) for p in out[0])))
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timings["_t0"] = [time.perf_counter(), time.process_time()]

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timings["step_s"].append(time.perf_counter() - timings["_t0"][0])
            timings["step_cpu_s"].append(time.process_time() - timings["_t0"][1])

    return Timed(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset,
                 processing_class=tokenizer, callbacks=[StepTimer()], peft_config=peft_config)


def record_trl_profiling(timings: dict[str, list[float]]) -> None:
    """Keep TRL's own ``profiling_context`` durations (it only sends them to wandb/mlflow/trackio)."""
    from trl.extras import profiling

    def log(self: Any, duration: float) -> None:
        timings.setdefault(f"trl:{self.name}", []).append(duration)

    profiling.ProfilingContext._log_metrics = log


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; return per-step rows, the versions and the peak RSS."""
    import torch
    import transformers
    import trl

    torch.set_num_threads(spec["threads"])
    timings: dict[str, list[float]] = {"gen_s": [], "gen_tokens": [], "prompt_tokens": [], "step_s": [],
                                       "gen_cpu_s": [], "step_cpu_s": []}
    record_trl_profiling(timings)
    with tempfile.TemporaryDirectory(prefix="stoa-bench-trl-") as out:
        trainer = build_trainer(spec, out, timings)
        trainer.train()
        trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    rows = [{"step_s": s, "gen_s": g, "train_s": s - g, "tokens": t, "prompt_tokens": p, "train_cpu_s": sc - gc}
            for s, g, t, p, sc, gc in zip(timings["step_s"], timings["gen_s"], timings["gen_tokens"],
                                          timings["prompt_tokens"], timings["step_cpu_s"], timings["gen_cpu_s"],
                                          strict=True)]
    return {"rows": rows, "threads": torch.get_num_threads(), "trained_params": trained,
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "trl_profiling": {k[4:]: v for k, v in timings.items() if k.startswith("trl:")},
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
