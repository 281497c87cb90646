# The test lanes and how one is installed; sourced by scripts/test.sh and
# scripts/bump_constraints.sh (run from the repository root).
#
#   lane   Python  jax                          extras
#   3.11   3.11    0.10.2, the CUDA PJRT plugin flax, equinox, optax (deviceless GPU compiles)
#   3.12   3.12    the newest our pins allow    flax, equinox, optax
#   lint   3.11    0.10.2                       ruff, mypy
#
# Each lane installs under the versions of tests/constraints-py<python>.txt (`pip -c`): the
# versions the suite last passed with, so a new patch release of jax, numpy or flax changes
# nothing until scripts/bump_constraints.sh moves the pins and the suite runs on them.
#
# Example:
#   source scripts/lanes.sh
#   install_lane .ci-venv/py3.12 3.12 tests/constraints-py3.12.txt

lane_jax_pin() {  # $1 = lane: the jax version it pins ("" = the newest allowed)
  case $1 in 3.11|lint) echo 0.10.2 ;; *) echo "" ;; esac
}

find_python() {  # $1 = major.minor
  local candidate
  for candidate in "python$1" "$(pyenv root 2>/dev/null)/versions/$1"*/bin/python \
                   "$HOME/.pyenv/versions/$1"*/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && \
       "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$1'.split('.')))" 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "no Python $1 found (install it, e.g. with pyenv)" >&2; return 1
}

# Installs lane $2 into the virtual environment $1, under the constraints file $3 ("" =
# none: the newest versions pyproject.toml and tests/requirements-ecosystem.txt allow).
# Its output goes to the caller; its status is the first failing step's (the steps are
# chained with && and `|| return`: bash turns `set -e` off inside a function whose status
# an `||` reads).
install_lane() {
  local venv=$1 lane=$2 constraints=$3 py jax jaxver
  py=$(find_python "${lane/lint/3.11}") || return 1
  jax=$(lane_jax_pin "$lane")
  local pins=() limits=()
  if [ -n "$jax" ]; then pins=("jax==$jax" "jaxlib==$jax"); fi
  if [ -n "$constraints" ]; then limits=(-c "$constraints"); fi
  { [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"; } &&
  "$venv/bin/pip" install -q --upgrade pip || return 1
  if [ "$lane" = lint ]; then
    "$venv/bin/pip" install -q "${limits[@]}" ruff mypy typing-extensions "${pins[@]}"
    return
  fi
  # The dependencies first: jaxpar's own (read from pyproject.toml) and the ecosystem's.
  "$venv/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    > "$venv/jaxpar-deps.txt" &&
  "$venv/bin/pip" install -q "${limits[@]}" -r "$venv/jaxpar-deps.txt" \
    -r tests/requirements-ecosystem.txt "${pins[@]}" &&
  # The editable install writes jaxpar.egg-info into the checkout: one at a time.
  mkdir -p .ci-venv &&
  flock .ci-venv/editable.lock "$venv/bin/pip" install -q "${limits[@]}" -e ".[test]" "${pins[@]}" ||
    return 1
  if [ "$lane" = 3.11 ]; then  # the CUDA PJRT plugin at exactly jaxlib's version
    jaxver=$("$venv/bin/python" -c "import jaxlib; print(jaxlib.__version__)") &&
    "$venv/bin/pip" install -q --no-deps "jax-cuda12-plugin==$jaxver" "jax-cuda12-pjrt==$jaxver"
  fi
}
