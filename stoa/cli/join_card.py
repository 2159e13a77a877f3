"""``stoa join-card``: print (and write) what a new worker needs to join a run; secrets only on request, 0600."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from stoa.bucket import ObjectNotFound
from stoa.bucket.credentials import resolve_env
from stoa.cli.worker_key import IssueRefused, issue_to_file
from stoa.contract import RunNotFound
from stoa.join.card import CardError, card_text, card_toml, make_card, write_secrets

EXIT_REFUSED = 2
"""Exit code of a refused card (``EXIT_CODES`` in stoa.cli: an invalid flag); the message names the fix."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``join-card`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "join-card", help="print the card a new worker joins a run with (no secrets)",
        description="Read the run's contract and print everything a joining machine needs except secrets: the "
                    "bucket URL, run id, group size n, plane, task, the retriever (search tasks), the names of "
                    "the credential variables to set, and the join command. --out writes the card file that "
                    "'stoa join --card FILE' reads; --with-secrets writes this machine's credential values into "
                    "a new 0600 env file to hand over apart from the card.")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--retriever", default="", metavar="URL",
                   help="search tasks: a shared endpoint (stoa retriever serve) joiners should use [default: the "
                        "run's index, which workers download from the bucket]")
    p.add_argument("--out", default="", metavar="FILE", help="write the card file here [default: print it]")
    p.add_argument("--with-secrets", default="", metavar="FILE",
                   help="also write the credential values of this machine into FILE (created 0600; refused if it "
                        "exists) [default: no secrets anywhere]")
    p.add_argument("--worker-key", default="", metavar="NAME",
                   help="also issue a worker key for NAME (stoa worker-key issue): the card names the worker, the "
                        "private key goes to a new 0600 file to hand over apart from the card")
    p.add_argument("--worker-key-out", default="", metavar="FILE",
                   help="with --worker-key: the key file [default: worker-<run>-<NAME>.key]")
    p.add_argument("--run-key", default="", metavar="FILE",
                   help="with --worker-key: the run's private key file [default: the trainer's default path]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Make the card, write the files asked for, print the card.

    Args:
        args: parsed arguments.
    """


    env = resolve_env()
    try:
        card = make_card(args.bucket, args.run, args.retriever, env)
        if args.with_secrets:
            write_secrets(args.with_secrets, card.credentials, env)
        if args.worker_key:
            _, key_file = issue_to_file(args.bucket, args.run, args.worker_key, args.run_key, args.worker_key_out)
            card = replace(card, worker=args.worker_key)
            print(f"[join-card] issued a worker key for {args.worker_key!r}: wrote {key_file} (mode 0600); hand it "
                  "over out of band, never beside the card")
    except (CardError, IssueRefused) as e:
        print(f"stoa join-card: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except ObjectNotFound as e:  # make_card reads only the contract: no such run (exit 12)
        raise RunNotFound(str(e)) from None
    card_file = args.out or f"join-{card.run}.toml"
    if args.out:
        Path(args.out).write_text(card_toml(card), encoding="utf-8")
    print(card_text(card, card_file, args.with_secrets))
    if args.with_secrets:
        print(f"[join-card] wrote the credentials to {args.with_secrets} (mode 0600): hand it over out of band, "
              "never beside the card")
    if args.out:
        print(f"[join-card] wrote {args.out}")
    else:
        print(f"\n# save as {card_file}:\n{card_toml(card)}", end="")
    return 0
