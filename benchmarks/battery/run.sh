#!/bin/bash
# The adversarial battery, two programs at a time, 600 s each (docs/benchmarks.md):
#   bash benchmarks/battery/run.sh SIZE [NAME ...]      # SIZE: s, m or r
#   python benchmarks/battery/summarize.py "$RESULTS"
# Results: $RESULTS/NAME@SIZE.json (default /tmp/jaxpar-battery-SIZE). Needs the CUDA PJRT
# plugin for the deviceless compiles (scripts/test.sh installs it for Python 3.11).
set -u
size=${1:?usage: run.sh SIZE [NAME ...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-$root/.ci-venv/py3.11/bin/python}
export RESULTS=${RESULTS:-/tmp/jaxpar-battery-$size}
mkdir -p "$RESULTS"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  read -r -a names <<< "$(cd "$here" && JAX_PLATFORMS=cpu "$python" -c \
    'import programs; print(" ".join(programs.PROGRAMS))' 2>/dev/null)"
fi
printf "%s\n" "${names[@]}" | PYTHONPATH=$root JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3 \
  xargs -P 2 -I{} bash -c "timeout 600 '$python' '$here/run_one.py' {} '$size' \
    2>'$RESULTS/{}@$size.err' | tail -1 || echo '{} $size TIMEOUT/CRASH'"
