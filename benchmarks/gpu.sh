#!/usr/bin/env bash
# The first GPU run: calibrate jaxpar's GPU model on this GPU (under five minutes), then
# time a handful of GPU-suite programs plain vs jaxpar beside the model's estimate of the
# same compiled programs. Well under ten minutes in all; results under a results folder.
#
# Usage (from anywhere; uses the Python of $PYTHON, else .venv/bin/python, else python3):
#     bash benchmarks/gpu.sh [RESULTS_DIR]         # default: benchmarks/results/gpu-<time>
#     bash benchmarks/gpu.sh --dry-run [RESULTS_DIR]   # on a CPU: every step at tiny sizes,
#                                                  # the GPU-only ones skipped (a test runs it)
#     JAXPAR_SUITE_PROGRAMS=a,b bash benchmarks/gpu.sh # other suite programs
#
# It installs nothing and needs no network. It needs jax with CUDA and the suite's
# libraries (flax, equinox, optax) in that Python, and runs jaxpar from this tree
# (PYTHONPATH=.). JAX_PLATFORMS is set to "cuda" ("cpu" for --dry-run). XLA_FLAGS from the
# environment are passed through; each suite run adds its CUDA-graph mode to them.
#
# Steps and what to look at:
#   1. benchmarks/calibrate.py (timeout 300 s): calibration.json / calibrate.txt -- the
#      in-graph floor of a dependent kernel (graph_floor_s), launches outside graphs
#      (launch_s), host cost of a graph launch for a 50-node chain (lhs) vs a 50-node
#      fan-out (concurrent) (graph_launch_s, chain_node_s, dag_node_s), then eight
#      independent small elementwise chains and eight independent 1024^3 bf16 GEMMs in
#      lhs, concurrent and concurrent_regions mode (measurements.concurrency: times and
#      ratios to lhs), bandwidth and matmul peaks. The same profile is installed where
#      jaxpar looks for this GPU ($JAXPAR_PROFILE_DIR/<device kind>.json, default
#      ~/.cache/jaxpar/profiles), so step 2 prices with it.
#      xla-dump/<program>-<mode>/*thunk_sequence_after_thunk_passes.txt: the CUDA graphs
#      XLA formed for the calibration programs (kCommandBuffer and its nodes; calibrate.txt
#      sums them up: nodes and source nodes of each graph).
#   2. benchmarks/gpu_suite.py --measure for a handful of programs, first with graphs in
#      lhs mode (set explicitly, so jaxpar keeps it), then in concurrent_regions and
#      concurrent mode while time is left: suite-<mode>.json / .txt, one row per program
#      with the measured ratio
#      jaxpar / plain (medians of 20 interleaved calls in one process) and the estimated
#      ratio of the same compiled executables with the calibrated profile. Where the two
#      disagree, the model's figures or its CUDA-graph assumptions are wrong
#      (docs/xla.md, "CUDA graphs (command buffers)").
set -uo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
cd "$(dirname "$0")/.."
stamp=$(date +%Y%m%d-%H%M%S)
results=${1:-benchmarks/results/gpu-$stamp}
mkdir -p "$results"
if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3; fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=3
programs=${JAXPAR_SUITE_PROGRAMS:-gptj_parallel_block,moe_4_experts,three_towers,optax_adamw_step,seed_002_two_scans}
total_s=540  # the whole script, calibration included
if (( dry_run )); then
  export JAX_PLATFORMS=cpu
  programs=${JAXPAR_SUITE_PROGRAMS:-three_towers}
  calibrate_flags=(--dry-run --device-kind "NVIDIA H200")
  suite_flags=(--size small)
  modes=(lhs)
  echo "dry run on the CPU: tiny sizes; skipped (they need a GPU): the GPU check," \
    "installing the profile, the XLA thunk dumps, the concurrent-mode suite run"
else
  export JAX_PLATFORMS=cuda
  calibrate_flags=(--install --dump-dir "$results/xla-dump")
  suite_flags=()
  modes=(lhs concurrent_regions concurrent)
fi
started=$SECONDS
status=0

echo "results -> $results (python: $py)"
{
  date -u
  if (( ! dry_run )); then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  fi
  "$py" -c "import jax, jaxlib, jaxpar; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'jaxpar', jaxpar.__version__, 'backend', jax.default_backend())" 2>&1
  echo "XLA_FLAGS=${XLA_FLAGS:-}"
  echo "JAXPAR_PROFILE_DIR=${JAXPAR_PROFILE_DIR:-}"
} > "$results/env.txt"
cat "$results/env.txt"

if (( ! dry_run )) && ! timeout 120 "$py" -c \
    "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "JAX does not see a GPU with $py: install jax with CUDA there first" >&2
  exit 1
fi

# 1. Calibration: the four quantities first, the throughput figures if time is left.
echo "== 1. calibration (benchmarks/calibrate.py)"
timeout 300 "$py" benchmarks/calibrate.py "${calibrate_flags[@]}" \
  --out "$results/calibration.json" 2>&1 | tee "$results/calibrate.txt" || status=1
if (( ! dry_run )) && [[ -d "$results/xla-dump" ]]; then
  echo "thunk sequences (the CUDA graphs XLA formed):"
  find "$results/xla-dump" -name "*thunk_sequence_after_thunk_passes.txt" | sort
fi

# 2. Measured against estimated, a handful of suite programs per CUDA-graph mode.
for mode in "${modes[@]}"; do
  left=$(( total_s - (SECONDS - started) ))
  if (( left < 60 )); then
    echo "skipping the suite in $mode mode: ${left}s left" | tee "$results/suite-$mode.txt"
    continue
  fi
  # The mode as an explicit flag (lhs too), so that jaxpar keeps it instead of choosing.
  mode_flag="--xla_gpu_command_buffer_scheduling_mode=${mode^^}"
  echo "== 2. GPU suite, measured vs estimated, $mode mode (XLA_FLAGS += $mode_flag)"
  XLA_FLAGS="${XLA_FLAGS:-} $mode_flag" timeout "$left" "$py" benchmarks/gpu_suite.py \
    --measure --command-buffers "$mode" --programs "$programs" --timeout 120 \
    ${suite_flags[@]+"${suite_flags[@]}"} --json "$results/suite-$mode.json" 2>&1 \
    | tee "$results/suite-$mode.txt" || status=1
done

echo "done in $((SECONDS - started)) s; results in $results (exit $status)"
exit "$status"
