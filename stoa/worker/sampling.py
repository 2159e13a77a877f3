"""Moved to ``stoa.engines.sampling``; kept for imports until the sweep."""

from stoa.engines.sampling import sampling_logprobs_np

__all__ = ["sampling_logprobs_np"]
