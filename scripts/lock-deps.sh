#!/usr/bin/env bash
# Refresh constraints.txt on purpose: resolve stoa's extras afresh in a throw-away venv (newest versions
# allowed), run nothing, and write the exact versions pip chose. CI and the README install with
# `-c constraints.txt`, so main only moves to new versions when someone runs this, runs the tests
# (scripts/test-latest.sh does both) and commits the file.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q -e ".[trainer,worker,s3,dev,plot,data,rg,verifiers]"
{
  echo "# Exact versions CI and the README install (pip install -c constraints.txt ...)."
  echo "# Written by scripts/lock-deps.sh on $(date -u +%Y-%m-%d) with $("$venv/bin/python" --version) on $(uname -sm);"
  echo "# refresh it on purpose (scripts/test-latest.sh tests the newest versions first)."
  # torch's local label (+cpu, +cu128) is left out so one pin fits every platform's build.
  "$venv/bin/python" -m pip freeze --all | grep -vE '^(#|-e |stoa[ =@]|pip==|setuptools==|wheel==)' \
    | sed -E 's/^(torch==[^+]*)\+.*/\1/' | LC_ALL=C sort -f
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
