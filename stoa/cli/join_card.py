"""``stoa join-card``: print (and write) what a new worker needs to join a run; in a run with a run key each
written card carries a fresh worker key and is a secret (0600); credentials only on request, 0600."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stoa.bucket import ObjectNotFound
from stoa.bucket.credentials import resolve_env
from stoa.cli.worker_key import issue_keys
from stoa.contract import RunKeyError, RunNotFound
from stoa.join.card import CardError, JoinCard, card_text, card_toml, make_card, write_secrets
from stoa.join.cardkey import card_names, card_paths, with_key, write_card

EXIT_REFUSED = 2
"""Exit code of a refused card (``EXIT_CODES`` in stoa.cli: an invalid flag); the message names the fix."""
EXIT_RUN_KEY = 3
"""Exit code when this machine cannot issue the card's worker key (the run key's, a contract mismatch)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``join-card`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "join-card", help="write the card a new worker joins a run with (with its own worker key: a secret)",
        description="Read the run's contract and print everything a joining machine needs except secrets: the "
                    "bucket URL, run id, group size n, plane, task, the retriever (search tasks), the names of "
                    "the credential variables to set, and the join command. --out writes the card file that "
                    "'stoa join --card FILE' reads; in a run with a run key it issues the card a fresh worker key "
                    "(the joined worker signs its records with it), which makes the card a secret (0600, one "
                    "machine). --with-secrets writes this machine's credential values into a new 0600 env file "
                    "to hand over apart from the card.")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--retriever", default="", metavar="URL",
                   help="search tasks: a shared endpoint (stoa retriever serve) joiners should use [default: the "
                        "run's index, which workers download from the bucket]")
    p.add_argument("--out", default="", metavar="FILE", help="write the card file here [default: print it]")
    p.add_argument("--with-secrets", default="", metavar="FILE",
                   help="also write the credential values of this machine into FILE (created 0600; refused if it "
                        "exists) [default: no secrets anywhere]")
    p.add_argument("--name", default="", metavar="NAME",
                   help="the worker name of the card's key (1-40 letters, digits, '.', '_', '-'); with --count N, "
                        "NAME-1 ... NAME-N [default: card-<6 hex>]")
    p.add_argument("--count", type=int, default=1, metavar="N",
                   help="with --out FILE: write N cards, FILE's stem + -NAME each, every one with its own worker key "
                        "(one per machine) [default: 1]")
    p.add_argument("--no-worker-key", action="store_true",
                   help="a card without a worker key, for a private fleet whose trainer runs with worker_keys = off: "
                        "the joined worker's records go unsigned (logged)")
    p.add_argument("--run-key", default="", metavar="FILE",
                   help="the run's private key file, which vouches for the card's worker key [default: the "
                        "trainer's, $STOA_KEY_DIR or ~/.config/stoa/keys/<bucket digest>-<run>.ed25519]")
    p.set_defaults(func=run)


def _keyed_cards(card: JoinCard, args: argparse.Namespace) -> list[tuple[Path, JoinCard]]:
    """Issue a fresh worker key per card (identities in the bucket) and put each in its card."""
    names = card_names(args.name, args.count)
    paths = card_paths(args.out, names)
    taken = [str(p) for p in paths if p.exists()]
    if taken:  # before any key is issued: a refused card leaves no identity behind
        raise CardError(f"--out: {', '.join(taken[:3])} exists; remove it or name a new file (a card with a worker "
                        "key is never overwritten)")
    keys = issue_keys(args.bucket, args.run, names, args.run_key)
    return [(path, with_key(card, key)) for path, key in zip(paths, keys, strict=True)]


def run(args: argparse.Namespace) -> int:
    """Make the card(s), write the files asked for, print the card(s).

    Args:
        args: parsed arguments.
    """
    env = resolve_env()
    try:
        card = make_card(args.bucket, args.run, args.retriever, env)
        keyed = bool(card.run_key) and not args.no_worker_key and bool(args.out)
        if args.count != 1 and not keyed:
            raise CardError("--count: cards differ only by their worker keys; give --out FILE in a run with a run "
                            "key, or leave --count out")
        cards = _keyed_cards(card, args) if keyed else [(Path(args.out or f"join-{card.run}.toml"), card)]
        if args.with_secrets:  # after the keys: a refused key leaves no credentials file behind
            write_secrets(args.with_secrets, card.credentials, env)
        for path, one in cards:
            if args.out:
                write_card(path, card_toml(one), secret=bool(one.worker_key))
    except CardError as e:
        print(f"stoa join-card: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except RunKeyError as e:  # this machine cannot vouch for a worker key (exit 3)
        print(f"stoa join-card: {e}; or --no-worker-key for a card without one (a private fleet)", file=sys.stderr)
        return EXIT_RUN_KEY
    except ObjectNotFound as e:  # make_card reads only the contract: no such run (exit 12)
        raise RunNotFound(str(e)) from None
    for path, one in cards:
        print(card_text(one, str(path), args.with_secrets))
    if args.with_secrets:
        print(f"[join-card] wrote the credentials to {args.with_secrets} (mode 0600): hand it over out of band, "
              "never beside the card")
    _say_keys(card, cards, args)
    if not args.out:
        print(f"\n# save as {cards[0][0]}:\n{card_toml(card)}", end="")
    return 0


def _say_keys(card: JoinCard, cards: list[tuple[Path, JoinCard]], args: argparse.Namespace) -> None:
    """What became of the worker keys, and where the cards went."""
    if args.no_worker_key:
        print("[join-card] no worker key (--no-worker-key): the joined worker's records go unsigned; only a trainer "
              "with worker_keys = off (a private fleet whose every bucket writer is trusted) takes them")
    elif card.run_key and not args.out:
        print("[join-card] no worker key in a printed card (it would put a secret on the screen): --out FILE writes "
              "a card with its own worker key")
    for path, one in cards:
        if one.worker_key:
            print(f"[join-card] wrote {path} (mode 0600) with the private worker key of {one.worker!r}: the card is "
                  "a SECRET now; hand it to one machine out of band, like the env file, never mail or commit it")
        elif args.out:
            print(f"[join-card] wrote {path}")
