#!/usr/bin/env bash
# Installs everything the tests need and runs them. What it installs (the first time, and
# again only when pyproject.toml, tests/requirements-ecosystem.txt or a lane's constraints
# file changes):
#   * Debian's `chromium`, system-wide with `sudo apt-get` (as root, without sudo), for the
#     browser test of the plan pictures; JAXPAR_TEST_BROWSER=0 leaves it out (that test
#     then skips, and the summary counts it);
#   * three virtual environments under .ci-venv/ (about 2.5 GB in all):
#       lint   ruff and mypy;
#       py3.11 jax 0.10.2 with the CUDA PJRT plugin, so the deviceless GPU-compile tests run
#              (no GPU is needed), plus flax, equinox and optax;
#       py3.12 the newest jax pyproject.toml allows (at the last bump), plus flax, equinox
#              and optax;
#     each at the versions of its tests/constraints-py<python>.txt (pip -c; scripts/lanes.sh),
#     those the suite last passed with: scripts/bump_constraints.sh moves them.
# The installs run side by side (they wait on downloads and unpacking more than on a core).
# Then pytest on both jax versions side by side (one job a core; ruff and mypy before the
# shorter job), a line per test file as it finishes, each job's full log in
# .ci-venv/<job>.log, and one summary with the slowest tests and files. Its last line
# counts what ran: "summary: N passed, M skipped, 0 failed; ruff and mypy: clean".
# How long it takes, with the date, the machine and that count of each measurement:
# docs/benchmarks.md, "The test command's time" (the one place that keeps them).
#
# Usage: bash scripts/test.sh [extra pytest args]
# The full matrices (longer): JAXPAR_FULL=1 bash scripts/test.sh
# Heavier property runs: JAXPAR_HYPOTHESIS_PROFILE=thorough bash scripts/test.sh
# One job only: JAXPAR_TEST_JOBS=3.11 (or 3.12) bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
started=$SECONDS

source scripts/lanes.sh  # find_python, install_lane and the lanes' jax pins

install_job() {  # $1 = lane (3.11, 3.12 or lint): into .ci-venv/py$1 (.ci-venv/lint)
  local venv log stamp constraints=tests/constraints-py${1/lint/3.11}.txt
  venv=".ci-venv/py$1"; if [ "$1" = lint ]; then venv=.ci-venv/lint; fi
  log=".ci-venv/install-${venv#.ci-venv/}.log"
  # Skipped when nothing it installs from has changed since the last run (the constraints
  # file included: a bump reinstalls): the editable install follows code changes by itself.
  stamp=$( { cat pyproject.toml tests/requirements-ecosystem.txt "$constraints" scripts/lanes.sh
             echo "$* $PWD"; } | cksum)
  if [ -f "$venv/.jaxpar-test-stamp" ] && [ "$(cat "$venv/.jaxpar-test-stamp")" = "$stamp" ] && {
       [ "$1" = lint ] ||
       "$venv/bin/python" -c "import jaxpar, os, sys; sys.exit(not jaxpar.__file__.startswith(os.getcwd()))" \
         >/dev/null 2>&1; }; then
    echo "--- $venv is up to date"; return 0
  fi
  echo "--- installing into $venv: the versions of $constraints"
  mkdir -p .ci-venv
  install_lane "$venv" "$1" "$constraints" > "$log" 2>&1 ||
    { tail -n 40 "$log"; echo "installing into $venv failed (log: $log)"; exit 1; }
  echo "$stamp" > "$venv/.jaxpar-test-stamp"
}

run_lint() {  # ruff and mypy; their output only when they find something
  local log=.ci-venv/lint.log
  rm -f .ci-venv/lint.failed
  if { .ci-venv/lint/bin/ruff check jaxpar tests examples benchmarks && \
       .ci-venv/lint/bin/mypy jaxpar tests; } > "$log" 2>&1; then
    echo "[lint] ruff and mypy: clean"
  else
    sed 's/^/[lint] /' "$log"; echo "[lint] ruff or mypy failed (log: $log)"
    touch .ci-venv/lint.failed; return 1
  fi
}

run_job() {  # $1 = python version, $2 = log name; the rest: pytest args. A line per test file.
  local venv=".ci-venv/py$1" log=".ci-venv/$2.log"
  # Without -q pytest writes one line per test file ("tests/test_api.py .... [ 12%]"); the
  # prefix tells the jobs apart.
  # pytest's output goes through tee into the log and the filter at once: no line is lost
  # (a `tail -f` beside it could miss the last ones); the status is pytest's.
  local plugin_left_out="" scripts_elsewhere=""
  if [ "$1" = 3.12 ]; then plugin_left_out=1; fi
  # With both lanes, the benchmark scripts' end-to-end runs only in the jax 0.10.2 one (the
  # TPU machine's jax; tests/helpers/environment.py's runs_scripts).
  if [ "$1" = 3.12 ] && [ "${split:-0}" = 1 ]; then scripts_elsewhere=1; fi
  JAXPAR_PLUGIN_LEFT_OUT=$plugin_left_out JAXPAR_SCRIPTS_ELSEWHERE=$scripts_elsewhere \
    "$venv/bin/python" -m pytest -p no:cacheprovider \
      --durations=15 -o console_output_style=count "${@:3}" 2>&1 | tee "$log" | \
    { grep --line-buffered -E '^tests/' || true; } | sed -u "s/^/[$2] /"
  return "${PIPESTATUS[0]}"
}

