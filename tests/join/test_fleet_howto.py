"""docs/fleet.md's command blocks, every one, run in order against a local S3 endpoint (moto) with the R2 variables.

Two machines, each with its own HOME and working directory: the GPU box (env file, trainer, join card, status,
export, clean-up) and the Mac (join, uninstall, removal of its env file); the card and the env file are copied
from one to the other as the how-to says. The Mac's shell holds no credentials: only the handed-over env file
opens the bucket. The GPU box's shell also exports ``R2_ENDPOINT_URL`` (moto), as a jurisdiction user would.

Substitutions the test applies to the doc's text (``SUBSTITUTIONS``), so that it runs here in seconds:

- the env file's placeholder values -> moto's fake credentials; ``r2://stoa-fleet/fleet`` -> a fresh prefix of
  the moto bucket;
- ``pip install -e ".[trainer,worker,s3]"`` -> ``python -c "import stoa"`` (the test runs in the installed
  checkout; installing would need the network and change the test's environment);
- ``--model smollm2-135m`` -> ``--model tiny``, ``--device cuda`` -> ``--device cpu --eval-n 4`` (the
  trainer's evals before and after on 4 held-out prompts, not 64), ``--steps 500`` -> ``--steps 2``,
  ``--groups-per-step 16`` -> ``--groups-per-step 2`` (``--n-samples 8`` stays, as on the card);
  the trainer's block runs in the background (as under tmux), and once the Mac has joined the test starts two
  workers, so that the trainer steps, finishes, and the blocks after it see a ``finished`` run: the Mac's
  ``stoa join`` without ``--install-service`` (the worker in the terminal, as the doc says), which installs the
  card's worker key, and the GPU box's worker the doc names next to the trainer, with its own key; the run is
  on R2 with a run key, so ``worker_keys = auto`` (the default) requires every record to be signed, and every
  group the trainer used was signed by one of the two keys;
- ``stoa status ... --watch`` -> ``stoa status ... --json`` (one screen, parsed);
- ``--install-service`` -> ``--install-service --dry-run`` (no test loads a real service).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from stoa.bucket import open_bucket
from stoa.bucket.credentials import load_env_file
from stoa.layout import run_prefix
from stoa.lifecycle import read_status
from stoa.observe.audit import read_audit
from tests.bucket.conftest import MOTO_SECRET, TEST_BUCKET, moto_endpoint  # noqa: F401 - fixture

pytest.importorskip("moto", reason="the how-to runs against a moto S3 server (pip install 'moto[server]')")

DOC = Path(__file__).resolve().parents[2] / "docs" / "fleet.md"
TESTED_BLOCK = re.compile(r"<!-- tested -->\n```bash\n(.*?)```", re.DOTALL)
ANY_BLOCK = re.compile(r"^```bash\n", re.MULTILINE)
RUN = "arith-1"
DOC_BUCKET = "r2://stoa-fleet/fleet"
R2_PLACEHOLDERS = {"your-account-id": "moto", "your-access-key-id": "moto-key",
                   "your-secret-access-key": MOTO_SECRET}
SUBSTITUTIONS = [
    (r'pip install -e "\.\[trainer,worker,s3\]"', 'python -c "import stoa"'),
    (r"--model smollm2-135m", "--model tiny"),
    # The tiny random model never solves arithmetic: every group scores 0 and would be skipped.
    (r"--device cuda", "--device cpu --eval-n 4 --no-skip-uniform-groups"),
    (r"--steps 500", "--steps 2"),
    (r"--groups-per-step 16", "--groups-per-step 2"),
    (r"(stoa status .*) --watch$", r"\1 --json"),
    (r"(--install-service)$", r"\1 --dry-run"),
]
WORKER = ('stoa worker-key issue gpu-box --bucket "$BUCKET" --run "$RUN" && stoa worker --bucket "$BUCKET" --run '
          '"$RUN" --worker-key worker-$RUN-gpu-box.key')  # the doc's step 3, next to the trainer
MAC_WORKER = f"stoa join --card join-{RUN}.toml --env ~/.config/stoa/stoa-{RUN}.env --name mac-1"  # step 5, no service


class Machine(NamedTuple):
    """One machine of the how-to: its shell's variables, its HOME and its working directory."""

    env: dict[str, str]
    home: Path
    work: Path


