"""``stoa local``: the single-process local mode (implemented in ``stoa.local.cli``)."""

from stoa.local.cli import register  # noqa: F401
