"""A TRL-shaped reward function: 1.0 when the completion's last number equals the answer column, else 0.0."""

import re


def correct(completions, answer, **kwargs):
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        numbers = re.findall(r"-?\d+", text)
        rewards.append(1.0 if numbers and numbers[-1] == str(truth) else 0.0)
    return rewards