def marked_blocks(bucket_url: str) -> list[str]:
    """The doc's tested blocks, in order, with the substitutions of the module docstring applied.

    Args:
        bucket_url: the moto bucket URL that replaces the doc's R2 bucket.
    """
    text = DOC.read_text()
    blocks = TESTED_BLOCK.findall(text)
    assert len(blocks) == len(ANY_BLOCK.findall(text)), "every bash block of docs/fleet.md must be marked tested"
    out = []
    for block in blocks:
        block = block.replace(DOC_BUCKET, bucket_url)
        for placeholder, value in R2_PLACEHOLDERS.items():
            block = block.replace(placeholder, value)
        for pattern, repl in SUBSTITUTIONS:
            block = re.sub(pattern, repl, block, flags=re.MULTILINE)
        out.append(block)
    return out


def shell(block: str, m: Machine) -> subprocess.CompletedProcess[str]:
    """Run one block in bash (-euo pipefail) on machine ``m``."""
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], env=m.env, cwd=m.work, capture_output=True,
                          text=True, timeout=120, check=False)


def background(block: str, m: Machine, log: Path) -> subprocess.Popen[bytes]:
    """Start one block in bash in the background, its output into ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], env=m.env, cwd=m.work, stdout=f,
                                stderr=subprocess.STDOUT)


def source_exports(block: str, m: Machine) -> dict[str, str]:
    """Run a block that exports variables and return the shell's environment after it (as ``source`` would)."""
    done = shell(block + '\nenv -0 > "$HOME/.env-after"', m)
    assert done.returncode == 0, done.stderr
    pairs = (m.home / ".env-after").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if p)


def machine(root: Path, env: dict[str, str]) -> Machine:
    """A machine under ``root`` with its own HOME, stoa cache and working directory."""
    (root / "home").mkdir(parents=True)
    (root / "work").mkdir()
    env = {**env, "HOME": str(root / "home"), "STOA_CACHE": str(root / "cache")}
    return Machine(env, root / "home", root / "work")


@pytest.fixture
def fleet(tmp_path, moto_endpoint):  # noqa: F811 - the imported fixture
    """The GPU box, the Mac and the bucket URL (a fresh prefix of the moto bucket)."""
    base = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "STOA_BUCKET_RETRY_TIMEOUT_S": "5", "RUN": RUN}
    if os.environ.get("PYTHONPATH"):
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    gpu = machine(tmp_path / "gpu", {**base, "R2_ENDPOINT_URL": moto_endpoint})
    mac = machine(tmp_path / "mac", base)
    r2 = {"R2_ACCOUNT_ID": "moto", "R2_ACCESS_KEY_ID": "moto-key", "R2_SECRET_ACCESS_KEY": MOTO_SECRET,
          "R2_ENDPOINT_URL": moto_endpoint}
    return {"gpu": gpu, "mac": mac, "r2": r2, "bucket": f"r2://{TEST_BUCKET}/howto-{uuid.uuid4().hex[:8]}"}


