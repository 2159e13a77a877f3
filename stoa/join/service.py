"""A supervisor for a joined worker: a launchd agent (macOS) or a systemd user unit (Linux).

Both restart the worker when it fails and start it at login; a worker that exits 0 (the run finished) stays
down. Neither file holds a secret: both set ``STOA_ENV_FILE`` to the 0600 env file, which stoa's own
credential loader reads when the worker opens the bucket (it refuses a file others can read). launchd has no
``EnvironmentFile``, and credentials written into a plist's ``EnvironmentVariables`` would show in
``launchctl print`` and in backups of ``~/Library``; a wrapper script would be one more file to keep in step.
The same mechanism on systemd keeps the two identical and the secrets out of the process environment
(``/proc/PID/environ``, ``systemctl show``). Commands that load or unload a service go through
:func:`run_command`, which tests replace.
"""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from stoa.bucket.credentials import ENV_FILE_VAR

LABEL_PREFIX = "org.stoa.worker."
UNIT_PREFIX = "stoa-worker-"
RESTART_SECONDS = 30
"""Wait before a failed worker is started again (launchd ``ThrottleInterval``, systemd ``RestartSec``)."""


@dataclass(frozen=True)
class ServiceSpec:
    """What a service runs.

    Attributes:
        run: the run id (names the service).
        argv: the worker's command line (absolute python first).
        env_file: absolute path of the 0600 env file with the credentials, or empty (a local bucket).
        log_dir: where the worker's log files go.
    """

    run: str
    argv: tuple[str, ...]
    env_file: str = ""
    log_dir: str = ""


class ServiceError(RuntimeError):
    """A service manager command failed; the message names it and the file written."""


class ServiceResult(NamedTuple):
    """Where a service file was written or removed, and the commands run.

    Attributes:
        path: the plist or unit file.
        commands: each command run, with its exit code.
    """

    path: Path
    commands: list[tuple[tuple[str, ...], int]]


def run_command(argv: Sequence[str]) -> int:
    """Run one service-manager command, inheriting stdout/stderr; its exit code (127 when not installed).

    Args:
        argv: the command line.
    """
    try:
        return subprocess.run(list(argv), check=False).returncode
    except FileNotFoundError:
        return 127


def service_kind(platform: str | None = None) -> str:
    """``launchd`` on macOS, ``systemd`` on Linux.

    Args:
        platform: ``sys.platform`` (tests pass another).

    Raises:
        ServiceError: any other platform (run ``stoa join`` under your own supervisor there).
    """
    platform = platform or sys.platform
    if platform == "darwin":
        return "launchd"
    if platform.startswith("linux"):
        return "systemd"
    raise ServiceError(f"--install-service: no supervisor for {platform}; run stoa join under your own supervisor")


def service_path(kind: str, run: str, home: Path) -> Path:
    """The plist (``~/Library/LaunchAgents/org.stoa.worker.<run>.plist``) or unit file
    (``~/.config/systemd/user/stoa-worker-<run>.service``).

    Args:
        kind: ``launchd`` or ``systemd``.
        run: the run id.
        home: the home directory.
    """
    if kind == "launchd":
        return home / "Library" / "LaunchAgents" / f"{LABEL_PREFIX}{run}.plist"
    return home / ".config" / "systemd" / "user" / f"{UNIT_PREFIX}{run}.service"


def default_log_dir(kind: str, run: str, home: Path) -> Path:
    """``~/Library/Logs/stoa/<run>`` on macOS, ``~/.local/state/stoa/<run>`` on Linux.

    Args:
        kind: ``launchd`` or ``systemd``.
        run: the run id.
        home: the home directory.
    """
    if kind == "launchd":
        return home / "Library" / "Logs" / "stoa" / run
    return home / ".local" / "state" / "stoa" / run


