"""Moved to ``stoa.algorithms.batch`` (one batch type for the trainer and local mode); kept for imports until
the sweep.

``build_batch`` here is the old local name of ``stoa.algorithms.batch.filter_and_build`` (the algorithm's
group filter, then the batch); ``stoa.algorithms.batch.build_batch`` builds from groups already filtered.
"""

from stoa.algorithms.batch import Batch, Packed, Trajectory, group_rows, micro_batches, pack
from stoa.algorithms.batch import filter_and_build as build_batch

__all__ = ["Batch", "Packed", "Trajectory", "build_batch", "group_rows", "micro_batches", "pack"]