def wait_for_state(bucket_url: str, r2: dict[str, str], state: str, procs: list[subprocess.Popen[bytes]],
                   logs: list[Path], timeout_s: float) -> None:
    """Poll the run's status until it reads ``state``; fail with the background logs if a process died first."""
    bucket = open_bucket(bucket_url, r2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(bucket, RUN)
        if status is not None and status.state == state:
            return
        dead = [p.returncode for p in procs if p.poll() not in (None, 0)]
        assert not dead, f"exit codes {dead}:\n" + "\n".join(log.read_text()[-3000:] for log in logs)
        time.sleep(0.2)
    pytest.fail(f"run never reached {state!r}:\n" + "\n".join(log.read_text()[-3000:] for log in logs))


def join_mac(mac_block: str, fleet: dict) -> None:
    """Step 5 on the Mac, after the card and the env file were copied there."""
    gpu, mac = fleet["gpu"], fleet["mac"]
    for name in (f"join-{RUN}.toml", f"stoa-{RUN}.env"):
        shutil.copy2(gpu.work / name, mac.work / name)
    no_env = shell(f"stoa join --card join-{RUN}.toml --dry-run", mac)
    assert no_env.returncode == 9  # the Mac's shell holds no credentials: only the env file opens the bucket
    done = shell(mac_block, mac)
    assert done.returncode == 0, done.stdout + done.stderr
    env_file = mac.home / ".config" / "stoa" / f"stoa-{RUN}.env"
    assert load_env_file(env_file) == fleet["r2"] and stat.S_IMODE(os.stat(env_file).st_mode) == 0o600
    statuses = [line.split()[1:3] for line in done.stdout.splitlines() if line.startswith("[join] ") and
                line.split()[1] in ("ok", "warn", "fail")]
    assert statuses[:8] == [["ok", n] for n in ("engine", "blas", "tier", "disk", "bucket", "contract", "task-code",
                                                "retriever")]
    assert f"STOA_ENV_FILE={env_file}" in done.stdout and MOTO_SECRET not in done.stdout
    key_file = mac.home / ".config" / "stoa" / "keys" / f"worker-{RUN}-mac-1.key"
    assert f"--worker-key {key_file}" in done.stdout and not key_file.exists()  # dry runs only name it
    assert not (mac.home / ".config" / "systemd").exists()  # the install ran as a dry run


@pytest.mark.slow
def test_the_r2_howto_runs_as_written(fleet, tmp_path):
    env_block, trainer_block, card_block, mac_block, status_block, uninstall_block, export_block, cleanup_block, \
        rm_block = marked_blocks(fleet["bucket"])
    gpu, mac = fleet["gpu"], fleet["mac"]

    assert WORKER in DOC.read_text()
    exported = source_exports(env_block, gpu)  # step 2: the env file and the shell's variables
    r2_env = gpu.home / ".config" / "stoa" / "r2.env"
    assert stat.S_IMODE(os.stat(r2_env).st_mode) == 0o600
    assert (exported["STOA_ENV_FILE"], exported["BUCKET"], exported["RUN"]) == (str(r2_env), fleet["bucket"], RUN)
    gpu = gpu._replace(env={**gpu.env, **{k: exported[k] for k in ("STOA_ENV_FILE", "BUCKET", "RUN")}})

    logs = [tmp_path / "trainer.log", tmp_path / "worker.log", tmp_path / "mac.log"]
    trainer = background(trainer_block, gpu, logs[0])  # step 3
    procs = [trainer]
    try:
        wait_for_state(fleet["bucket"], fleet["r2"], "running", procs, logs[:1], timeout_s=120)
        done = shell(card_block, gpu)  # step 4
        assert done.returncode == 0, done.stderr
        card = tomllib.loads((gpu.work / f"join-{RUN}.toml").read_text())
        assert (card["bucket"], card["run"], card["n_samples"], card["task"]) == (fleet["bucket"], RUN, 8,
                                                                                  "arithmetic")
        assert card["credentials"] == ["R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_ENDPOINT_URL"]
        assert MOTO_SECRET not in (gpu.work / f"join-{RUN}.toml").read_text() and card["worker"] == "mac-1"
        assert stat.S_IMODE(os.stat(gpu.work / f"join-{RUN}.toml").st_mode) == 0o600  # it holds a worker key
        join_mac(mac_block, fleet)  # step 5, while the run is still running

        procs.append(background(WORKER, gpu, logs[1]))
        procs.append(background(MAC_WORKER, mac, logs[2]))
        wait_for_state(fleet["bucket"], fleet["r2"], "finished", procs, logs, timeout_s=180)
        assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=15)

    done = shell(status_block, gpu)  # step 6
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert (status["state"], status["step"]) == ("finished", 2) and [w["name"] for w in status["workers"]]
    assert "records must be signed by a worker key (worker_keys = auto" in logs[0].read_text()
    rows = read_audit(open_bucket(fleet["bucket"], fleet["r2"]), RUN).rows  # every group trained was signed
    assert rows and all(r.signature.startswith("signed ") for r in rows)
    assert {r.worker.rsplit("-", 1)[0] for r in rows} <= {"mac-1", "gpu-box"}

    done = shell(uninstall_block, mac)  # step 7
    assert done.returncode == 0, done.stderr

    done = shell(export_block, gpu)  # step 8
    assert done.returncode == 0, done.stderr
    model = gpu.work / "arith-1-model"
    assert (model / "model.safetensors").stat().st_size > 0
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"

    done = shell(cleanup_block, gpu)  # step 9
    assert done.returncode == 0, done.stderr
    assert list(open_bucket(fleet["bucket"], fleet["r2"]).list(run_prefix(RUN) + "/")) == []
    done = shell(rm_block, mac)
    assert done.returncode == 0, done.stderr
    assert not (mac.home / ".config" / "stoa" / f"stoa-{RUN}.env").exists()
    assert not list((mac.home / ".config" / "stoa" / "keys").glob("worker-*.key"))
