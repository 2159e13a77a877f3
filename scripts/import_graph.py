"""Print the figures of stoa's import graph: statements inside functions, lazy internal edges, cycles, and
what breaks the rules of tests/test_imports.py (layer order, lazy imports that save nothing).

    python scripts/import_graph.py            # figures
    python scripts/import_graph.py --list     # and every import that breaks a rule
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.import_graph import base_dependencies, counts, cycles, imports, layer_violations, lazy_violations  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Print the figures; with ``--list`` every import that breaks a rule. Returns 1 when any does."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--list", action="store_true", help="print every import that breaks a rule")
    args = p.parse_args(argv)
    imps, base = imports(), base_dependencies()
    for name, value in counts(imps).items():
        print(f"{name}: {value}")
    bad = {"layer order": layer_violations(imps), "lazy imports that save nothing": lazy_violations(imps, base),
           "cycles": [" <-> ".join(c) for c in cycles(imps)]}
    for rule, found in bad.items():
        print(f"{rule}: {len(found)} broken")
        if args.list:
            print("".join(f"  {x}\n" for x in found), end="")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
