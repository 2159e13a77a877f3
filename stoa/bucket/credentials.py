"""S3/R2 credentials from the environment or a 0600 env file; secrets never reach repr, str or errors."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

from .base import BucketError

__all__ = [
    "CredentialsError",
    "S3Credentials",
    "load_env_file",
    "redact_url",
    "resolve_env",
    "s3_credentials",
    "scrub_secrets",
]

ENV_FILE_VAR = "STOA_ENV_FILE"
R2_VARS = ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY")
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_ENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$")
MIN_SUBSTRING_SECRET = 8
"""Secrets at least this long are scrubbed wherever they occur; shorter ones only as whole tokens."""
REDACTED = "***"


class CredentialsError(BucketError, ValueError):
    """Credentials are missing, incomplete, or the env file is unsafe. Never contains secret values."""


@dataclass(frozen=True)
class S3Credentials:
    """Static credentials and connection info for an S3-compatible store.

    Attributes:
        access_key_id: Access key id.
        secret_access_key: Secret key (excluded from repr).
        session_token: Optional session token (excluded from repr).
        endpoint: Endpoint URL, or None for AWS's regional endpoint.
        region: Signing region ("auto" for R2).
        bucket: Default bucket name from the environment (R2_BUCKET), used when the URL has none.
        source: Which variables these came from, for messages ("R2_*" or "AWS_*").
    """

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    region: str = "us-east-1"
    bucket: str | None = None
    source: str = "AWS_*"

    def __repr__(self) -> str:
        return (
            f"S3Credentials(source={self.source!r}, access_key_id={_mask(self.access_key_id)!r}, "
            f"secret_access_key='***', endpoint={redact_url(self.endpoint) if self.endpoint else None!r}, "
            f"region={self.region!r})"
        )

    __str__ = __repr__

    def secrets(self) -> tuple[str, ...]:
        """The secret strings, so error messages can be scrubbed of them.

        Returns:
            The non-empty secret values.
        """
        return tuple(s for s in (self.secret_access_key, self.session_token) if s)


def scrub_secrets(text: str, secrets: Iterable[str]) -> str:
    """Replace secrets in ``text`` with ``***`` without mangling the rest of the message.

    A secret of at least :data:`MIN_SUBSTRING_SECRET` characters is replaced wherever it occurs (such
    a string inside ordinary text is the secret). A shorter one is replaced only where it stands as a
    whole token (not inside a run of letters and digits): a secret ``s`` must not turn every "s" of a
    message into ``***``, yet ``user:s@host`` still loses it. Each secret's percent-encoded form is
    scrubbed too. Longer secrets go first, so a secret containing another is scrubbed whole.

    Args:
        text: the message.
        secrets: secret values; empty ones are ignored.

    Returns:
        The message with every occurrence replaced.
    """
    forms = {f for s in secrets if s for f in (s, quote(s, safe=""))}  # as given and as a URL carries it
    for secret in sorted(forms, key=len, reverse=True):
        if len(secret) >= MIN_SUBSTRING_SECRET:
            text = text.replace(secret, REDACTED)
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", REDACTED, text)
    return text


def _mask(value: str) -> str:
    return value[:4] + "…" if len(value) > 8 else "…"


def redact_url(url: str) -> str:
    """Display form of a URL: user info, query and fragment dropped.

    Args:
        url: Any URL.

    Returns:
        ``scheme://host[:port]/path`` without credentials or parameters.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def load_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a KEY=VALUE env file that only its owner may read.

    Blank lines and lines starting with '#' are skipped; ``export KEY=VALUE`` and quoted values are
    accepted.

    Args:
        path: The env file.

    Returns:
        The variables it defines.

    Raises:
        CredentialsError: The file is missing, not a regular file, readable or writable by group or
            others (mode must be 0600 or stricter), or has a malformed line. The message names the
            file, the mode and the line number, never the contents.
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CredentialsError(f"env file {p} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise CredentialsError(f"env file {p} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise CredentialsError(
            f"env file {p} has mode {mode:04o}; it holds secrets and must be 0600 (run: chmod 600 {p})"
        )
    values: dict[str, str] = {}
    with open(p, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _ENV_LINE.match(line)
            if m is None:
                raise CredentialsError(f"env file {p}, line {lineno}: expected KEY=VALUE")
            key, value = m.group(1), m.group(2).strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[key] = value
    return values


def resolve_env(
    env: Mapping[str, str] | None = None, env_file: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """Merge the environment with an optional env file; the environment wins on conflicts.

    Args:
        env: Variables to use (default ``os.environ``).
        env_file: An env file to read; default the path in ``STOA_ENV_FILE`` if set.

    Returns:
        The merged variables.
    """
    base = dict(os.environ if env is None else env)
    path = env_file if env_file is not None else base.get(ENV_FILE_VAR) or None
    if path is None:
        return base
    merged = load_env_file(path)
    merged.update(base)
    return merged


def _missing(env: Mapping[str, str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not env.get(n)]


def _r2(env: Mapping[str, str]) -> S3Credentials:
    missing = _missing(env, R2_VARS)
    if missing:
        raise CredentialsError(
            f"R2 credentials incomplete: missing {', '.join(missing)} "
            f"(R2 needs {', '.join(R2_VARS)}; R2_BUCKET optional)"
        )
    account = env["R2_ACCOUNT_ID"]
    if not re.fullmatch(r"[A-Za-z0-9-]+", account):
        raise CredentialsError("R2_ACCOUNT_ID must be letters, digits and '-'")
    endpoint = env.get("R2_ENDPOINT_URL") or f"https://{account}.r2.cloudflarestorage.com"
    return S3Credentials(
        access_key_id=env["R2_ACCESS_KEY_ID"],
        secret_access_key=env["R2_SECRET_ACCESS_KEY"],
        endpoint=endpoint,
        region="auto",
        bucket=env.get("R2_BUCKET") or None,
        source="R2_*",
    )


def _aws(env: Mapping[str, str]) -> S3Credentials:
    missing = _missing(env, AWS_VARS)
    if missing:
        raise CredentialsError(
            f"AWS credentials incomplete: missing {', '.join(missing)} "
            "(set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, plus AWS_ENDPOINT_URL for non-AWS stores)"
        )
    return S3Credentials(
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        session_token=env.get("AWS_SESSION_TOKEN") or None,
        endpoint=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        bucket=env.get("AWS_BUCKET") or None,
        source="AWS_*",
    )


def s3_credentials(env: Mapping[str, str], scheme: str = "s3") -> S3Credentials:
    """Pick credentials for an ``s3://`` or ``r2://`` bucket.

    ``r2://`` uses the R2 variables (``R2_ACCOUNT_ID``, ``R2_ACCESS_KEY_ID``, ``R2_SECRET_ACCESS_KEY``,
    optional ``R2_BUCKET`` and ``R2_ENDPOINT_URL``; endpoint ``https://<account>.r2.cloudflarestorage.com``,
    region ``auto``). ``s3://`` uses the AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    optional ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``) when ``AWS_ACCESS_KEY_ID`` is set, else the R2 ones.

    Args:
        env: Variables, typically from ``resolve_env``.
        scheme: "s3" or "r2".

    Returns:
        The credentials.

    Raises:
        CredentialsError: Nothing usable is set; the message names the variables needed.
    """
    if scheme == "r2":
        return _r2(env)
    if scheme != "s3":
        raise ValueError(f"unknown scheme {scheme!r}")
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY"):
        return _aws(env)
    if any(env.get(n) for n in R2_VARS):
        return _r2(env)
    raise CredentialsError(
        "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(plus AWS_ENDPOINT_URL for non-AWS stores), or R2_ACCOUNT_ID, R2_ACCESS_KEY_ID and "
        f"R2_SECRET_ACCESS_KEY; they may also come from an env file named by {ENV_FILE_VAR} (mode 0600)"
    )
