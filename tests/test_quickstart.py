"""``stoa quickstart``: ``--bucket`` and its deprecated spelling ``--dir``, and the tiny quickstart commands the
README and docs promise a run time for, run as documented: they finish, reach their steps, and the commands their
summary names (``stoa status``, ``stoa plot``) work on the bucket they left."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoa.cli import main
from stoa.cli.quickstart import DEFAULT_BUCKET, bucket_arg, thread_split
from stoa.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TIMED = re.compile(r"~\s*\d+\s*(s|min)\b|under a minute|\d+\s*(s|min) on ")
"""A run-time claim on a documentation line."""


def test_dir_is_a_deprecated_spelling_of_bucket_with_one_warning_line(capsys):
    assert bucket_arg(None, None) == DEFAULT_BUCKET and bucket_arg("b", None) == "b"
    assert capsys.readouterr().err == ""
    assert bucket_arg(None, "old") == "old" and bucket_arg("old", "old") == "old"
    warning = "stoa quickstart: --dir is deprecated, use --bucket (same meaning)"
    assert capsys.readouterr().err.splitlines() == [warning] * 2
    with pytest.raises(ConfigError, match="--bucket 'a' and --dir 'b' disagree"):
        bucket_arg("a", "b")


@pytest.mark.parametrize(("cores", "workers"), [(2, 2), (2, 1), (1, 2), (16, 2), (8, 7)])
def test_the_trainer_takes_every_core_and_each_worker_its_share(cores, workers):
    """The trainer is the quickstart's bottleneck (the workers wait on its versions): on 2 cores with 2 workers it
    gets 2 threads, not the 1 left over after the workers' shares (measured 14.0 against 19.7 min)."""
    per_worker, trainer = thread_split(cores, workers)
    assert trainer == cores
    assert per_worker == max(1, cores // (workers + 1)) and per_worker * workers <= max(cores, workers)


def test_disagreeing_bucket_and_dir_exit_2_in_one_line_writing_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["quickstart", "--model", "tiny", "--bucket", "a", "--dir", "b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bucket 'a' and --dir 'b' disagree" in err[0]
    assert list(tmp_path.iterdir()) == []


def documented_tiny_quickstarts() -> dict[str, str]:
    """Every ``stoa quickstart ... --model tiny ...`` command of README.md and docs/*.md on a line that claims a
    run time, by command (the line, for the failure message)."""
    found = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            for m in re.finditer(r"stoa quickstart[^`#(]*", line):
                cmd = " ".join(m.group(0).split())
                if "--model tiny" in cmd and TIMED.search(line):
                    found[cmd] = f"{doc.name}: {line.strip()}"
    return found


def test_the_documented_tiny_quickstarts_include_the_two_promised():
    assert {"stoa quickstart --model tiny --steps 5", "stoa quickstart --task search --model tiny --steps 3"} <= \
        set(documented_tiny_quickstarts())


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(documented_tiny_quickstarts()))
def test_a_documented_tiny_quickstart_finishes_and_reaches_its_steps(command, tmp_path, stoa_cache):
    """Each takes 15-30 s on 2 free cores; the limit leaves room for a loaded machine, not for a stall."""
    env = {**os.environ, "STOA_CACHE": str(stoa_cache), "PYTHONPATH": str(ROOT)}
    argv = shlex.split(command)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stoa", *argv[1:]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    steps = int(argv[argv.index("--steps") + 1])
    assert re.search(rf"^  steps +{steps} \(now at v{steps + 1}\)$", proc.stdout, re.M), out[-3000:]
    print(f"\n{command}: {wall:.1f}s")
    plot = () if importlib.util.find_spec("matplotlib") is None else ("plot",)  # the plot extra
    for name in ("status", *plot):  # the commands the summary names work on the bucket it left
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"  {name} "))
        named = shlex.split(line.split(None, 1)[1].split("  (")[0])
        assert named[:2] == ["stoa", name]
        done = subprocess.run([sys.executable, "-m", "stoa", *named[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    logs = next(ln for ln in proc.stdout.splitlines() if ln.startswith("  worker logs "))
    assert Path(logs.split()[-1].replace("<i>", "0")).is_file()
