"""A join card's worker key: ``stoa join-card`` issues a fresh key per card and writes such a card 0600 (it is a
secret then); ``stoa join`` installs the key in a 0600 file that the worker reads and signs its records with."""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from pathlib import Path

from stoa.contract import RunKeyError
from stoa.identity import WorkerKey, check_name, load_worker_key, worker_key_from_hex, write_worker_key
from stoa.join.card import CardError, JoinCard
from stoa.weights.signing import default_key_dir

MAX_CARDS = 256
"""Most cards one ``stoa join-card --count`` writes."""


def card_names(name: str, count: int) -> list[str]:
    """The worker names of ``count`` cards: ``name`` (or ``card-<6 hex>``), numbered ``-1..-N`` when N > 1.

    Raises:
        CardError: a count out of range, or a name a worker cannot have.
    """
    if not 1 <= count <= MAX_CARDS:
        raise CardError(f"--count {count}: write 1 to {MAX_CARDS} cards at a time")
    base = name or f"card-{secrets.token_hex(3)}"
    names = [base] if count == 1 else [f"{base}-{i}" for i in range(1, count + 1)]
    try:
        return [check_name(n) for n in names]
    except ValueError as e:
        raise CardError(f"--name: {e}") from None


def card_paths(out: str, names: list[str]) -> list[Path]:
    """Where the cards go: ``out`` for one card, ``<out's stem>-<name><suffix>`` for each of several."""
    path = Path(out)
    if len(names) == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{n}{path.suffix or '.toml'}") for n in names]


def with_key(card: JoinCard, key: WorkerKey) -> JoinCard:
    """``card`` carrying ``key`` (its name and private half)."""
    return replace(card, worker=key.worker, worker_key=key.private_hex)


def write_card(path: str | os.PathLike[str], text: str, secret: bool) -> None:
    """Write a card file: one that holds a worker key is created 0600 and never overwritten.

    Raises:
        CardError: a secret card whose file exists.
    """
    if not secret:
        Path(path).write_text(text, encoding="utf-8")
        return
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CardError(f"--out {path}: the file exists; remove it or name a new file (a card with a worker key "
                        "is never overwritten)") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def installed_key_path(card: JoinCard) -> Path:
    """Where ``stoa join`` keeps a card's worker key: ``$STOA_KEY_DIR`` (or ``~/.config/stoa/keys``)
    ``/worker-<run>-<name>.key``."""
    return default_key_dir() / f"worker-{card.run}-{card.worker}.key"


def install_card_key(card: JoinCard, dry_run: bool = False) -> str:
    """Write the card's worker key to :func:`installed_key_path` (0600; kept if it holds the same key); its path.

    Args:
        card: a card with a ``worker_key``.
        dry_run: only say where it would go.

    Raises:
        CardError: the key is malformed, or the file holds another key (an older card for the same name).
    """
    path = installed_key_path(card)
    try:
        key = worker_key_from_hex(card.run, card.worker, card.worker_key)
    except ValueError as e:
        raise CardError(f"the card's worker key: {e}; ask the operator for a new card (stoa join-card)") from None
    if dry_run:
        return str(path)
    if path.exists():
        try:
            same = load_worker_key(path, card.run, card.worker).public_hex == key.public_hex
        except RunKeyError:
            same = False
        if not same:
            raise CardError(f"{path} holds another key of {card.worker!r} (an older card?); remove it, then join "
                            "again")
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_worker_key(path, key)
    return str(path)
