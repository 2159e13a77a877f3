"""``stoa join``'s flow: read the card, run the checks (one line each), then start the worker or install a service.

The worker is started by replacing this process (:func:`exec_worker`, which tests replace) with
``python -m stoa worker --bucket B --run R --n-samples N --plane P [--name L] [--retriever URL]``; the env file
reaches it as ``STOA_ENV_FILE``, never on the command line.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stoa.bucket.credentials import ENV_FILE_VAR, CredentialsError, resolve_env
from stoa.engines.factory import default_engine
from stoa.join import service
from stoa.join.card import JoinCard, read_card
from stoa.join.cardkey import install_card_key
from stoa.join.checks import (
    EXIT_BAD_SETUP,
    EXIT_CREDENTIALS,
    Check,
    check_blas,
    check_bucket,
    check_contract,
    check_disk,
    check_engine,
    check_plugins,
    check_retriever,
    check_tier,
)


@dataclass(frozen=True)
class JoinOptions:
    """What ``stoa join`` was asked to do.

    Attributes:
        card: the card file.
        env_file: the 0600 env file with the credentials (empty: the environment only).
        name: the worker's label (empty: the worker's default, the host name).
        dry_run: check and print the worker's command line, start nothing.
        install: write and load a launchd agent / systemd user unit instead of starting the worker here.
        uninstall: stop and remove that service.
        install_task_code: when the task code check fails, ``pip install`` the card's ``requires`` (the
            distributions the trainer ran) into this Python, then check again.
        worker_key: the worker's key file (``stoa worker-key issue``); required when the card names a worker
            whose key travels apart, refused when the card carries the key (``stoa join`` installs that one).
    """

    card: str
    env_file: str = ""
    name: str = ""
    dry_run: bool = False
    install: bool = False
    uninstall: bool = False
    install_task_code: bool = False
    worker_key: str = ""


def exec_worker(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Replace this process with the worker (never returns).

    Args:
        argv: the worker's command line, absolute python first.
        env: its environment.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), dict(env))


def worker_argv(card: JoinCard, name: str = "", log_dir: str = "", python: str = "",
                worker_key: str = "") -> list[str]:
    """The worker's command line for a card (no secrets: credentials travel in ``STOA_ENV_FILE``).

    Args:
        card: the join card.
        name: the worker's label (empty: the host name).
        log_dir: the worker's metrics directory (empty: its default).
        python: the interpreter (default: this one).
        worker_key: the worker's key file, absolute (empty: unsigned records).
    """
    argv = [python or sys.executable, "-m", "stoa", "worker", "--bucket", card.bucket, "--run", card.run,
            "--n-samples", str(card.n_samples), "--plane", card.plane]
    if name:
        argv += ["--name", name]
    if card.retriever:
        argv += ["--retriever", card.retriever]
    if card.run_key:  # the worker refuses a contract that carries another key
        argv += ["--run-key-pub", card.run_key]
    if log_dir:
        argv += ["--log-dir", log_dir]
    if worker_key:  # a path, not the key: the worker reads the 0600 file
        argv += ["--worker-key", worker_key]
    return argv


def run_checks(card: JoinCard, env: Mapping[str, str]) -> list[Check]:
    """Every check, in order; the contract and retriever checks only once the bucket answered.

    Args:
        card: the join card.
        env: variables (environment and env file merged).
    """
    engine = default_engine()
    checks = [check_engine(engine), check_blas(engine), check_tier(card.n_samples, engine), check_disk()]
    probe = check_bucket(card, env)
    checks.append(probe.check)
    if probe.contract is not None:
        checks += [check_contract(card, probe.contract, probe.state), check_plugins(probe.contract),
                   check_retriever(card, probe.contract)]
    return checks


def _key_refusal(card: JoinCard, opts: JoinOptions) -> str:
    """Why the card's worker key and the options disagree ("" when they do not)."""
    if card.worker_key and opts.worker_key:
        return f"the card carries the worker key of {card.worker!r}; leave --worker-key out"
    if card.worker_key and opts.name and opts.name != card.worker:
        return (f"--name {opts.name!r}, but the card's worker key is {card.worker!r}'s; leave --name out (the key "
                "names the worker)")
    if card.worker and not card.worker_key and not opts.worker_key:
        return (f"the card was issued with a worker key for {card.worker!r}; pass --worker-key FILE (the 0600 key "
                "file the operator handed over)")
    return ""


def _abs_key(opts: JoinOptions) -> str:
    return str(Path(opts.worker_key).expanduser().resolve()) if opts.worker_key else ""


def _abs_env_file(opts: JoinOptions) -> str:
    return str(Path(opts.env_file).expanduser().resolve()) if opts.env_file else ""


