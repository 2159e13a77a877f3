"""Moved to ``stoa.engines.base``; kept for imports until the sweep."""

from stoa.engines.base import Completion, GenStats

__all__ = ["Completion", "GenStats"]
