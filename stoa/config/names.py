"""One vocabulary: the names other tools use for our settings, and the environment variables' old names.

``FOREIGN_NAMES`` maps a TRL or verl setting name to ours; an unknown TOML key, ``--set`` key or flag that is
one of them gets "did you mean" ours (``loading.unknown_setting`` and ``stoa.cli.unrecognized`` read it).
``ENV_ALIASES`` maps a deprecated environment variable to the ``STOA_*`` one it stands for. Stdlib only.
"""

from __future__ import annotations

from typing import NamedTuple


class ForeignName(NamedTuple):
    """Our name for another tool's setting.

    Args:
        ours: the config field (or ``algo.KNOB``) with the closest meaning.
        tool: whose name it is: 'TRL', 'verl', or 'an older stoa' (a spelling this command never had).
        note: what differs, when the meaning is not the same ('' when it is).
    """

    ours: str
    tool: str = "TRL"
    note: str = ""


def _verl(ours: str, note: str = "") -> ForeignName:
    return ForeignName(ours, "verl", note)


def _old(ours: str, note: str = "") -> ForeignName:
    return ForeignName(ours, "an older stoa", note)


FOREIGN_NAMES: dict[str, ForeignName] = {
    # TRL (GRPOConfig / TrainingArguments)
    "learning_rate": ForeignName("lr"),
    "num_generations": ForeignName("n_samples"),
    "beta": ForeignName("kl_beta"),
    "max_completion_length": ForeignName("max_new_tokens"),
    "max_prompt_length": ForeignName("max_prompt_tokens"),
    "save_steps": ForeignName("checkpoint_every"),
    "max_steps": ForeignName("steps"),
    "model_name_or_path": ForeignName("model"),
    "max_grad_norm": ForeignName("grad_clip"),
    "per_device_train_batch_size": ForeignName("micro_batch", note="sequences per forward/backward"),
    "gradient_accumulation_steps": ForeignName(
        "groups_per_step", note="prompt groups per optimizer step; micro_batch sets the accumulation"),
    "num_iterations": ForeignName("reuse_cap", note="optimizer steps that may use one record"),
    "loss_type": ForeignName("algorithm", note="grpo, dr_grpo, dapo, ... each with its loss"),
    "epsilon": ForeignName("algo.eps_low", note="an [algo] knob"),
    "epsilon_high": ForeignName("algo.eps_high", note="an [algo] knob"),
    "bf16": ForeignName("dtype", note="dtype = 'bfloat16'"),
    "eval_steps": ForeignName("eval_every"),
    # verl (the last component of its dotted keys)
    "train_batch_size": _verl("groups_per_step", "prompts per optimizer step"),
    "rollout_n": _verl("n_samples"),
    "max_response_length": _verl("max_new_tokens"),
    "kl_loss_coef": _verl("kl_beta"),
    "total_training_steps": _verl("steps"),
    "save_freq": _verl("checkpoint_every"),
    "test_freq": _verl("eval_every"),
    "adv_estimator": _verl("algorithm"),
    "ppo_micro_batch_size_per_gpu": _verl("micro_batch", "sequences per forward/backward"),
    # spellings of stoa's benches and local mode before one vocabulary (fields of no config now)
    "group_size": _old("n_samples"),
    "samples": _old("n_samples"),
    "num_samples": _old("n_samples"),
    "max_tokens": _old("max_new_tokens"),
    "new_tokens": _old("max_new_tokens"),
    "tokens": _old("max_new_tokens"),
    "prompts_per_step": _old("groups_per_step"),
    "save_every": _old("checkpoint_every"),
}
"""Another tool's name (TRL, verl; dashes read as underscores) -> ours, for did-you-mean hints."""

ENV_ALIASES: dict[str, str] = {"DRL_RUN": "STOA_RUN", "DRL_N_SAMPLES": "STOA_N_SAMPLES",
                               "DRL_PULSE_PLANE": "STOA_PLANE", "MODEL": "STOA_MODEL"}
"""Deprecated environment variable -> its ``STOA_*`` name; the old one still works and warns once."""


def foreign_hint(key: str, known: set[str] | None = None, *, flag: bool = False) -> str:
    """"; did you mean 'lr'? (learning_rate is another tool's name)" for a TRL/verl name, else ''.

    Args:
        key: the name as written (dashes and a leading ``--`` allowed).
        known: the names that may be suggested (a command's fields); None allows any.
        flag: name ours as a flag (``--lr``, ``--algo eps_low=X``) rather than a setting.
    """
    name = key.lstrip("-").replace("-", "_")
    found = FOREIGN_NAMES.get(name)
    if found is None or (known is not None and found.ours.split(".")[0] not in known):
        return ""
    ours = found.ours
    if flag:
        field, _, knob = ours.partition(".")
        ours = f"--{field} {knob}=..." if knob else "--" + ours.replace("_", "-")
    else:
        ours = f"'{ours}'"
    note = f"; {found.note}" if found.note else ""
    whose = "an older stoa name" if found.tool == "an older stoa" else f"{found.tool}'s name"
    return f"; did you mean {ours}? ({key} is {whose}{note})"
