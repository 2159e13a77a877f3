"""Plant crafted objects in live tiny runs, start each client against them, print the Markdown table.

    PYTHONPATH=. python scripts/hostile_table.py                 # each object x the clients that read it
    PYTHONPATH=. python scripts/hostile_table.py --all           # each object x every client
    PYTHONPATH=. python scripts/hostile_table.py --only pointer --only journal --clients trainer,status

Rows are ``object:variant``, columns clients; a cell is the exit code and the one line the client printed
(``ok`` when it went on quietly), with the failed checks in bold (see tests/hostile/cell.py for the checks).
Exit status: 0 when every cell passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hostile.matrix import Bases, cells, run_cells, summary, table, timed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the matrix and print the table; returns 0 when every cell passed."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--all", action="store_true", help="start every client against every object")
    p.add_argument("--only", action="append", default=[], help="object types to plant (repeatable)")
    p.add_argument("--clients", default="", help="comma-separated clients to start [default: all]")
    p.add_argument("--variants", default="", help="comma-separated variants to plant [default: all]")
    p.add_argument("--jobs", type=int, default=2, help="cells run at a time [default: 2]")
    p.add_argument("--work", default="", help="working directory [default: a new temporary one]")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="stoa-hostile-"))
    todo = cells(args.all, args.only)
    if args.variants:
        todo = [c for c in todo if c.variant in args.variants.split(",")]
    if args.clients:
        todo = [c for c in todo if c.client in args.clients.split(",")]
    from stoa.models import resolve_model

    model_cache = work / "model-cache"
    resolve_model("tiny", cache_dir=model_cache)
    the_bases = Bases(work / "bases", model_cache)

    def echo(r):
        print(f"{'ok  ' if r.passed else 'FAIL'} {r.obj}:{r.variant} x {r.client}: {r.outcome.code} "
              f"{r.outcome.line()[:100]} {r.problems} ({r.outcome.seconds:.1f}s)", file=sys.stderr, flush=True)

    results, seconds = timed(lambda: run_cells(todo, the_bases, work, echo, args.jobs))
    print(table(results))
    print()
    print(summary(results, seconds))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
