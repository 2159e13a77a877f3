"""Joining a run from another machine: the join card (``card``), the checks before a worker starts (``checks``),
the flow of ``stoa join`` (``launch``) and the launchd/systemd supervisor (``service``). No torch or mlx here."""

from __future__ import annotations

from stoa.join.card import CardError, JoinCard, card_text, card_toml, make_card, read_card, write_secrets
from stoa.join.launch import JoinOptions, join

__all__ = ["CardError", "JoinCard", "JoinOptions", "card_text", "card_toml", "join", "make_card", "read_card",
           "write_secrets"]
