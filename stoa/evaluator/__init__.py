"""The follow-along evaluator (``stoa eval``): a bucket client that evaluates each published version once.

``run_evaluator`` is the loop (:mod:`stoa.evaluator.follow`); ``evaluator_present`` tells a trainer whether one
is running (its heartbeat ``runs/<run>/evaluator.json``, :mod:`stoa.evaluator.heartbeat`). No torch or mlx at
import.
"""

from stoa.evaluator.follow import EvalConfig, EvalSummary, RunNotFound, evaluated_versions, run_evaluator
from stoa.evaluator.heartbeat import evaluator_present, read_heartbeat, write_heartbeat

__all__ = ["EvalConfig", "EvalSummary", "RunNotFound", "evaluated_versions", "evaluator_present",
           "read_heartbeat", "run_evaluator", "write_heartbeat"]
