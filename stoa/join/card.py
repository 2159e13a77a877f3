"""The join card: what a new worker needs to join a run (bucket, run, n, plane, task, retriever), and in a signed
run its own worker key (a secret then: ``stoa.join.cardkey`` writes such a card 0600); never bucket credentials.

``make_card`` reads the run's contract from the bucket; ``card_toml``/``read_card`` write and read the small
TOML file ``stoa join`` takes; ``card_text`` is the screen ``stoa join-card`` prints. ``credential_names`` says
which variables a joiner must set for the bucket's URL scheme (names only); ``write_secrets`` writes their
values from this machine into a new 0600 env file for out-of-band hand-over.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoa.bucket import ObjectNotFound, open_bucket, parse_bucket_url
from stoa.bucket.credentials import R2_VARS, resolve_env
from stoa.contract import MAX_SAMPLES, RunContract
from stoa.layout import contract_key
from stoa.tasks.code import TaskCode, from_contract
from stoa.untrusted import loads_bounded

CARD_VERSION = 1
"""Version of the card file; ``read_card`` refuses another."""
MAX_CARD_CHARS = 64 << 10
"""Longest card file read (a card is about 600 characters)."""
R2_OPTIONAL = ("R2_ENDPOINT_URL",)
"""R2 variables a joiner needs only when this machine sets them too (an EU jurisdiction endpoint)."""
AWS_REQUIRED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
AWS_OPTIONAL = ("AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""AWS-style variables a joiner needs only when this machine sets them (a non-AWS store's endpoint, a region)."""
TUNING_OPTIONAL = ("STOA_S3_LISTING",)
"""Bucket tuning a joiner must share with the trainer when set (``client`` listing for SeaweedFS)."""
SEARCH_TASKS = ("search", "searchqa")
"""Task ids whose workers need a retriever (the search tool)."""


class CardError(ValueError):
    """A join card that cannot be made, written or read; the message names the fix."""


@dataclass(frozen=True)
class JoinCard:
    """Everything a joining worker needs except secrets.

    Attributes:
        bucket: the bucket URL (a local path is made absolute).
        run: the run id.
        n_samples: the run's group size n.
        plane: the run's weight plane.
        task: the run's task id.
        contract: the contract's fingerprint, so a run re-created under the same id is noticed.
        search: whether the task searches (needs a retriever).
        retriever: a shared retriever endpoint URL, or empty (the worker downloads the run's index).
        credentials: names of the variables a joiner must set (never their values).
        run_key: the run's public key (64 hex digits; empty for an unsigned run): the worker refuses a
            contract that carries another (``--run-key-pub``).
        worker: the worker name a key was issued for with this card (``stoa join-card --name NAME``). Empty: none.
        worker_key: that key's private half (64 hex digits), which makes the card a secret: ``stoa join``
            installs it and the worker signs every record with it. Empty: the key travels apart, in a 0600 file
            the joiner passes to ``stoa join --worker-key`` (or the card has no worker key).
        requires: the task plugin code the run's workers need (``stoa.tasks.code``): ``dist==version`` for an
            installed distribution (``stoa join --install-task-code`` installs it), ``module.py sha256:<hex>``
            for a loose module to copy.
        card_version: :data:`CARD_VERSION`.
    """

    bucket: str
    run: str
    n_samples: int
    plane: str
    task: str
    contract: str
    search: bool = False
    retriever: str = ""
    credentials: tuple[str, ...] = field(default_factory=tuple)
    run_key: str = ""
    requires: tuple[str, ...] = field(default_factory=tuple)
    worker: str = ""
    worker_key: str = field(default="", repr=False)
    card_version: int = CARD_VERSION


