"""`stoa bench pulse`: PULSE patch size, encode/apply speed and bit-exactness over real AdamW RL steps."""

from .cli import DEFAULT_LRS, INITS, add_arguments, main, parse_lrs
from .report import format_table, notes, report_lines
from .sampler import PROMPTS, Sampler
from .stats import (
    bf16_flip_model,
    count_changed,
    magnitude_quantiles,
    states_identical,
    tensor_kind,
    timed,
    timed_cpu,
)
from .sweep import ANCHOR_EVERY, BEHIND, bench_lr

__all__ = [
    "ANCHOR_EVERY",
    "BEHIND",
    "DEFAULT_LRS",
    "INITS",
    "PROMPTS",
    "Sampler",
    "add_arguments",
    "bench_lr",
    "bf16_flip_model",
    "count_changed",
    "format_table",
    "magnitude_quantiles",
    "main",
    "notes",
    "parse_lrs",
    "report_lines",
    "states_identical",
    "tensor_kind",
    "timed",
    "timed_cpu",
]