def join(opts: JoinOptions, *, echo: Callable[[str], object] = print, platform: str | None = None,
         home: Path | None = None, runner: Callable[[Sequence[str]], int] | None = None,
         execute: Callable[[Sequence[str], Mapping[str, str]], None] | None = None) -> int:
    """Run ``stoa join``: checks, then the worker (or its service); the exit code.

    Args:
        opts: what to do.
        echo: where lines go.
        platform: ``sys.platform`` for the service kind (tests pass another).
        home: the home directory for service files (default ``~``).
        runner: runs a service-manager command (default :func:`stoa.join.service.run_command`).
        execute: starts the worker (default :func:`exec_worker`).

    Raises:
        CardError: the card is missing or malformed.
    """
    card = read_card(opts.card)
    home = home or Path.home()
    if opts.uninstall:
        kind = service.service_kind(platform)
        result = service.uninstall_service(card.run, kind=kind, home=home, runner=runner)
        echo(f"[join] removed {result.path}" if result.commands else f"[join] no service at {result.path}")
        return 0
    env_file = _abs_env_file(opts)
    refused = _key_refusal(card, opts)
    if refused:
        echo(f"[join] refused: {refused}")
        return EXIT_BAD_SETUP
    if opts.install and card.credentials and not env_file:
        echo("[join] refused: --install-service: the service reads the credentials from a file; pass --env FILE")
        return EXIT_BAD_SETUP
    try:
        env = resolve_env(None, env_file or None)
    except CredentialsError as e:
        echo(Check("env", "fail", str(e), "chmod 600 the env file, or fix the path", EXIT_CREDENTIALS).line())
        return EXIT_CREDENTIALS
    checks = run_checks(card, env)
    for c in checks:
        echo(c.line())
    failed = next((c for c in checks if c.status == "fail"), None)
    if failed is not None and failed.name == "task-code" and opts.install_task_code:
        if _install_task_code(card, echo, runner or service.run_command) != 0:
            echo("[join] refused: task-code: pip could not install " + ", ".join(card.requires))
            return failed.code
        importlib.invalidate_caches()
        checks = run_checks(card, env)
        failed = next((c for c in checks if c.status == "fail"), None)
    if failed is not None:
        echo(f"[join] refused: {failed.name}: {failed.fix}")
        return failed.code
    worker_key = install_card_key(card, opts.dry_run) if card.worker_key else _abs_key(opts)
    if card.worker_key:
        echo(f"[join] {'would install' if opts.dry_run else 'installed'} the card's worker key of {card.worker!r} "
             f"at {worker_key} (0600): the worker signs every record with it")
    if opts.install:
        return _install(card, opts, env_file, worker_key, echo=echo, platform=platform, home=home, runner=runner)
    argv = worker_argv(card, opts.name, worker_key=worker_key)
    if opts.dry_run:
        echo("[join] dry run; would run: " + " ".join(argv) + (f"  ({ENV_FILE_VAR}={env_file})" if env_file else ""))
        return 0
    worker_env = dict(os.environ)
    if env_file:
        worker_env[ENV_FILE_VAR] = env_file
    echo(f"[join] starting the worker: {' '.join(argv)}")
    (execute or exec_worker)(argv, worker_env)
    return 0


def _install_task_code(card: JoinCard, echo: Callable[[str], object], runner: Callable[[Sequence[str]], int]) -> int:
    """``pip install`` the card's distributions (a loose module cannot be installed: its copy is the operator's)."""
    specs = [r for r in card.requires if " sha256:" not in r]
    if not specs:
        return 1
    argv = [sys.executable, "-m", "pip", "install", *specs]
    echo("[join] installing the run's task code: " + " ".join(argv))
    return runner(argv)


def _install(card: JoinCard, opts: JoinOptions, env_file: str, worker_key: str, *, echo: Callable[[str], object],
             platform: str | None, home: Path, runner: Callable[[Sequence[str]], int] | None) -> int:
    """Write and load the service (print its text only, on a dry run)."""
    kind = service.service_kind(platform)
    log_dir = str(service.default_log_dir(kind, card.run, home))
    argv = tuple(worker_argv(card, opts.name, log_dir, worker_key=worker_key))
    spec = service.ServiceSpec(run=card.run, argv=argv, env_file=env_file,
                               log_dir=log_dir)
    path = service.service_path(kind, card.run, home)
    if opts.dry_run:
        text = service.plist_bytes(spec).decode() if kind == "launchd" else service.unit_text(spec)
        echo(f"[join] dry run; would write {path}:\n{text}")
        return 0
    service.install_service(spec, kind=kind, home=home, runner=runner)
    if kind == "launchd":
        echo(f"[join] loaded {path}; logs: {log_dir}/worker.log; remove: stoa join --uninstall --card {opts.card}")
    else:
        echo(f"[join] enabled {path.name} ({path}); logs: journalctl --user -u {path.name} -f; to start at boot "
             f"without a login: loginctl enable-linger; remove: stoa join --uninstall --card {opts.card}")
    return 0