def plist_bytes(spec: ServiceSpec) -> bytes:
    """The launchd agent: RunAtLoad, KeepAlive while the worker fails, logs in ``log_dir``.

    Args:
        spec: what the agent runs.
    """
    env = {"PYTHONUNBUFFERED": "1", "PATH": "/usr/local/bin:/opt/homebrew/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    if spec.env_file:
        env[ENV_FILE_VAR] = spec.env_file
    agent = {
        "Label": f"{LABEL_PREFIX}{spec.run}",
        "ProgramArguments": list(spec.argv),
        "EnvironmentVariables": env,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_SECONDS,
        "ProcessType": "Background",
        "WorkingDirectory": spec.log_dir,
        "StandardOutPath": str(Path(spec.log_dir) / "worker.log"),
        "StandardErrorPath": str(Path(spec.log_dir) / "worker.log"),
    }
    return plistlib.dumps(agent)


def systemd_quote(arg: str) -> str:
    """One word of a unit file's command line or ``Environment=``: ``%`` and ``$`` escaped, quoted when needed.

    Args:
        arg: the word.
    """
    word = arg.replace("%", "%%").replace("$", "$$")
    if word and not any(c in word for c in " \t\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(spec: ServiceSpec) -> str:
    """The systemd user unit: Restart=on-failure, started at login (WantedBy=default.target).

    Args:
        spec: what the unit runs.
    """
    env = [f"Environment={systemd_quote('PYTHONUNBUFFERED=1')}"]
    if spec.env_file:
        env.append(f"Environment={systemd_quote(f'{ENV_FILE_VAR}={spec.env_file}')}")
    lines = [
        "[Unit]",
        f"Description=stoa rollout worker for run {spec.run}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        *env,
        f"WorkingDirectory={systemd_quote(spec.log_dir)}",
        "ExecStart=" + " ".join(systemd_quote(a) for a in spec.argv),
        "Restart=on-failure",
        f"RestartSec={RESTART_SECONDS}",
        "",
        "[Install]",
        "WantedBy=default.target",
    ]
    return "\n".join(lines) + "\n"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def load_commands(kind: str, run: str, path: Path) -> list[list[str]]:
    """The commands that (re)load a written service: bootout then bootstrap, or daemon-reload then enable --now.

    Args:
        kind: ``launchd`` or ``systemd``.
        run: the run id.
        path: the written file.
    """
    if kind == "launchd":
        domain = f"gui/{_uid()}"
        return [["launchctl", "bootout", f"{domain}/{LABEL_PREFIX}{run}"],
                ["launchctl", "bootstrap", domain, str(path)]]
    unit = path.name
    return [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", unit]]


def unload_commands(kind: str, run: str, path: Path) -> list[list[str]]:
    """The commands that stop and unload a service before its file is removed.

    Args:
        kind: ``launchd`` or ``systemd``.
        run: the run id.
        path: the service file.
    """
    if kind == "launchd":
        return [["launchctl", "bootout", f"gui/{_uid()}/{LABEL_PREFIX}{run}"]]
    return [["systemctl", "--user", "disable", "--now", path.name]]


def install_service(spec: ServiceSpec, *, kind: str, home: Path,
                    runner: Callable[[Sequence[str]], int] | None = None) -> ServiceResult:
    """Write the service file and load it.

    A first ``launchctl bootout`` of a not-yet-loaded agent fails harmlessly; every other command must succeed.

    Args:
        spec: what the service runs (``log_dir`` is created).
        kind: ``launchd`` or ``systemd``.
        home: the home directory.
        runner: runs one command, returns its exit code (default :func:`run_command`).

    Raises:
        ServiceError: a load command failed; names it and the file written.
    """
    runner = runner or run_command
    path = service_path(kind, spec.run, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    if kind == "launchd":
        path.write_bytes(plist_bytes(spec))
    else:
        path.write_text(unit_text(spec))
    done: list[tuple[tuple[str, ...], int]] = []
    for i, cmd in enumerate(load_commands(kind, spec.run, path)):
        code = runner(cmd)
        done.append((tuple(cmd), code))
        if code != 0 and not (kind == "launchd" and i == 0):
            raise ServiceError(f"'{' '.join(cmd)}' exited {code}; the service file is {path} (load it by hand, "
                               "or stoa join --uninstall)")
    return ServiceResult(path, done)


def uninstall_service(run: str, *, kind: str, home: Path,
                      runner: Callable[[Sequence[str]], int] | None = None) -> ServiceResult:
    """Stop and unload the service, remove its file (systemd: reload the manager). Nothing installed is fine.

    Args:
        run: the run id.
        kind: ``launchd`` or ``systemd``.
        home: the home directory.
        runner: runs one command, returns its exit code (default :func:`run_command`).
    """
    runner = runner or run_command
    path = service_path(kind, run, home)
    done: list[tuple[tuple[str, ...], int]] = []
    if path.exists():
        done += [(tuple(cmd), runner(cmd)) for cmd in unload_commands(kind, run, path)]
        path.unlink()
        if kind == "systemd":
            cmd = ["systemctl", "--user", "daemon-reload"]
            done.append((tuple(cmd), runner(cmd)))
    return ServiceResult(path, done)
