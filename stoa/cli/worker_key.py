"""``stoa worker-key issue|list|revoke``: the run's worker keys (logic in ``stoa.identity``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stoa.bucket import Bucket, ObjectNotFound, open_bucket
from stoa.contract import RunContract, RunKeyError, RunNotFound
from stoa.identity import IdentityBook, WorkerKey, check_name, issue_key, revoke_keys, write_worker_key
from stoa.layout import contract_key
from stoa.weights.signing import RunSigner, key_path, load_key

EXIT_REFUSED = 2
"""Exit code of a refused request (a bad name, a key file that exists, nothing to revoke)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``worker-key`` command and its ``issue``, ``list`` and ``revoke`` subcommands.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "worker-key", help="issue, list or revoke the run's worker keys (records signed per worker)",
        description="Worker keys: the run key (the trainer's private key file, never in the bucket) signs each "
                    "worker's identity; the worker signs every record with its own key, and a trainer with "
                    "worker_keys on refuses unsigned, forged and revoked records by name (docs/fleet.md).")
    cmds = p.add_subparsers(dest="worker_key_command", metavar="{issue,list,revoke}", required=True)
    for name, func, text in (("issue", run_issue, "make a worker's key pair; its identity goes in the bucket, "
                                                  "its private key in a new 0600 file"),
                             ("list", run_list, "show every worker key of the run and whether it is in force"),
                             ("revoke", run_revoke, "revoke every key of a worker (from the trainer's next "
                                                    "intake on)")):
        c = cmds.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        if name != "list":
            c.add_argument("name", metavar="NAME", help="the worker's name (1-40 letters, digits, '.', '_', '-')")
        c.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
        c.add_argument("--run", required=True, help="run id")
        if name != "list":
            c.add_argument("--run-key", default="", metavar="FILE",
                           help="the run's private key file [default: the trainer's, $STOA_KEY_DIR or "
                                "~/.config/stoa/keys/<bucket digest>-<run>.ed25519]")
        if name == "issue":
            c.add_argument("--out", default="", metavar="FILE",
                           help="write the worker's key here (created 0600; refused if it exists) [default: "
                                "worker-<run>-<NAME>.key]")
        if name == "list":
            c.add_argument("--json", action="store_true", help="one JSON object per key instead of the table")
        c.set_defaults(func=func)


@dataclass(frozen=True)
class _Run:
    bucket: Bucket
    contract: RunContract


def _open(args: argparse.Namespace) -> _Run:
    """The run's bucket and contract; the contract must carry a run key."""
    bucket = open_bucket(args.bucket, create=False)
    try:
        contract = RunContract.from_json(bucket.get(contract_key(args.run)), contract_key(args.run))
    except ObjectNotFound:
        raise RunNotFound(f"run {args.run!r} has no contract in {args.bucket}; start the trainer first or check "
                          "--run/--bucket") from None
    if not contract.run_key:
        raise RunKeyError(f"run {args.run!r} has no run key to vouch for workers; worker keys need a run created "
                          "with sign_weights = true (or an s3:// / r2:// bucket)")
    return _Run(bucket, contract)


def _signer(args: argparse.Namespace, run: _Run) -> RunSigner:
    """The run's private key, checked against the contract's public half."""
    path = key_path(args.bucket, args.run, args.run_key)
    if not path.is_file():
        raise RunKeyError(f"the run's private key {path} is missing; run this where the trainer keeps it, or give "
                          "--run-key FILE")
    signer = load_key(path)
    if signer.public_hex != run.contract.run_key:
        raise RunKeyError(f"{path} holds key {signer.public_hex[:16]}..., run {args.run!r} is signed by "
                          f"{run.contract.run_key[:16]}...; give the run's key file with --run-key")
    return signer


class IssueRefused(ValueError):
    """A key that cannot be issued as asked (a bad name, a key file that exists); the message names the fix."""