def credential_names(url: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables a joiner must set to open ``url`` like this machine does (names only).

    ``r2://`` takes the R2 variables; ``s3://`` the AWS ones when this machine uses them (as
    ``open_bucket`` picks them), else the R2 ones. Optional variables (endpoint, region, session token, the
    bucket name for a URL without one, listing mode) are named when this machine sets them.

    Args:
        url: the bucket URL.
        env: this machine's variables (environment and env file merged).
    """
    where = parse_bucket_url(url)
    if where.scheme == "file":
        return ()
    aws = where.scheme == "s3" and bool(env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY")
                                        or not any(env.get(n) for n in R2_VARS))
    required, optional, bucket_var = ((AWS_REQUIRED, AWS_OPTIONAL, "AWS_BUCKET") if aws
                                      else (R2_VARS, R2_OPTIONAL, "R2_BUCKET"))
    names = list(required) + [n for n in optional + TUNING_OPTIONAL if env.get(n)]
    if not where.location:
        names.append(bucket_var)
    return tuple(names)


def _card_bucket(url: str) -> str:
    """A local bucket path made absolute (the card travels to another directory); other URLs unchanged."""
    where = parse_bucket_url(url)
    if where.scheme == "file" and "://" not in url:
        return os.path.abspath(os.path.expanduser(url.strip()))
    return url.strip()


def read_contract(bucket_url: str, run: str, env: Mapping[str, str] | None = None) -> RunContract:
    """The run's contract from its bucket.

    Args:
        bucket_url: the bucket URL.
        run: the run id.
        env: variables for the bucket's credentials (default: the environment and ``STOA_ENV_FILE``).

    Raises:
        ObjectNotFound: the run has no contract; the message names the fix.
    """
    bucket = open_bucket(bucket_url, env, create=False, retry_seconds=10.0)
    try:
        return RunContract.from_json(bucket.get(contract_key(run)), contract_key(run))
    except ObjectNotFound:
        raise ObjectNotFound(f"run {run!r} has no contract in {bucket_url}; start the trainer first or check "
                             "--run/--bucket") from None


def make_card(bucket_url: str, run: str, retriever: str = "", env: Mapping[str, str] | None = None) -> JoinCard:
    """Build the join card of a run from its contract.

    Args:
        bucket_url: the bucket URL.
        run: the run id.
        retriever: a shared retriever endpoint (``http(s)://``) for a search task; empty: workers download
            the run's index from the bucket.
        env: variables for the bucket's credentials (default: the environment and ``STOA_ENV_FILE``).

    Raises:
        CardError: a retriever for a task that has none, or one that is not a URL.
        ObjectNotFound: the run has no contract.
    """
    variables = resolve_env(env)
    contract = read_contract(bucket_url, run, variables)
    search = contract.task_id in SEARCH_TASKS or bool(contract.retriever)
    if retriever and not search:
        raise CardError(f"--retriever: task {contract.task_id!r} uses no retriever; leave --retriever out")
    if retriever and not retriever.startswith(("http://", "https://")):
        raise CardError(f"--retriever {retriever!r}: give the URL of a shared endpoint (stoa retriever serve); "
                        "a directory does not travel, and without --retriever workers use the run's index")
    return JoinCard(bucket=_card_bucket(bucket_url), run=run, n_samples=contract.n_samples, plane=contract.plane,
                    task=contract.task_id, contract=contract.fingerprint(), search=search, retriever=retriever,
                    credentials=credential_names(bucket_url, variables), run_key=contract.run_key,
                    requires=tuple(requirement(c) for c in from_contract(contract.task_code)))


def requirement(code: TaskCode) -> str:
    """How a card names one module of task code: ``dist==version``, or ``module.py sha256:<hex>``.

    Args:
        code: one entry of the contract's ``task_code``.
    """
    if code.dist:
        return f"{code.dist}=={code.version}" if code.version else code.dist
    return f"{code.module}.py sha256:{code.sha256}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def card_toml(card: JoinCard) -> str:
    """The card file's text (TOML, one key per field; ``read_card`` reads it back).

    Args:
        card: the card.
    """
    join = (f"stoa join --card FILE --env ENVFILE  (ENVFILE sets {', '.join(card.credentials)})" if card.credentials
            else "stoa join --card FILE")
    if card.worker and not card.worker_key:
        join += f"  --worker-key KEYFILE  (the 0600 key of {card.worker!r}, handed over apart)"
    head = (f"# stoa join card for run {card.run!r}: a SECRET, it holds the private worker key of {card.worker!r}: "
            "keep it 0600, hand it over out of band to one machine, never mail or commit it."
            if card.worker_key else f"# stoa join card for run {card.run!r}: no secrets here.")
    lines = [head, f"# Join with: {join}"]
    lines += [f"{name} = {_toml_value(value)}" for name, value in asdict(card).items()
              if name not in ("run_key", "requires", "worker", "worker_key") or value]  # older cards read as before
    return "\n".join(lines) + "\n"


def read_card(path: str | os.PathLike[str]) -> JoinCard:
    """Read a card file (TOML as ``card_toml`` writes it, or the same keys as JSON).

    Args:
        path: the card file.

    Raises:
        CardError: missing, unreadable, over 64 KiB, of another version, or with missing or mistyped keys.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CardError(f"card {path}: {e.strerror or e}; ask the run's operator for it (stoa join-card "
                        "--out)") from None
    except UnicodeDecodeError:
        raise CardError(f"card {path} is not UTF-8 text; write it with stoa join-card --out FILE") from None
    try:
        if len(text) > MAX_CARD_CHARS:
            raise ValueError(f"{len(text)} characters > {MAX_CARD_CHARS}")
        data = (loads_bounded(text.encode("utf-8"), max_bytes=4 * MAX_CARD_CHARS, max_depth=2)
                if text.lstrip().startswith("{") else tomllib.loads(text))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as e:  # TOMLDecodeError is a ValueError
        raise CardError(f"card {path} is not a join card ({str(e)[:200]}); write it with stoa join-card --out "
                        "FILE") from None
    if data.get("card_version") != CARD_VERSION:
        raise CardError(f"card {path} has version {data.get('card_version')!r}, this stoa reads {CARD_VERSION}; "
                        "make a new one with this stoa's join-card")
    return _card_from(data, path)


def _utf8(value: Any) -> bool:
    """Whether a card value holds only text that prints (no lone surrogate from a JSON ``\\ud800``)."""
    items = value if isinstance(value, list) else [value]
    return all(not isinstance(v, str) or v.encode("utf-8", "replace") == v.encode("utf-8", "ignore")
               for v in items)


def _card_from(data: Mapping[str, Any], path: str | os.PathLike[str]) -> JoinCard:
    kinds = {"bucket": str, "run": str, "n_samples": int, "plane": str, "task": str, "contract": str,
             "search": bool, "retriever": str, "credentials": list}
    for name, kind in kinds.items():
        value = data.get(name)
        bad_int = kind is int and (type(value) is not int or not 1 <= value <= MAX_SAMPLES)
        if not isinstance(value, kind) or bad_int or not _utf8(value):
            raise CardError(f"card {path}: {name!r} is missing or not a {kind.__name__}; make a new card with "
                            "stoa join-card --out FILE")
    run_key = data.get("run_key", "")
    if not isinstance(run_key, str) or (run_key and not (len(run_key) == 64
                                                         and all(c in "0123456789abcdef" for c in run_key))):
        raise CardError(f"card {path}: 'run_key' is not a public key (64 lowercase hex digits); make a new card "
                        "with stoa join-card --out FILE")
    requires = data.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) and _utf8(r) and len(r) <= 256
                                                 for r in requires) or len(requires) > 16:
        raise CardError(f"card {path}: 'requires' must list at most 16 requirements; make a new card with "
                        "stoa join-card --out FILE")
    worker = data.get("worker", "")
    if not isinstance(worker, str) or len(worker) > 40 or not all(c.isascii() and (c.isalnum() or c in "._-")
                                                                   for c in worker):
        raise CardError(f"card {path}: 'worker' is not a worker name; make a new card with stoa join-card --out FILE")
    worker_key = data.get("worker_key", "")
    if not isinstance(worker_key, str) or (worker_key and not (worker and len(worker_key) == 64 and all(
            c in "0123456789abcdef" for c in worker_key))):
        raise CardError(f"card {path}: 'worker_key' is not a named worker's private key (64 lowercase hex digits); "
                        "make a new card with stoa join-card --out FILE")
    names = tuple(data["credentials"])
    if not all(isinstance(n, str) for n in names):
        raise CardError(f"card {path}: 'credentials' must list variable names")
    return JoinCard(bucket=data["bucket"], run=data["run"], n_samples=data["n_samples"], plane=data["plane"],
                    task=data["task"], contract=data["contract"], search=data["search"],
                    retriever=data["retriever"], credentials=names, run_key=run_key, requires=tuple(requires),
                    worker=worker, worker_key=worker_key)


