"""docs/your-task.md's command blocks, every one, run in order in one working directory on a local bucket.

Substitutions the test applies so that it runs in about a minute: ``--model smollm2-135m`` -> ``--model tiny``
(a random model, so the trainer also gets ``--no-skip-uniform-groups --eval-n 4``: every tiny group scores 0),
``--steps 30`` -> ``--steps 2``, ``--eval-n 64`` -> ``--eval-n 4``. Blocks marked ``tested background`` start in
the background (the trainer, then its worker) and the test waits for both to finish before the next block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "your-task.md"
BLOCK = re.compile(r"<!-- tested( background)? -->\n```bash\n(.*?)```", re.DOTALL)
ANY_BLOCK = re.compile(r"^```bash\n", re.MULTILINE)
SUBSTITUTIONS = [
    (r"stoa quickstart (.*) --model smollm2-135m --steps 30", r"stoa quickstart \1 --model tiny --steps 2"),
    (r"stoa trainer (.*) --model smollm2-135m (.*) --steps 30",
     r"stoa trainer \1 --model tiny \2 --steps 2 --no-skip-uniform-groups --eval-n 4 --device cpu"),
    (r"--eval-n 64", "--eval-n 4"),
]


def blocks() -> list[tuple[bool, str]]:
    """(runs in the background, the block's text with the substitutions applied), in the doc's order."""
    text = DOC.read_text()
    found = BLOCK.findall(text)
    assert len(found) == len(ANY_BLOCK.findall(text)), "every bash block of docs/your-task.md must be tested"
    out = []
    for background, block in found:
        for pattern, repl in SUBSTITUTIONS:
            block = re.sub(pattern, repl, block, flags=re.MULTILINE)
        out.append((bool(background), block))
    return out


def test_the_substitutions_each_apply() -> None:
    joined = "\n".join(b for _, b in blocks())
    assert "smollm2-135m" not in joined and "--steps 30" not in joined and "--eval-n 64" not in joined


@pytest.mark.slow
def test_your_task_tutorial_runs_as_written(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "STOA_CACHE": str(tmp_path / "cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    running: list[subprocess.Popen[bytes]] = []
    outputs: list[str] = []
    for background, block in blocks():
        if background:
            log = open(tmp_path / f"bg{len(running)}.log", "wb")  # noqa: SIM115 - closed with the process
            running.append(subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env,
                                            stdout=log, stderr=subprocess.STDOUT))
            continue
        for proc in running:  # the fleet's processes finish before the blocks after them
            assert proc.wait(timeout=300) == 0, (tmp_path / f"bg{running.index(proc)}.log").read_text()[-3000:]
        running = []
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, block + "\n" + done.stdout[-3000:] + done.stderr[-3000:]
        outputs.append(done.stdout + done.stderr)
    task, quickstart, card, refused, status = outputs[1:]
    assert "answer \"" in task and task.count("reward 1; an empty completion: 0") == 3
    assert "code every worker needs: reward (copy the trainer's reward.py" in task
    assert "held-out acc" in quickstart
    assert re.search(r"task code:\s+reward\.py sha256:[0-9a-f]{64}", card)
    assert "stoa: task code: the run's task code 'reward' differs here" in refused
    assert "refused with exit 16" in refused
    assert re.search(r"^state\s+finished", status, re.MULTILINE) and "eval acc" in status
    follower = (tmp_path / "bg2.log").read_text()
    assert re.search(r"^\[eval\] v3: accuracy", follower, re.MULTILINE) and "finished at v3" in follower
