import sys, time; sys.path.insert(0, "benchmarks")
import jax, jaxpar, tpu_loops
from jaxpar.passes import unroll_while_loops as uw
mode, k = sys.argv[1], int(sys.argv[2])
if mode == "nobarrier":
    uw._settled = lambda c: list(c)
fn, args = tpu_loops.PROGRAMS["while_rk4_mlp_to_t1"]("m")
f = jaxpar.parallel_branches(fn, unroll_while=k, measure=False, target="tpu")
t = time.perf_counter(); lowered = f.lower(*args); print(mode, k, f"lowered {time.perf_counter()-t:.2f}", flush=True)
t = time.perf_counter(); out = jax.block_until_ready(f(*args)); print(mode, k, f"first {time.perf_counter()-t:.2f} s", out[0], flush=True)