def card_text(card: JoinCard, card_file: str, env_file: str = "") -> str:
    """The screen ``stoa join-card`` prints: every value, the variables to set, the join command.

    Args:
        card: the card.
        card_file: the card file's name as the joiner will have it.
        env_file: the env file with the secrets, if one was written.
    """
    if not card.search:
        retriever = "none (the task uses no search tool)"
    elif card.retriever:
        retriever = card.retriever
    else:
        retriever = "the worker downloads the run's index from the bucket (no endpoint needed)"
    creds = ", ".join(card.credentials) if card.credentials else "none (a local bucket)"
    env_arg = f" --env {env_file or 'ENVFILE'}" if card.credentials else ""
    env_arg += " --worker-key KEYFILE" if card.worker and not card.worker_key else ""
    if card.worker_key:
        worker_key = f"{card.worker!r}, in this card: the card is a SECRET now (0600; one machine, out of band)"
    elif card.worker:
        worker_key = f"issued for {card.worker!r} (its key file travels apart, mode 0600)"
    else:
        worker_key = "none: the worker's records go unsigned" + (
            " (a run requiring worker keys refuses them)" if card.run_key else "")
    rows = [("bucket", card.bucket), ("run", card.run), ("group size n", str(card.n_samples)),
            ("plane", card.plane), ("task", card.task), ("retriever", retriever), ("contract", card.contract),
            ("run key", card.run_key or "none (the run's weights are unsigned)"),
            ("task code", ", ".join(card.requires) or "built in (nothing to install)"),
            ("worker key", worker_key),
            ("set these", creds + (" (values handed over apart from this card)" if card.credentials else "")),
            ("join with", f"stoa join --card {card_file}{env_arg}")]
    return "\n".join([f"stoa join card for run {card.run!r}"] + [f"  {k + ':':<14}{v}" for k, v in rows])