def issue_to_file(bucket_url: str, run_id: str, name: str, run_key: str = "", out: str = "") -> tuple[str, Path]:
    """Issue a key for ``name`` (its identity in the bucket) and write its private half to a new 0600 file.

    Args:
        bucket_url: the run's bucket.
        run_id: the run.
        name: the worker's name.
        run_key: the run's private key file ("" for the trainer's default path).
        out: the key file to create ("" for ``worker-<run>-<name>.key``).

    Returns:
        The worker's public key (hex) and the key file.

    Raises:
        IssueRefused: a bad name or an existing key file.
        RunKeyError: the run has no run key, or this machine has not the run's private key.
    """
    try:
        check_name(name)
    except ValueError as e:
        raise IssueRefused(str(e)) from None
    path = Path(out or f"worker-{run_id}-{name}.key")
    if path.exists():
        raise IssueRefused(f"{path} exists; remove it or name a new key file")
    args = argparse.Namespace(bucket=bucket_url, run=run_id, run_key=run_key)
    run = _open(args)
    key, _ = issue_key(run.bucket, run_id, name, _signer(args, run))
    write_worker_key(path, key)
    return key.public_hex, path


def issue_keys(bucket_url: str, run_id: str, names: list[str], run_key: str = "") -> list[WorkerKey]:
    """Issue a key for each of ``names`` (their identities in the bucket); the keys, private halves included.

    Args:
        bucket_url: the run's bucket.
        run_id: the run.
        names: the workers' names (checked).
        run_key: the run's private key file ("" for the trainer's default path).

    Raises:
        RunKeyError: the run has no run key, or this machine has not the run's private key.
    """
    args = argparse.Namespace(bucket=bucket_url, run=run_id, run_key=run_key)
    run = _open(args)
    signer = _signer(args, run)
    return [issue_key(run.bucket, run_id, name, signer)[0] for name in names]


def run_issue(args: argparse.Namespace) -> int:
    """Issue a key for NAME: its identity in the bucket, its private key in a new 0600 file."""
    try:
        public, out = issue_to_file(args.bucket, args.run, args.name, args.run_key, args.out)
    except IssueRefused as e:
        print(f"stoa worker-key issue: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"[worker-key] issued {args.name!r} in run {args.run!r}: public key {public}")
    print(f"[worker-key] wrote its private key to {out} (mode 0600): hand it to that worker out of band; it "
          f"joins with  stoa join --card CARD --worker-key {out.name}  (or stoa worker ... --worker-key "
          f"{out.name})")
    return 0


def _book(run: _Run, run_id: str) -> IdentityBook:
    book = IdentityBook(run.bucket, run_id, run.contract.run_key)
    book.refresh()
    return book


def run_list(args: argparse.Namespace) -> int:
    """Print every worker key of the run: name, public key, issued, status."""
    book = _book(_open(args), args.run)
    rows = [{"name": st.worker, "public_key": pub, "issued_at": st.at,
             "status": "revoked" if pub in book.revoked else "valid"} for pub, st in book.keys.items()]
    rows += [{"name": book.names.get(pub, "?"), "public_key": pub, "issued_at": None, "status": f"refused: {e.reason}"}
             for pub, e in book.refused.items() if pub not in book.keys]
    rows.sort(key=lambda r: (r["name"], r["issued_at"] or 0))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print(f"run {args.run!r} has no worker keys; issue one with stoa worker-key issue NAME")
        return 0
    print(f"{'name':<24} {'public key':<18} {'issued (UTC)':<20} status")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["issued_at"])) if r["issued_at"] else "?"
        print(f"{r['name']:<24} {r['public_key'][:16] + '..':<18} {when:<20} {r['status']}")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    """Revoke every valid key of NAME; the trainer refuses its records from its next intake on."""
    run = _open(args)
    signer = _signer(args, run)
    done = revoke_keys(run.bucket, _book(run, args.run), args.name, signer)
    if not done:
        print(f"stoa worker-key revoke: run {args.run!r} has no key of {args.name!r} in force (stoa worker-key "
              "list shows them)", file=sys.stderr)
        return EXIT_REFUSED
    for pub in done:
        print(f"[worker-key] revoked {args.name!r} key {pub[:16]}...: its records are refused from the trainer's "
              "next intake on")
    return 0
