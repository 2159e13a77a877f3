"""Run ``stoa`` commands as forked processes of one warm server, with a timeout and captured output.

Starting ``python -m stoa`` costs seconds (torch, transformers); the hostile matrix starts hundreds of
clients. A ``forkserver`` (``multiprocessing``) imports stoa's CLI, torch and transformers once; each client is
a fresh fork of it running ``stoa.cli.main(argv)`` with its own environment, working directory and output
files, exactly as the ``stoa`` script would (an uncaught exception prints its traceback and exits 1). A client
past its timeout is killed and reported as a hang.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PRELOAD = "tests.hostile.preload"
"""Imported once by the fork server: every client forks with these modules loaded."""
HANG = -1
"""``Outcome.code`` of a client killed at its timeout."""
_ERROR_LINE = re.compile(r"^stoa(?: [\w-]+)?: ")


@dataclass(frozen=True)
class Outcome:
    """What one client run did.

    Args:
        code: its exit code; ``HANG`` when it was killed at its timeout; a negative signal number if a signal
            ended it.
        stdout: what it printed.
        stderr: what it printed on stderr.
        seconds: wall time.
    """

    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def traceback(self) -> bool:
        """Whether it printed a Python traceback."""
        return "Traceback (most recent call last)" in self.stderr + self.stdout

    @property
    def error_lines(self) -> list[str]:
        """Its ``stoa: ...`` (or ``stoa eval: ...``) error lines on stderr."""
        return [line for line in self.stderr.splitlines() if _ERROR_LINE.match(line)]

    @property
    def retrying(self) -> bool:
        """Killed at its timeout while refusing the planted object: its last line is a ``[client] refused ...``
        note (a worker waits for the trainer's next publish, as documented: "the worker retries by itself")."""
        said = [x for x in (self.stdout + "\n" + self.stderr).splitlines() if x.strip()]
        return self.code == HANG and bool(said) and re.match(r"\[\w+\] refused ", said[-1]) is not None

    def line(self) -> str:
        """The one line for the table: the error line, the last exception line of a traceback, or the client's
        refusal note when it went on (else ``ok``)."""
        if self.code == HANG:
            said = [x for x in (self.stdout + "\n" + self.stderr).splitlines() if x.strip()]
            what = "still refusing and retrying" if self.retrying else "hang"
            return f"{what} (killed after {self.seconds:.0f}s; its last line: {said[-1] if said else 'none'})"
        if self.traceback:
            last = [x for x in self.stderr.splitlines() if x.strip() and not x.startswith(" ")]
            return f"traceback: {last[-1] if last else '?'}"
        if self.error_lines:
            return self.error_lines[-1]
        notes = [x for x in (self.stdout + "\n" + self.stderr).splitlines()
                 if (x.startswith("[") or " WARNING " in x or " ERROR " in x)
                 and re.search(r"refus|reject|skipp|ignor|malformed|not verif|invalid|unreadable", x, re.I)]
        return f"ok: {notes[0]}" if notes else "ok"


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked client: the ``stoa`` script's behaviour, in a clean environment."""
    import tempfile
    import traceback

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process ends with os._exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    code = 1
    try:
        from stoa.cli import main

        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        Path(err).with_suffix(".code").write_text(str(code))  # the fork server's report can be lost (255)
        os._exit(code)


_CTX: multiprocessing.context.ForkServerContext | None = None


def _context() -> multiprocessing.context.ForkServerContext:
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD])
        _CTX = ctx
    return _CTX


@dataclass
class Running:
    """A started client (see :func:`start`); :meth:`wait` gives its :class:`Outcome`."""

    proc: multiprocessing.process.BaseProcess | subprocess.Popen
    out: Path
    err: Path
    started: float
    timeout: float

    def _alive(self) -> bool:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll() is None
        return self.proc.exitcode is None

    def wait(self, retried: int = 0) -> Outcome:
        """Wait until it exits or its timeout passes (then kill it).

        Args:
            retried: > 0: also stop it (as at its timeout) once it printed this many ``[client] refused`` notes:
                a client that refuses and retries would do so until its timeout.
        """
        while retried and self._alive() and time.monotonic() < self.started + self.timeout:
            text = self.out.read_text(errors="replace") if self.out.exists() else ""
            if len(re.findall(r"^\[\w+\] refused ", text, re.M)) >= retried:
                self.timeout = 0.0
                break
            time.sleep(0.25)
        left = max(0.0, self.started + self.timeout - time.monotonic())
        if isinstance(self.proc, subprocess.Popen):
            try:
                code = self.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                code = HANG
        else:
            self.proc.join(left)
            if self.proc.exitcode is None:
                self.proc.kill()
                self.proc.join()
                code = HANG
            else:
                code = self.proc.exitcode
                told = self.err.with_suffix(".code")
                code = int(told.read_text()) if told.is_file() and told.read_text() else code
        seconds = time.monotonic() - self.started
        read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        return Outcome(code, read(self.out), read(self.err), seconds)

    def stop(self) -> None:
        """Kill it if it still runs."""
        if isinstance(self.proc, subprocess.Popen):
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        elif self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()


def start(argv: list[str], env: dict[str, str], cwd: Path, logs: Path, name: str, timeout: float,
          spawn: bool = False) -> Running:
    """Start ``stoa argv`` forked from the warm server (or, ``spawn``, as a ``python -m stoa`` process).

    Args:
        argv: the command line after ``stoa``.
        env: its whole environment.
        cwd: its working directory.
        logs: where its stdout/stderr files go.
        name: the files' stem.
        timeout: seconds before :meth:`Running.wait` kills it.
        spawn: start a fresh interpreter instead of forking.
    """
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    err.with_suffix(".code").unlink(missing_ok=True)
    t0 = time.monotonic()
    if spawn:
        with open(out, "w") as o, open(err, "w") as e:
            popen = subprocess.Popen([sys.executable, "-m", "stoa", *argv], stdout=o, stderr=e, env=env, cwd=cwd)
        return Running(popen, out, err, t0, timeout)
    fork = _context().Process(target=_child, args=(argv, env, str(cwd), str(out), str(err)), daemon=True)
    fork.start()
    return Running(fork, out, err, t0, timeout)


def run(argv: list[str], env: dict[str, str], cwd: Path, logs: Path, name: str, timeout: float,
        spawn: bool = False, retried: int = 0) -> Outcome:
    """:func:`start` then wait for it (see :meth:`Running.wait` for ``retried``)."""
    return start(argv, env, cwd, logs, name, timeout, spawn).wait(retried)
