#!/usr/bin/env bash
# The scheduled check of the newest dependency versions (weekly, see .github/workflows/latest.yml; or by hand):
# install stoa into a fresh venv WITHOUT constraints.txt, print every version that differs from the pins,
# and run the README's test command. Main stays on constraints.txt whatever this finds; when it is green,
# scripts/lock-deps.sh moves the pins forward.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q --upgrade -e ".[trainer,worker,s3,dev]"
echo "== versions that differ from constraints.txt"
python -m pip freeze --all | sed -E 's/^(torch==[^+]*)\+.*/\1/' | LC_ALL=C sort -f > "$venv/../now.txt"
grep -v '^#' constraints.txt | LC_ALL=C sort -f | comm -13 - "$venv/../now.txt" | grep -vE '^(#|-e |stoa)' || echo "(none)"
echo "== tests"
python -m pytest -q