def _env_value(value: str) -> str:
    """A value quoted so that stoa's env-file reader (which strips one pair of outer quotes) and a POSIX shell
    both read it back unchanged."""
    return f"'{value}'" if "'" not in value else f'"{value}"'


def write_secrets(path: str | os.PathLike[str], names: tuple[str, ...], env: Mapping[str, str]) -> list[str]:
    """Write ``NAME=value`` lines for ``names`` from ``env`` into a NEW file of mode 0600.

    Args:
        path: the env file to create (refused if it exists).
        names: the variables (a card's ``credentials``).
        env: where the values come from (this machine's environment and env file).

    Returns:
        The names written.

    Raises:
        CardError: nothing to write (a local bucket), a variable unset here, the file exists, or a value
            that cannot be one line.
    """
    if not names:
        raise CardError("--with-secrets: a local bucket needs no credentials; leave --with-secrets out")
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise CardError(f"--with-secrets: {', '.join(missing)} not set on this machine; set them (or STOA_ENV_FILE) "
                        "and run join-card again")
    if any("\n" in env[n] or "\r" in env[n] for n in names):
        raise CardError("--with-secrets: a credential value holds a line break; fix the variable")
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CardError(f"--with-secrets {path}: the file exists; remove it or name a new file") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask, never more and never less than 0600
        f.write("# stoa bucket credentials: hand over out of band, keep mode 0600, never commit.\n")
        f.writelines(f"{n}={_env_value(env[n])}\n" for n in names)
    return list(names)
