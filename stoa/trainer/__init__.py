"""The trainer: consume rollout records, take GRPO-family steps, publish weights. Never imports mlx."""
