import sys, os, json
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from jax import lax
import dispatch, jaxpar
n, d = 3000, 32
w = 32 ** -0.5 * jax.random.normal(jax.random.PRNGKey(1), (d, d))
c0 = jax.random.normal(jax.random.PRNGKey(0), (d, d))
def make(kind):
    def fn(c, w):
        if kind == "float":
            return lax.scan(lambda c, _: (jnp.tanh(c @ w + 1e-4), None), c, None, length=n)[0]
        def body(carry, _):
            k, c = carry
            k2 = (k * 3 + 1) % 1000 if kind == "rem" else k + 1
            return (k2, jnp.tanh(c @ w + k.astype(jnp.float32) * 1e-4)), None
        return lax.scan(body, (jnp.int32(1), c), None, length=n)[0]
    return fn
out = {}
for kind in ("float", "rem", "add"):
    fn = make(kind)
    variants = {"jax.jit": jax.jit(fn), "jaxpar": jaxpar.parallel_branches(fn)}
    for u in (8, 16, 40):
        variants[f"jaxpar unroll={u}"] = jaxpar.parallel_branches(fn, unroll=u)
    entry = dispatch.measure(variants, (c0, w), 200, 7)
    out[kind] = entry["loop_ratio"]
    print(kind, {k: round(v, 3) for k, v in entry["loop_ratio"].items()}, flush=True)
    p = jaxpar.inspect(fn)(c0, w)
    print("  ", [l.strip() for l in p.text().splitlines() if "trips" in l][:2], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "intcarry.json"), "w"), indent=1)
