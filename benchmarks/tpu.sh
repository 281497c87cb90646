#!/usr/bin/env bash
# jaxpar measured on a TPU in one call: calibration, then the seed's loops, the GPU suite
# and the battery's loops (benchmarks/tpu.py), the per-call cost (benchmarks/dispatch.py);
# the default parts take about eight minutes on a TPU v5e (seeds 1, suite 4-5, battery 1,
# calibration and per-call cost 1), under the device's ten-minute limit per command. The
# held-out loop programs (loops, about 2 minutes) and the tuner (tune, about 1) run when
# named. Results (JSON and the printed tables) under a results folder; docs/benchmarks.md,
# "Measured on TPU v5e", quotes them.
#
# Usage (from the repository root, on a TPU machine with jax installed):
#     bash benchmarks/tpu.sh [--dry-run] [RESULTS_DIR [PARTS [TPU_PY_ARGS...]]]
#   PARTS: comma-separated among calibrate,seeds,suite,dispatch,battery,loops,tune
#     (default calibrate,seeds,suite,dispatch,battery)
#   TPU_PY_ARGS: passed on to benchmarks/tpu.py for its parts (seeds, suite, battery,
#     loops; tune takes none of them), e.g. --rounds 9 --budget 480 --only attention
#   --dry-run: every step at tiny sizes on this machine's CPU (a test runs it)
# It exits with 1 when a part failed (each part's output says why).
#
# It runs $PYTHON (default python3) with jaxpar from this tree (PYTHONPATH gets the
# repository root first) and needs flax, optax and equinox for the suite's framework
# programs: where they are missing it installs them into $JAXPAR_TPU_SITE (default
# /tmp/jaxpar-site, added at the END of PYTHONPATH so the machine's own jax stays first)
# from a local package index (JAXPAR_TPU_INDEX, default file:///opt/pypi/simple) and
# wheels in .whl-tpu/.
set -uo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
quick=()
if [ "${1:-}" = "--dry-run" ]; then
  quick=(--quick); export JAX_PLATFORMS=cpu; shift
  out=${1:-$(mktemp -d)}
else
  out=${1:-benchmarks/results/tpu-$(date +%Y%m%d-%H%M%S)}
fi
parts=${2:-calibrate,seeds,suite,dispatch,battery}
for given in "$out" "$parts"; do
  case $given in
    -*) echo "tpu.sh: options for benchmarks/tpu.py come after RESULTS_DIR and PARTS" \
             "(got $given there)" >&2; exit 2 ;;
  esac
done
more=("${@:3}")
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
site=${JAXPAR_TPU_SITE:-/tmp/jaxpar-site}
if ! "$PY" -c "import flax, optax, equinox" >/dev/null 2>&1; then
  export PYTHONPATH="$PYTHONPATH:$site"
  if ! "$PY" -c "import flax, optax, equinox" >/dev/null 2>&1; then
    echo "--- installing flax, optax and equinox into $site" | tee -a "$out/log.txt"
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: \
      --index-url "${JAXPAR_TPU_INDEX:-file:///opt/pypi/simple}" --target "$site" \
      flax optax jaxtyping wadler-lindig >>"$out/log.txt" 2>&1 || echo "flax/optax: install failed"
    if compgen -G ".whl-tpu/*.whl" >/dev/null; then
      PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-index --no-deps \
        --no-compile --upgrade --target "$site" .whl-tpu/*.whl >>"$out/log.txt" 2>&1 \
        || echo "equinox: install failed"
    fi
  fi
fi
failed=()
run() {  # $1 = name, rest = command
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$out/log.txt"
  local start=$SECONDS
  "$@" 2>&1 | grep -v "cuda_\|absl::\|hugepages\|warnings.warn" | tee -a "$out/$name.txt"
  local status=${PIPESTATUS[0]} end=""
  if [ "$status" != 0 ]; then failed+=("$name"); end=", failed (exit $status)"; fi
  echo "=== $name: $((SECONDS - start)) s$end" | tee -a "$out/log.txt"
}
# "${a[@]+"${a[@]}"}": an empty array under set -u, on bash before 4.4 too.
for part in ${parts//,/ }; do
  case $part in
    calibrate) run calibrate "$PY" benchmarks/calibrate_tpu.py --json "$out/calibration.json" \
                 ${quick[@]+"${quick[@]}"} ;;
    dispatch) run dispatch "$PY" benchmarks/dispatch.py --json "$out/dispatch.json" --budget 150 \
                ${quick[@]+--rounds 1 --calls 3} ;;
    seeds|suite|battery|loops|tune) run "$part" "$PY" benchmarks/tpu.py --parts "$part" \
        --out "$out" ${quick[@]+"${quick[@]}"} ${more[@]+"${more[@]}"} ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
echo "results in $out"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" | tee -a "$out/log.txt"; exit 1
fi
