"""docs/fleet.md's tested blocks, run in order against a local S3 endpoint (moto) with the R2 variables.

The operator's blocks (join-card, clean-up) run with ``STOA_ENV_FILE`` naming a 0600 file of R2 variables
(``R2_ENDPOINT_URL`` points them at moto); the joiner's blocks run with no credentials in the environment,
so only the handed-over env file can open the bucket. ``--install-service`` lines get ``--dry-run`` added:
no test loads a real service. The trainer's block is replaced by writing the run's contract.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from stoa.bucket.credentials import load_env_file
from stoa.layout import run_prefix
from tests.bucket.conftest import MOTO_SECRET, TEST_BUCKET, moto_endpoint  # noqa: F401 - fixture
from tests.join.conftest import write_run

pytest.importorskip("moto", reason="the how-to runs against a moto S3 server (pip install 'moto[server]')")

DOC = Path(__file__).resolve().parents[2] / "docs" / "fleet.md"
TESTED_BLOCK = re.compile(r"<!-- tested -->\n```bash\n(.*?)```", re.DOTALL)
RUN = "arith-1"


def marked_blocks() -> list[str]:
    """The doc's blocks marked tested, in order, with ``--dry-run`` added to ``--install-service`` lines."""
    blocks = TESTED_BLOCK.findall(DOC.read_text())
    return [re.sub(r"(--install-service)$", r"\1 --dry-run", b, flags=re.MULTILINE) for b in blocks]


def shell(block: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture
def howto(tmp_path, moto_endpoint):  # noqa: F811 - the imported fixture
    """The two machines' environments, the bucket URL, and the run written into it."""
    r2 = {"R2_ACCOUNT_ID": "moto", "R2_ACCESS_KEY_ID": "moto-key", "R2_SECRET_ACCESS_KEY": MOTO_SECRET,
          "R2_ENDPOINT_URL": moto_endpoint}
    creds = tmp_path / "r2.env"
    creds.write_text("".join(f"{k}={v}\n" for k, v in r2.items()))
    creds.chmod(0o600)
    bucket = f"r2://{TEST_BUCKET}/howto-{uuid.uuid4().hex[:8]}"
    write_run(open_bucket(bucket, r2), RUN, task="arithmetic", state="running")
    base = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(tmp_path / "home"), "STOA_CACHE": str(tmp_path / "cache"), "BUCKET": bucket, "RUN": RUN,
            "STOA_BUCKET_RETRY_TIMEOUT_S": "5"}
    if os.environ.get("PYTHONPATH"):
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    return {"operator": {**base, "STOA_ENV_FILE": str(creds)}, "joiner": base, "r2": r2, "bucket": bucket,
            "work": work, "home": tmp_path / "home"}


def test_the_r2_howto_runs_as_written(howto):
    card_block, mac_block, uninstall_block, cleanup_block = marked_blocks()
    work, home = howto["work"], howto["home"]

    done = shell(card_block, howto["operator"], work)
    assert done.returncode == 0, done.stderr
    card = tomllib.loads((work / f"join-{RUN}.toml").read_text())
    assert (card["bucket"], card["run"], card["n_samples"], card["task"]) == (howto["bucket"], RUN, 8, "arithmetic")
    assert card["credentials"] == ["R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_ENDPOINT_URL"]
    assert MOTO_SECRET not in (work / f"join-{RUN}.toml").read_text()
    assert stat.S_IMODE(os.stat(work / f"stoa-{RUN}.env").st_mode) == 0o600

    no_env = shell(f"stoa join --card join-{RUN}.toml --dry-run", howto["joiner"], work)
    assert no_env.returncode == 9  # the joiner's environment holds no credentials: only the env file opens it

    done = shell(mac_block, howto["joiner"], work)
    assert done.returncode == 0, done.stdout + done.stderr
    env_file = home / ".config" / "stoa" / f"stoa-{RUN}.env"
    assert load_env_file(env_file) == howto["r2"]
    statuses = [line.split()[1:3] for line in done.stdout.splitlines() if line.startswith("[join] ") and
                line.split()[1] in ("ok", "warn", "fail")]
    assert statuses[:7] == [["ok", n] for n in ("engine", "blas", "tier", "disk", "bucket", "contract", "retriever")]
    assert f"STOA_ENV_FILE={env_file}" in done.stdout and MOTO_SECRET not in done.stdout
    assert not (home / ".config" / "systemd").exists()  # the install ran as a dry run

    done = shell(uninstall_block, howto["joiner"], work)
    assert done.returncode == 0, done.stderr

    done = shell(cleanup_block, howto["operator"], work)
    assert done.returncode == 0, done.stderr
    assert list(open_bucket(howto["bucket"], howto["r2"]).list(run_prefix(RUN) + "/")) == []
