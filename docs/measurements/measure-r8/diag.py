import sys, time; sys.path.insert(0, "benchmarks")
import jax, jaxpar, tpu_loops
for name in sys.argv[1:]:
    fn, args = tpu_loops.PROGRAMS[name]("m")
    for lab, f in (("jit", jax.jit(fn)), ("x4", jaxpar.parallel_branches(fn, unroll_while=4, measure=False, target="tpu"))):
        t = time.perf_counter(); out = jax.block_until_ready(f(*args)); c = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(10): jax.block_until_ready(f(*args))
        print(name, lab, f"first {c:.2f} s, run {(time.perf_counter()-t)/10*1e3:.2f} ms", jax.tree.leaves(out)[0].ravel()[:1], flush=True)
