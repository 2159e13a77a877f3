"""The supervisor files: plist and unit text (parsed), loading and unloading through a replaced runner."""

from __future__ import annotations

import os
import plistlib
import shlex
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from stoa.join import service
from stoa.join.launch import JoinOptions, join
from stoa.join.service import ServiceError, ServiceSpec
from tests.join.conftest import write_run
from tests.join.test_join import make_card_file

ARGV = ("/opt/venv/bin/python", "-m", "stoa", "worker", "--bucket", "r2://fleet/runs", "--run", "r1",
        "--n-samples", "8", "--plane", "bf16", "--name", "mac-1")
SECRET = "r2-secret-value-xyz"


class Runner:
    """Records service-manager commands; answers ``codes`` in turn (0 after they run out)."""

    def __init__(self, *codes: int) -> None:
        self.commands: list[list[str]] = []
        self.codes = list(codes)

    def __call__(self, argv) -> int:
        self.commands.append(list(argv))
        return self.codes.pop(0) if self.codes else 0


def spec(tmp_path: Path) -> ServiceSpec:
    return ServiceSpec(run="r1", argv=ARGV, env_file=str(tmp_path / "stoa r1.env"), log_dir=str(tmp_path / "logs"))


def unit_fields(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file, section-qualified, repeated keys kept in order."""
    fields: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line:
            key, value = line.split("=", 1)
            fields.setdefault(f"{section}.{key}", []).append(value)
    return fields


def test_the_plist_runs_the_worker_keeps_it_alive_and_names_the_env_file_only(tmp_path):
    data = service.plist_bytes(spec(tmp_path))
    agent = plistlib.loads(data)
    assert agent["Label"] == "org.stoa.worker.r1"
    assert agent["ProgramArguments"] == list(ARGV)
    assert agent["RunAtLoad"] is True
    assert agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["EnvironmentVariables"]["STOA_ENV_FILE"] == str(tmp_path / "stoa r1.env")
    assert agent["StandardOutPath"] == agent["StandardErrorPath"] == str(tmp_path / "logs" / "worker.log")
    assert not any(k.startswith(("R2_", "AWS_")) for k in agent["EnvironmentVariables"])


def test_the_unit_restarts_on_failure_starts_at_login_and_names_the_env_file(tmp_path):
    fields = unit_fields(service.unit_text(spec(tmp_path)))
    assert fields["Service.Restart"] == ["on-failure"]
    assert fields["Install.WantedBy"] == ["default.target"]
    assert shlex.split(fields["Service.ExecStart"][0]) == list(ARGV)
    envs = [shlex.split(e)[0] for e in fields["Service.Environment"]]
    assert f"STOA_ENV_FILE={tmp_path / 'stoa r1.env'}" in envs


def test_systemd_words_escape_specifiers_and_quote_spaces():
    assert service.systemd_quote("/a b/c") == '"/a b/c"'
    assert service.systemd_quote("50%$HOME") == "50%%$$HOME"
    assert service.systemd_quote('x"y') == '"x\\"y"'


@pytest.mark.parametrize(("kind", "name", "commands"), [
    ("systemd", ".config/systemd/user/stoa-worker-r1.service",
     [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", "stoa-worker-r1.service"]]),
    ("launchd", "Library/LaunchAgents/org.stoa.worker.r1.plist",
     [["launchctl", "bootout", f"gui/{os.getuid()}/org.stoa.worker.r1"], ["launchctl", "bootstrap",
                                                                           f"gui/{os.getuid()}", "PATH"]]),
])
def test_install_writes_the_file_and_loads_it_then_uninstall_removes_it(tmp_path, kind, name, commands):
    home = tmp_path / "home"
    runner = Runner(1)  # a first bootout of an agent not loaded yet fails; systemd's first command must not
    if kind == "systemd":
        with pytest.raises(ServiceError, match="daemon-reload"):
            service.install_service(spec(tmp_path), kind=kind, home=home, runner=runner)
        runner = Runner()
    result = service.install_service(spec(tmp_path), kind=kind, home=home, runner=runner)
    assert result.path == home / name and result.path.is_file()
    assert runner.commands == [[str(result.path) if c == "PATH" else c for c in cmd] for cmd in commands]
    assert (tmp_path / "logs").is_dir()
    runner = Runner()
    assert service.uninstall_service("r1", kind=kind, home=home, runner=runner).path == home / name
    assert not (home / name).exists()
    assert runner.commands[0][:2] == (["launchctl", "bootout"] if kind == "launchd" else ["systemctl", "--user"])
    runner = Runner()
    service.uninstall_service("r1", kind=kind, home=home, runner=runner)
    assert runner.commands == []


def test_join_install_service_writes_a_unit_with_the_env_file_and_no_secret(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    env_file = tmp_path / "w.env"
    env_file.write_text(f"R2_SECRET_ACCESS_KEY={SECRET}\n")
    env_file.chmod(0o600)
    card = make_card_file(tmp_path, local_bucket)
    home, runner, lines = tmp_path / "home", Runner(), []
    opts = JoinOptions(card=str(card), env_file=str(env_file), name="box-1", install=True)
    assert join(opts, echo=lines.append, platform="linux", home=home, runner=runner) == 0
    unit = home / ".config/systemd/user/stoa-worker-r1.service"
    fields = unit_fields(unit.read_text())
    assert SECRET not in unit.read_text()
    assert f"STOA_ENV_FILE={env_file}" in [shlex.split(e)[0] for e in fields["Service.Environment"]]
    argv = shlex.split(fields["Service.ExecStart"][0])
    assert argv[argv.index("--name") + 1] == "box-1" and argv[argv.index("--run") + 1] == "r1"
    assert runner.commands[-1] == ["systemctl", "--user", "enable", "--now", "stoa-worker-r1.service"]
    opts = JoinOptions(card=str(card), uninstall=True)
    assert join(opts, echo=lines.append, platform="linux", home=home, runner=runner) == 0
    assert not unit.exists()


def test_a_dry_run_install_writes_nothing_and_a_credentialed_card_needs_an_env_file(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    home, runner, lines = tmp_path / "home", Runner(), []
    opts = JoinOptions(card=str(make_card_file(tmp_path, local_bucket)), install=True, dry_run=True)
    assert join(opts, echo=lines.append, platform="darwin", home=home, runner=runner) == 0
    assert runner.commands == [] and not home.exists()
    assert plistlib.loads(lines[-1].split(":\n", 1)[1].encode())["Label"] == "org.stoa.worker.r1"
    card = make_card_file(tmp_path, local_bucket, credentials=("R2_ACCOUNT_ID",))
    assert join(JoinOptions(card=str(card), install=True), echo=lines.append, platform="linux", home=home,
                runner=runner) == 2
    assert runner.commands == [] and not home.exists()


def test_an_unknown_platform_has_no_service():
    with pytest.raises(ServiceError, match="own supervisor"):
        service.service_kind("win32")
