"""Single-process local mode: one 4-bit base + LoRA model object does group rollout and the training step."""

from stoa.config.local import LocalConfig, load_local_config, resolve_backend

__all__ = ["LocalConfig", "load_local_config", "resolve_backend"]
