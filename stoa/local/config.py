"""Moved to ``stoa.config.local`` (one configuration package); kept for imports until the sweep."""

from stoa.config.local import (  # noqa: F401
    BACKENDS,
    DENSE_TARGETS,
    DTYPES,
    IDENTITY_FIELDS,
    OLD_LOGPROBS,
    OLD_NAMES,
    QUANT_BITS,
    QUANT_GROUP_SIZES,
    TORCH_BASE,
    LocalConfig,
    is_apple_silicon,
    load_local_config,
    lora_target_names,
    resolve_backend,
)
