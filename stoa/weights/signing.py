"""The run's key: Ed25519 signatures over the contract (``run.json``) and every weights pointer.

The trainer holds the private key in a file outside the bucket (mode 0600, created with the run); the
public half is the contract's ``run_key``. Workers, the evaluator and ``stoa export`` verify each pointer
against it before following it; since the pointer's state hash chains to the anchors and patches, that
covers the weight objects too. The contract's own signature only proves it is self-consistent, so a client
pins the key: from a join card or ``--run-key-pub``, else on first use (:func:`trusted_run_key`).

The cryptography is the ``cryptography`` package's Ed25519 (imported when a key is used).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from stoa.bucket import Bucket, ObjectNotFound
from stoa.contract import RunContract, RunKeyError, digest_hex
from stoa.layout import contract_key
from stoa.weights.ed25519 import NO_CRYPTOGRAPHY, PUBLIC_HEX, ed25519, is_hex, signature_problem
from stoa.weights.errors import SyncError


def _ed25519() -> Any:
    ed = ed25519()
    if ed is None:  # pragma: no cover - an install without the trainer or worker extra
        raise RunKeyError(NO_CRYPTOGRAPHY)
    return ed


def check_public_key(value: str, what: str = "run key") -> str:
    """``value`` if it is an Ed25519 public key as 64 lowercase hex digits, else :class:`RunKeyError`.

    Args:
        value: the key text.
        what: where it came from, for the message.
    """
    if not is_hex(value, PUBLIC_HEX):
        raise RunKeyError(f"{what} is not an Ed25519 public key ({PUBLIC_HEX} lowercase hex digits)")
    return value


def verify_signature(public_hex: str, signature: str, data: bytes, what: str) -> None:
    """Raise ``SyncError`` (``unsigned``/``malformed_signature``/``bad_signature``) unless the signature holds.

    Args:
        public_hex: the trusted public key.
        signature: the stored signature (hex), "" when absent.
        data: the signed bytes.
        what: the object, for the message (``current.json``).

    Raises:
        RunKeyError: (exit 3) this install cannot check signatures (no ``cryptography``).
    """
    problem = signature_problem(public_hex, signature, data)
    if problem is not None and problem[0] == "no_cryptography":  # pragma: no cover - install without it
        raise RunKeyError(problem[1])
    if problem is not None:
        raise SyncError(problem[0], f"{what}: {problem[1]}")


class RunSigner:
    """The trainer's private run key.

    Args:
        private: the ``Ed25519PrivateKey``.
        path: the file it lives in.
    """

    def __init__(self, private: Any, path: Path) -> None:
        from cryptography.hazmat.primitives import serialization

        self._private = private
        self.path = path
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_hex: str = raw.hex()
        """The public half, as the contract carries it."""

    def sign(self, data: bytes) -> str:
        """The signature of ``data`` as 128 hex digits.

        Args:
            data: the bytes to sign (a pointer's or contract's ``signed_bytes()``).
        """
        return self._private.sign(data).hex()

    def sign_contract(self, contract: RunContract) -> RunContract:
        """``contract`` carrying this key's public half and its signature.

        Args:
            contract: the contract the trainer built.
        """
        keyed = replace(contract, run_key=self.public_hex, signature="")
        return replace(keyed, signature=self.sign(keyed.signed_bytes()))


def default_key_dir() -> Path:
    """``$STOA_KEY_DIR`` if set, else ``~/.config/stoa/keys``: never inside a bucket."""
    env = os.environ.get("STOA_KEY_DIR")
    return Path(env).expanduser() if env else Path.home() / ".config" / "stoa" / "keys"


def key_path(bucket_url: str, run_id: str, explicit: str = "") -> Path:
    """Where a run's private key lives: ``explicit``, else ``<key dir>/<bucket digest>-<run>.ed25519``.

    Args:
        bucket_url: the run's bucket.
        run_id: the run.
        explicit: the trainer's ``run_key`` setting ("" for the default).
    """
    if explicit:
        return Path(explicit).expanduser()
    return default_key_dir() / f"{digest_hex(bucket_url.encode())[:12]}-{run_id}.ed25519"


def load_key(path: Path) -> RunSigner:
    """Read a private key file (PEM, PKCS#8, unencrypted).

    Args:
        path: the key file.

    Raises:
        RunKeyError: the file is not an Ed25519 private key.
    """
    from cryptography.hazmat.primitives import serialization

    ed = _ed25519()
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as e:
        raise RunKeyError(f"{path} is not a readable Ed25519 private key ({type(e).__name__}); restore the "
                          "run's key file there") from None
    if not isinstance(key, ed.Ed25519PrivateKey):
        raise RunKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return RunSigner(key, path)


def create_key(path: Path) -> RunSigner:
    """Make a new key pair and write the private half to ``path`` (created, mode 0600; never overwritten).

    Args:
        path: the key file to create.
    """
    from cryptography.hazmat.primitives import serialization

    key = _ed25519().Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return RunSigner(key, path)


def signing_wanted(setting: str, bucket_url: str) -> bool:
    """Whether a new run signs its weights: ``true``/``false``, or ``auto`` = yes for an object store
    (``s3://``, ``r2://``), no for a local directory (whoever can write it can also read a key beside it).

    Args:
        setting: the trainer's ``sign_weights`` (auto, true, false).
        bucket_url: the run's bucket URL.
    """
    if setting.lower() == "auto":
        return "://" in bucket_url and not bucket_url.startswith("file://")
    return setting.lower() == "true"


def trainer_signer(bucket: Bucket, bucket_url: str, run_id: str, sign_weights: str = "auto", run_key: str = "",
                   echo: Callable[[str], Any] = print) -> RunSigner | None:
    """The trainer's key for the run: the signed run's own (refused if absent or another), or for a new run a
    key loaded or created at :func:`key_path` when ``sign_weights`` wants one; None for an unsigned run.

    Args:
        bucket: the run's bucket (the contract is read to learn whether the run exists and is signed).
        bucket_url: its URL (names the default key file).
        run_id: the run.
        sign_weights: the trainer's ``sign_weights`` (auto, true, false); only read for a new run.
        run_key: the trainer's ``run_key`` path ("" for the default).
        echo: where the one-line notes go.

    Raises:
        RunKeyError: a signed run whose private key file is missing or holds another key.
    """
    path = key_path(bucket_url, run_id, run_key)
    try:
        existing: RunContract | None = RunContract.from_json(bucket.get(contract_key(run_id)))
    except ObjectNotFound:
        existing = None
    if existing is not None and not existing.run_key:
        echo(f"[trainer] run {run_id!r} was created without a key: its weights stay unsigned; anyone who can "
             "write the bucket can publish weights its workers follow")
        return None
    if existing is not None:
        if not path.is_file():
            raise RunKeyError(f"run {run_id!r} is signed by key {existing.run_key[:16]}... and its private key "
                              f"{path} is missing; copy the run's key file there, or set run_key to its path")
        signer = load_key(path)
        if signer.public_hex != existing.run_key:
            raise RunKeyError(f"{path} holds key {signer.public_hex[:16]}..., run {run_id!r} is signed by "
                              f"{existing.run_key[:16]}...; set run_key to the run's key file")
        return signer
    if not signing_wanted(sign_weights, bucket_url):
        echo(f"[trainer] run {run_id!r}: weights unsigned (sign_weights = {sign_weights}); anyone who can write "
             "the bucket can publish weights its workers follow")
        return None
    signer = load_key(path) if path.is_file() else create_key(path)
    echo(f"[trainer] run {run_id!r}: signing weights with key {signer.public_hex} (private key {path}, keep it "
         "to resume the run)")
    return signer


def known_keys_file() -> Path:
    """The file of run keys trusted on first use (one ``<bucket digest>-<run> <public key>`` per line)."""
    return default_key_dir() / "known_runs"


def _known_id(bucket_url: str, run_id: str) -> str:
    return f"{digest_hex(bucket_url.encode())[:12]}-{run_id}"


def _read_known(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    return {parts[0]: parts[1] for line in lines if len(parts := line.split()) == 2}


def trusted_run_key(run_key: str, bucket_url: str, run_id: str, pinned: str = "",
                    echo: Callable[[str], Any] = print, who: str = "worker") -> str:
    """The public key to verify the run's pointers with ("" for an unsigned run), after pinning.

    ``run_key`` is the contract's (its self-signature checked by ``RunContract.from_json``). A
    ``pinned`` key (join card, ``--run-key-pub``) must equal it; without one, the first key seen for this
    bucket and run is remembered in :func:`known_keys_file` and a later different one is refused. An unsigned
    run is followed with one logged line, unless a key was pinned or remembered for it.

    Args:
        run_key: the contract's public key ("" when the run is unsigned).
        bucket_url: the run's bucket.
        run_id: the run.
        pinned: the key this client was told to trust ("" for none).
        echo: where the one-line notes go.
        who: the client, for the notes (``worker``, ``eval``, ``export``).

    Raises:
        RunKeyError: the contract's key is not the pinned or remembered one.
    """
    known_path = known_keys_file()
    ident = _known_id(bucket_url, run_id)
    if pinned:
        expected, source = check_public_key(pinned.strip().lower(), "--run-key-pub"), "the pinned key"
    else:
        expected, source = _read_known(known_path).get(ident, ""), f"the key first seen (kept in {known_path})"
    if expected and run_key != expected:
        found = f"key {run_key[:16]}..." if run_key else "no key"
        raise RunKeyError(f"run {run_id!r} now carries {found} in run.json, not {source} {expected[:16]}...: "
                          "someone replaced the contract; if the run was really recreated, give its new key with "
                          f"--run-key-pub{'' if pinned else f' or delete its line in {known_path}'}")
    if not run_key:
        echo(f"[{who}] run {run_id!r} publishes unsigned weights (its trainer does not sign: sign_weights): "
             "anyone who can write the bucket can change the weights this client follows")
        return ""
    if not expected:
        known_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(known_path, "a") as f:
            f.write(f"{ident} {run_key}\n")
        echo(f"[{who}] run {run_id!r}: trusting its key {run_key[:16]}... on first use (kept in {known_path})")
    return run_key