install_chromium() {  # Debian's headless Chromium, for the browser test of the plan pictures
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "${JAXPAR_TEST_BROWSER:-1}" = 0 ]; then
    echo "--- JAXPAR_TEST_BROWSER=0: no chromium; the browser test of the plan pictures skips"
    return 0
  fi
  echo "--- installing Debian's chromium system-wide with apt-get (headless browser for"
  echo "    tests/test_report_render.py; JAXPAR_TEST_BROWSER=0 leaves it and that test out)"
  local sudo=""; if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } \
    > .ci-venv/apt.log 2>&1 || { tail -n 40 .ci-venv/apt.log; echo "installing chromium failed"; exit 1; }
}

jobs=${JAXPAR_TEST_JOBS:-"3.11 3.12"}
for job in $jobs; do
  case $job in
    3.11|3.12) ;;
    *) echo "JAXPAR_TEST_JOBS: unknown job $job (use 3.11 and/or 3.12)" >&2; exit 2 ;;
  esac
done
jobs=$(printf '%s\n' $jobs | sort -u | tr '\n' ' '); jobs=${jobs% }  # each once, 3.11 first
# Ctrl-C or a kill stops the installs and jobs running in the background too.
trap 'kill $(jobs -p) 2>/dev/null; exit 130' INT TERM
# Every install at once (they wait on downloads and unpacking more than on a core).
mkdir -p .ci-venv
installs=()
install_chromium & installs+=($!)
for lane in lint $jobs; do
  install_job "$lane" & installs+=($!)
done
install_status=0
for install in "${installs[@]}"; do
  if ! wait "$install"; then install_status=1; fi
done
if [ "$install_status" != 0 ]; then echo "an install failed (above)"; exit 1; fi
echo "--- installed in $((SECONDS - started)) s"

# Two lanes, one a core: the jax 0.10.2 job (the longer one) in the first; ruff and mypy,
# then the other job, in the second. With both jobs and no pytest arguments, the second
# lane then runs MOVED, some of the first job's files (about as long as the first lane is
# longer), so the lanes end together. Its CPU seconds on jax 0.10.2 (2026-12-02):
# test_batch_matmuls 75. (test_tune, 13, went back to the first lane once that lane's
# benchmark-script and many-process tests got about 30 s shorter, the second's 15 s.)
MOVED=(tests/test_batch_matmuls.py)
echo "--- pytest on: $jobs, ruff and mypy before the last (a line per test file as it finishes)"
tests_started=$SECONDS
status=0
lanes=()
logs=()
last=${jobs##* }
split=0
if [ "$jobs" = "3.11 3.12" ] && [ $# = 0 ]; then split=1; fi
if [ "$jobs" = "$last" ]; then  # one job: lint in a lane of its own
  run_lint &
  lanes+=($!)
fi
for job in $jobs; do
  logs+=("py$job")
  if [ "$job" = "$last" ] && [ "$jobs" != "$last" ]; then
    if [ $split = 1 ]; then logs+=("py3.11-moved"); fi
    { lint=0; run_lint || lint=1; rc=0; run_job "$job" "py$job" "$@" || rc=1
      if [ $split = 1 ]; then run_job 3.11 py3.11-moved "${MOVED[@]}" || rc=1; fi
      exit $((rc | lint)); } &
  elif [ $split = 1 ] && [ "$job" = 3.11 ]; then
    ignored=(); for moved in "${MOVED[@]}"; do ignored+=("--ignore=$moved"); done
    run_job "$job" "py$job" "${ignored[@]}" &
  else
    run_job "$job" "py$job" "$@" &
  fi
  lanes+=($!)
done
for lane in "${lanes[@]}"; do
  if ! wait "$lane"; then status=1; fi
done

passed=0; failed=0; skipped=0
for name in "${logs[@]}"; do
  log=".ci-venv/$name.log"
  echo
  echo "=== $name: failures, slowest tests and summary (full log: $log)"
  sed -n '/= FAILURES =\|= ERRORS =\|slowest .* test files\|slowest .* durations\|short test summary/,$p' "$log" | \
    { grep -v '^tests/' || true; } | tail -n 120
  summary=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 || true)
  if [ -z "$summary" ]; then echo "$name: pytest printed no summary"; status=1; fi
  p=$( (grep -oE '[0-9]+ passed' <<<"$summary" || true) | awk '{n += $1} END {print n + 0}')
  f=$( (grep -oE '[0-9]+ (failed|errors?)' <<<"$summary" || true) | awk '{n += $1} END {print n + 0}')
  k=$( (grep -oE '[0-9]+ skipped' <<<"$summary" || true) | awk '{n += $1} END {print n + 0}')
  passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0})); skipped=$((skipped + ${k:-0}))
done
echo
echo "--- lint and tests took $((SECONDS - tests_started)) s; everything $((SECONDS - started)) s"
lint=clean; if [ -f .ci-venv/lint.failed ]; then lint=FAILED; status=1; fi
echo "summary: $passed passed, $skipped skipped, $failed failed; ruff and mypy: $lint"
if [ "$failed" -gt 0 ]; then status=1; fi
exit $status
