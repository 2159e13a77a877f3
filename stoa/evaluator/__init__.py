"""The follow-along evaluator (``stoa eval``): a bucket client that evaluates each published version once.

``run_evaluator`` is the loop (:mod:`stoa.evaluator.loop`); its heartbeat (``runs/<run>/evaluator.json``,
written and read by :mod:`stoa.lifecycle`) tells a trainer that one is running. No torch or mlx at import.
"""

from stoa.evaluator.loop import EvalConfig, EvalSummary, RunNotFound, evaluated_versions, run_evaluator

__all__ = ["EvalConfig", "EvalSummary", "RunNotFound", "evaluated_versions", "run_evaluator"]
