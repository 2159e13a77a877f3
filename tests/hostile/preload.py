"""Imported once by the hostile suite's fork server, so that each forked client starts warm.

Nothing here runs torch code: a fork after torch's thread pools started could deadlock.
"""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401

import stoa.cli  # noqa: E402,F401
import stoa.evaluator  # noqa: E402,F401
import stoa.trainer.loop  # noqa: E402,F401
import stoa.worker.loop  # noqa: E402,F401
from stoa.cli import build_parser  # noqa: E402

build_parser()  # imports every command's module
