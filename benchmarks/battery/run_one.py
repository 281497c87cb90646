"""Runs one battery program: ``gpu_preview``, ``inspect``, values and gradients against
plain ``jax.jit``; writes ``$RESULTS/NAME@SIZE.json``.

    python benchmarks/battery/run_one.py NAME SIZE
"""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import jax.numpy as jnp
import numpy as np
from programs import PROGRAMS

import jaxpar

MIB = 2**20


def leaves_f(x):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(x)]


def compare(a, b, rtol, atol):
    la, lb = leaves_f(a), leaves_f(b)
    if len(la) != len(lb):
        return False, f"leaf count {len(la)} vs {len(lb)}", None
    worst = 0.0
    exact = True
    ok = True
    where = None
    for i, (x, y) in enumerate(zip(la, lb, strict=False)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, f"leaf {i}: {x.shape}{x.dtype} vs {y.shape}{y.dtype}", None
        if not np.array_equal(x, y, equal_nan=True):
            exact = False
        if np.issubdtype(x.dtype, np.floating):
            xf, yf = x.astype(np.float64), y.astype(np.float64)
            scale = max(np.abs(xf).max() if xf.size else 0.0, 1e-30)
            err = np.abs(xf - yf)
            rel = float((err / (np.abs(xf) + atol * scale + 1e-30)).max()) if x.size else 0.0
            if not np.allclose(yf, xf, rtol=rtol, atol=atol * scale, equal_nan=True):
                ok = False
                where = where or i
            worst = max(worst, rel)
        elif not np.array_equal(x, y):
            ok = False
            where = where or i
    return (
        ok,
        (
            "exact"
            if exact
            else f"max rel err {worst:.2e}" + (f" (leaf {where} fails)" if not ok else "")
        ),
        worst,
    )


def main():
    name, size = sys.argv[1], sys.argv[2]
    out = {"name": name, "size": size, "jaxpar_file": jaxpar.__file__}
    t0 = time.time()
    try:
        spec = PROGRAMS[name](size)
        fn, args = spec[0], spec[1]
        opts = spec[2] if len(spec) > 2 else {}
    except Exception as e:
        out["build_error"] = repr(e)
        out["tb"] = traceback.format_exc()
        return out
    rtol = opts.get("rtol", 1e-4)
    atol = opts.get("atol", 1e-6)
    out["desc"] = opts.get("desc", "")
    # 1. preview
    try:
        t = time.time()
        p = jaxpar.gpu_preview(fn, *args)
        out["preview_s"] = round(time.time() - t, 1)
        pt, jt = p.plain.temp_bytes, p.jaxpar.temp_bytes
        out.update(
            plain_temp=pt,
            jaxpar_temp=jt,
            plain_launches=p.plain.launches,
            jaxpar_launches=p.jaxpar.launches,
            time_ratio=p.time_ratio,
            memory_line=p.memory_line,
            preview_xla_options=dict(p.xla_options),
            jaxpar_mode=p.jaxpar_command_buffers.value,
        )
        if pt is not None and jt is not None:
            out["violation"] = bool(jt > pt + max(0.1 * pt, MIB))
        pm = p.plan.memory
        if pm is not None:
            out["model_plain"] = pm.plain_bytes
            out["model_jaxpar"] = pm.jaxpar_bytes
            out["model_left_out"] = [item.line() for item in pm.left_out]
        out["preview_plan_text"] = p.plan.text()
    except Exception as e:
        out["preview_error"] = repr(e)[:2000]
        out["preview_tb"] = traceback.format_exc()[-4000:]
    # 2. inspect
    try:
        plan = jaxpar.inspect(fn, target="gpu")(*args)
        out["xla_options"] = dict(plan.xla_options)
        out["mode"] = str(getattr(plan.mode, "mode", plan.mode))
        out["plan_text"] = plan.text()
    except Exception as e:
        out["inspect_error"] = repr(e)[:2000]
        out["inspect_tb"] = traceback.format_exc()[-4000:]
    # 3. values on CPU
    try:
        ref = jax.jit(fn)(*args)
        got = jaxpar.parallel_branches(fn, target="gpu")(*args)
        ok, msg, _ = compare(ref, got, rtol, atol)
        out["values_ok"] = ok
        out["values_msg"] = msg
    except Exception as e:
        out["values_error"] = repr(e)[:2000]
        out["values_tb"] = traceback.format_exc()[-4000:]
    # 4. grads
    if opts.get("grad"):
        try:
            argnum = opts.get("argnum", 0)

            def total(f):
                def L(*a):
                    r = f(*a)
                    return sum(
                        jnp.sum(leaf.astype(jnp.float32) * 0.01)
                        for leaf in jax.tree_util.tree_leaves(r)
                        if jnp.issubdtype(leaf.dtype, jnp.floating)
                    )

                return L

            g_ref = jax.jit(jax.grad(total(fn), argnums=argnum))(*args)
            g_got = jax.jit(
                jax.grad(total(jaxpar.parallel_branches(fn, target="gpu")), argnums=argnum)
            )(*args)
            ok, msg, _ = compare(g_ref, g_got, rtol * 10, atol)
            out["grads_ok"] = ok
            out["grads_msg"] = msg
        except Exception as e:
            out["grads_error"] = repr(e)[:2000]
            out["grads_tb"] = traceback.format_exc()[-4000:]
    out["total_s"] = round(time.time() - t0, 1)
    return out


if __name__ == "__main__":
    res = main()
    path = os.path.join(
        os.environ.get(
            "RESULTS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        ),
        f"{sys.argv[1]}@{sys.argv[2]}.json",
    )
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    keys = [
        "plain_temp",
        "jaxpar_temp",
        "violation",
        "plain_launches",
        "jaxpar_launches",
        "xla_options",
        "values_msg",
        "grads_msg",
        "total_s",
    ]
    print(
        sys.argv[1],
        sys.argv[2],
        {k: res.get(k) for k in keys},
        *[k for k in res if k.endswith("error")],
    )
