"""Moved to ``stoa.engines.torch``; kept for imports until the sweep."""

from stoa.engines.torch import (
    DTYPES,
    TorchEngine,
    cpu_has_native_bf16,
    resolve_device,
    resolve_dtype,
    sampling_logprobs_torch,
)

__all__ = ["DTYPES", "TorchEngine", "cpu_has_native_bf16", "resolve_device", "resolve_dtype",
           "sampling_logprobs_torch"]
