#!/usr/bin/env bash
# Moves the test lanes' pins (tests/constraints-py3.11.txt, tests/constraints-py3.12.txt)
# to the newest versions pyproject.toml and tests/requirements-ecosystem.txt allow: each
# lane is installed afresh without constraints into .ci-venv/bump-py<lane>, and its
# `pip freeze` becomes the lane's constraints file. Then run the README's test command on
# the new pins (a changed constraints file makes scripts/test.sh reinstall) and commit the
# files only if it passes: a failure names the test, so the promise a release broke.
# .github/workflows/bump-constraints.yml runs this weekly and opens a pull request.
#
# Usage: bash scripts/bump_constraints.sh [3.11] [3.12]     (default: both lanes)
#        bash scripts/bump_constraints.sh --from DIR [lane...]
#            records the lanes already installed in DIR/py<lane> (e.g. .ci-venv, after a
#            passing test run) without installing anything.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
source scripts/lanes.sh

from=""
if [ "${1:-}" = --from ]; then from=${2:?--from needs a directory}; shift 2; fi
lanes=("$@"); if [ ${#lanes[@]} = 0 ]; then lanes=(3.11 3.12); fi

record() {  # $1 = the lane's virtual environment, $2 = lane: writes its constraints file
  local file="tests/constraints-py$2.txt" jax
  jax=$("$1/bin/python" -c "import importlib.metadata as m; print(m.version('jax'))")
  {
    echo "# The versions the py$2 test lane installs (pip -c; scripts/lanes.sh), jax $jax."
    echo "# Written by scripts/bump_constraints.sh on $(date -u +%F); do not edit by hand."
    "$1/bin/pip" freeze --exclude-editable | { grep -v '^#' || true; }
  } > "$file.new"
  mv "$file.new" "$file"
  echo "--- $file: jax $jax, $(grep -vc '^#' "$file") packages"
}

for lane in "${lanes[@]}"; do
  case $lane in 3.11|3.12) ;; *) echo "unknown lane $lane (use 3.11 and/or 3.12)" >&2; exit 2 ;; esac
  if [ -n "$from" ]; then record "$from/py$lane" "$lane"; continue; fi
  venv=".ci-venv/bump-py$lane" log=".ci-venv/install-bump-py$lane.log"
  rm -rf "$venv"; mkdir -p .ci-venv
  echo "--- installing the newest allowed versions into $venv (log: $log)"
  install_lane "$venv" "$lane" "" > "$log" 2>&1 ||
    { tail -n 40 "$log"; echo "installing into $venv failed (log: $log)"; exit 1; }
  record "$venv" "$lane"
done
echo "--- now run the tests on the new pins: JAXPAR_TEST_BROWSER=0 bash scripts/test.sh"
