#!/usr/bin/env bash
# jaxpar on a real GPU: benchmarks/run.py (all workloads) and benchmarks/seed_002.py, in
# about five minutes, then benchmarks/gpu_suite.py under three CUDA-graph settings (up to
# half an hour each, usually much less), results as JSON under a results directory.
#
# Usage (from anywhere; uses the Python of $PYTHON, else .venv/bin/python, else python3):
#     bash benchmarks/gpu.sh [RESULTS_DIR]          # default: benchmarks/results/gpu-<time>
#     JAXPAR_NSYS=1 bash benchmarks/gpu.sh          # also an nsys trace of seed 002 (quick)
#     JAXPAR_SUITE=0 bash benchmarks/gpu.sh         # skip the GPU suite (the long part)
#
# It installs nothing. It needs, already installed in that Python: jax with CUDA
# (`pip install -e ".[cuda12]"` from the repo root) and jaxpar itself; it stops with that
# line if the backend is not a GPU. JAX_PLATFORMS is set to "cuda" (the scripts default to
# "cpu" otherwise). XLA_FLAGS from the environment are passed through unchanged; jaxpar's
# recommended flags are `python -c "import jaxpar; print(*jaxpar.xla_flags())"`.
#
# What to look at:
#   * run.json, per workload: variants.{plain,jaxpar_auto,jaxpar_gpu}.ratio_vs_plain -- the
#     median of per-pair time ratios against plain jax.jit (< 1 = jaxpar faster). On a GPU
#     "auto" resolves to "gpu", so the two jaxpar rows should agree; their gap is noise.
#     chain_control is the control: nothing to parallelize, its ratio should be ~1.00.
#     max_abs_diff must be ~0 (float32 reassociation only).
#   * run.json gpu_preview (source "this gpu"): the schedule XLA built on this GPU for
#     plain vs jaxpar -- loops/trips/kernels_per_trip (fused or batched scans run fewer,
#     fatter trips), async_calls_in_flight (>= 2 means stream regions may overlap) and
#     stream_ids. Compare with the deviceless H200 preview from a CPU run of run.py.
#   * seed_002.json: the seed user's two scans; "ratio_vs_plain" per variant, including the
#     hand-vmapped version the user wrote (the bar for "identical bodies").
#   * first_call_s: trace + plan + compile; jaxpar's extra compile time is a cost users pay.
#   * suite-{lhs,concurrent,off}.json/.txt (benchmarks/gpu_suite.py --measure, unless
#     JAXPAR_SUITE=0): every suite program timed plain vs jaxpar in one process, once per
#     CUDA-graph setting -- XLA's default (LHS scheduling mode), CONCURRENT mode, and graphs
#     off -- each row with "estimated_ratio", jaxpar._compiled.estimate's figure for the same
#     compiled programs under that mode: where measured and estimated ratios disagree, the
#     estimate's constants or its CUDA-graph assumptions are wrong (docs/gpu_evidence.md,
#     section 1.7).
#     xla-dump-<mode>/ holds XLA's dumps (--xla_dump_to), among them
#     *thunk_sequence_after_thunk_passes.txt: which thunks became CommandBufferThunks, i.e.
#     whether stream regions were captured into graphs.
#   * nsys (JAXPAR_NSYS=1, when `nsys` is on PATH): open seed_002.nsys-rep in Nsight
#     Systems, or read seed_002_kernsum.txt / seed_002_cuda_gpu_trace.csv: with target="gpu"
#     kernels of the two regions should sit on different CUDA streams and overlap in time;
#     with plain jax.jit everything runs on one stream. Few, long kernels per loop trip and
#     no cudaStreamSynchronize/memcpy per trip mean the loop stayed on the device.
set -uo pipefail

cd "$(dirname "$0")/.."
stamp=$(date +%Y%m%d-%H%M%S)
results=${1:-benchmarks/results/gpu-$stamp}
mkdir -p "$results"
if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3; fi
export JAX_PLATFORMS=cuda TF_CPP_MIN_LOG_LEVEL=3
started=$SECONDS

echo "results -> $results (python: $py)"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$py" -c "import jax, jaxlib, jaxpar; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'jaxpar', jaxpar.__version__)" 2>&1
  echo "XLA_FLAGS=${XLA_FLAGS:-}"
  uptime
} > "$results/env.txt"
cat "$results/env.txt"

if ! timeout 120 "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "JAX does not see a GPU with $py. Install jax with CUDA first, e.g." >&2
  echo "    $py -m pip install -e \".[cuda12]\"" >&2
  exit 1
fi

status=0
# Full sizes: on an H200 each workload takes seconds, most of it compiling.
timeout 200 "$py" benchmarks/run.py --repeats 10 --json "$results/run.json" \
  2>&1 | tee "$results/run.txt" || status=1
left=$(( 290 - (SECONDS - started) ))
if (( left > 20 )); then
  timeout "$left" "$py" benchmarks/seed_002.py --repeats 10 --json "$results/seed_002.json" \
    2>&1 | tee "$results/seed_002.txt" || status=1
else
  echo "skipping seed_002.py: ${left}s left of the five minutes" | tee "$results/seed_002.txt"
fi

if [[ "${JAXPAR_NSYS:-0}" == 1 ]]; then
  if command -v nsys >/dev/null 2>&1; then
    timeout 240 nsys profile -t cuda,nvtx --force-overwrite true -o "$results/seed_002" \
      "$py" benchmarks/seed_002.py --quick --repeats 3 > "$results/nsys.txt" 2>&1 || status=1
    nsys stats -r cuda_gpu_kern_sum "$results/seed_002.nsys-rep" \
      > "$results/seed_002_kernsum.txt" 2>&1 || true
    nsys stats -r cuda_gpu_trace -f csv -o "$results/seed_002" "$results/seed_002.nsys-rep" \
      > /dev/null 2>&1 || true
  else
    echo "JAXPAR_NSYS=1 but nsys is not on PATH; no trace" | tee "$results/nsys.txt"
  fi
fi

if [[ "${JAXPAR_SUITE:-1}" == 1 ]]; then
  for mode in lhs concurrent off; do
    # The flags of each CUDA-graph mode, as jaxpar spells them (lhs: XLA's defaults; off:
    # an empty command-buffer list, no graphs).
    mode_flags=$("$py" -c "import sys; from jaxpar._flags import command_buffer_flags; \
print(*command_buffer_flags(sys.argv[1]))" "$mode") || { status=1; continue; }
    dump="$results/xla-dump-$mode"
    mkdir -p "$dump"
    dump_flag="--xla_dump_to=$dump"
    if [[ "$dump" =~ [[:space:]] ]]; then  # XLA splits XLA_FLAGS on whitespace
      echo "no XLA dump: the results path holds whitespace ($dump)" >&2
      dump_flag=""
    fi
    echo "GPU suite, command buffers: $mode (XLA_FLAGS += $mode_flags $dump_flag)"
    XLA_FLAGS="${XLA_FLAGS:-} $mode_flags $dump_flag" \
      timeout 1800 "$py" benchmarks/gpu_suite.py --measure --command-buffers "$mode" \
      --timeout 300 --json "$results/suite-$mode.json" 2>&1 \
      | tee "$results/suite-$mode.txt" || status=1
  done
fi

echo "done in $((SECONDS - started)) s; results in $results (exit $status)"
exit "$status"
