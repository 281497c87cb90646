#!/usr/bin/env bash
# Installs everything the tests need and runs them on the two JAX versions we
# support at the ends of our range:
#   * Python 3.11 + jax 0.10.2, with the CUDA PJRT plugin so the deviceless
#     GPU-compile tests run;
#   * Python 3.12 + the newest jax our pins allow.
# Usage: bash scripts/test.sh [extra pytest args]
# Heavier property runs: JAXPAR_HYPOTHESIS_PROFILE=thorough bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TF_CPP_MIN_LOG_LEVEL=3

find_python() {  # $1 = major.minor
  for candidate in "python$1" "$(pyenv root 2>/dev/null)/versions/$1"*/bin/python \
                   "$HOME/.pyenv/versions/$1"*/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && \
       "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$1'.split('.')))" 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "no Python $1 found (install it, e.g. with pyenv)" >&2; return 1
}

run_job() {  # $1 = python version, $2 = jax pin ("" = newest allowed), $3 = "plugin" or ""
  local py venv jaxver
  py=$(find_python "$1")
  venv=".ci-venv/py$1"
  echo "=== Python $1, jax ${2:-newest} ==="
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  if [ -n "$2" ]; then
    "$venv/bin/pip" install -q -e ".[test]" "jax==$2" "jaxlib==$2"
  else
    "$venv/bin/pip" install -q -e ".[test]"
  fi
  "$venv/bin/pip" install -q -r tests/requirements-ecosystem.txt
  if [ "$3" = plugin ]; then
    jaxver=$("$venv/bin/python" -c "import jaxlib; print(jaxlib.__version__)")
    "$venv/bin/pip" install -q --no-deps "jax-cuda12-plugin==$jaxver" "jax-cuda12-pjrt==$jaxver"
  fi
  "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "${@:4}"
}

# Headless Chromium for the browser test of the plan pictures (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
fi

.ci-venv/lint/bin/ruff --version >/dev/null 2>&1 || { python3 -m venv .ci-venv/lint && .ci-venv/lint/bin/pip install -q ruff mypy "jax==0.10.2" "jaxlib==0.10.2" typing-extensions; }
.ci-venv/lint/bin/ruff check jaxpar tests examples benchmarks
.ci-venv/lint/bin/mypy jaxpar

run_job 3.11 0.10.2 plugin "$@"
run_job 3.12 "" "" "$@"
