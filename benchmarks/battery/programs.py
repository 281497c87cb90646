"""The adversarial battery: programs nobody on the project wrote for jaxpar.

Each entry ``build(size) -> (fn, args, opts)``; size ``"s"`` (the suite's), ``"m"`` or
``"r"`` (realistic). Run with ``benchmarks/battery/run.sh`` (``docs/benchmarks.md``).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PROGRAMS = {}


def program(name):
    def reg(f):
        PROGRAMS[name] = f
        return f

    return reg


def N(seed, shape, scale=None):
    scale = (1.0 / np.sqrt(shape[0])) if scale is None and len(shape) > 1 else (scale or 1.0)
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * scale


def _mid(a, b):
    if isinstance(a, tuple):
        return tuple(_mid(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, int) and isinstance(b, int) and a != b:
        m = (a * b) ** 0.5
        return max(8, round(m / 8) * 8) if min(a, b) >= 8 else round(m)
    return a


def pick(size, s, r):
    if size == "m":
        return _mid(s, r)
    return s if size == "s" else r


def mlp_params(seed, widths):
    return [
        {"w": N(seed + i, (a, b)), "b": jnp.zeros((b,), jnp.float32)}
        for i, (a, b) in enumerate(itertools.pairwise(widths))
    ]


def mlp(ps, x):
    for i, p in enumerate(ps):
        x = x @ p["w"] + p["b"]
        if i < len(ps) - 1:
            x = jax.nn.gelu(x)
    return x


def lstm_cell(p, carry, x):
    h, c = carry
    g = x @ p["wx"] + h @ p["wh"] + p["b"]
    i, f, gg, o = jnp.split(g, 4, -1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h


def hoisted_lstm_step(wh):
    """An LSTM step whose input projection ``g`` was computed before the loop."""

    def step(carry, g):
        h, c = carry
        i, f, gg, o = jnp.split(g + h @ wh, 4, -1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    return step


def lstm_params(seed, fin, hid):
    return {
        "wx": N(seed, (fin, 4 * hid)),
        "wh": N(seed + 1, (hid, 4 * hid)),
        "b": jnp.zeros((4 * hid,), jnp.float32),
    }


def gru_cell(p, h, x):
    H = h.shape[-1]
    zr = jax.nn.sigmoid(x @ p["wx"][:, : 2 * H] + h @ p["wh"][:, : 2 * H])
    z, r = jnp.split(zr, 2, -1)
    n = jnp.tanh(x @ p["wx"][:, 2 * H :] + (r * h) @ p["wh"][:, 2 * H :])
    h = (1 - z) * n + z * h
    return h, h


def gru_params(seed, fin, hid):
    return {"wx": N(seed, (fin, 3 * hid)), "wh": N(seed + 1, (hid, 3 * hid))}


def train_step(loss, opt):
    import optax

    def step(params, state, *batch):
        v, g = jax.value_and_grad(loss)(params, *batch)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, v

    return step


# ---------------------------------------------------------------- flax linen
@program("linen_mlp_adam")
def _(size):
    import flax.linen as nn
    import optax

    d, h, b = pick(size, (64, 128, 32), (1024, 4096, 512))

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.relu(nn.Dense(h)(x))
            return nn.Dense(d)(x)

    m = M()
    x = N(1, (b, d), 1.0)
    y = N(2, (b, d), 1.0)
    p = jax.jit(m.init)(jax.random.PRNGKey(0), x)
    opt = optax.adam(1e-3)
    loss = lambda p, x, y: ((m.apply(p, x) - y) ** 2).mean()
    return train_step(loss, opt), (p, jax.jit(opt.init)(p), x, y), {}


@program("linen_cnn_adamw")
def _(size):
    import flax.linen as nn
    import optax

    b, hw, c = pick(size, (8, 16, 16), (64, 64, 64))

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = nn.relu(nn.Conv(c, (3, 3))(x))
            bb = nn.relu(nn.Conv(c, (5, 5))(x))
            cc = nn.relu(nn.Conv(c, (1, 1))(x))
            x = jnp.concatenate([a, bb, cc], -1)
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(2 * c, (3, 3))(x)).mean((1, 2))
            return nn.Dense(10)(x)

    m = CNN()
    x = N(3, (b, hw, hw, 3), 1.0)
    y = jax.random.randint(jax.random.PRNGKey(4), (b,), 0, 10)
    p = jax.jit(m.init)(jax.random.PRNGKey(0), x)
    opt = optax.adamw(1e-3, weight_decay=1e-2)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(m.apply(p, x), y).mean()

    return train_step(loss, opt), (p, jax.jit(opt.init)(p), x, y), {"rtol": 1e-3}


def linen_block(heads, d):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.SelfAttention(heads)(nn.LayerNorm()(x), mask=mask)
            return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x))))

    return Block


@program("linen_transformer_grad")
def _(size):
    import flax.linen as nn

    b, t, d, heads, layers = pick(size, (2, 16, 64, 4, 2), (8, 256, 512, 8, 4))
    heads = heads if d % heads == 0 else 4
    Block = linen_block(heads, d)

    class T(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = Block()(x)
            return nn.LayerNorm()(x)

    m = T()
    x = N(5, (b, t, d), 1.0)
    p = jax.jit(m.init)(jax.random.PRNGKey(0), x)
    return jax.grad(lambda p, x: (m.apply(p, x) ** 2).mean()), (p, x), {"rtol": 1e-3}


@program("linen_vae_adam")
def _(size):
    import flax.linen as nn
    import optax

    px, hid, lat, b = pick(size, (64, 48, 8, 16), (784, 512, 32, 512))

    class VAE(nn.Module):
        @nn.compact
        def __call__(self, x, noise):
            h = nn.relu(nn.Dense(hid)(x))
            mean = nn.Dense(lat)(h)
            logvar = nn.Dense(lat)(h)
            z = mean + noise * jnp.exp(0.5 * logvar)
            h = nn.relu(nn.Dense(hid)(z))
            return nn.Dense(px)(h), mean, logvar

    m = VAE()
    x = jax.nn.sigmoid(N(6, (b, px), 1.0))
    noise = N(7, (b, lat), 1.0)
    p = jax.jit(m.init)(jax.random.PRNGKey(0), x, noise)

    def loss(p, x, noise):
        lg, mu, lv = m.apply(p, x, noise)
        return (
            optax.sigmoid_binary_cross_entropy(lg, x).sum(-1)
            - 0.5 * (1 + lv - mu**2 - jnp.exp(lv)).sum(-1)
        ).mean()

    opt = optax.adam(1e-3)
    return train_step(loss, opt), (p, jax.jit(opt.init)(p), x, noise), {"rtol": 1e-3}


@program("linen_bilstm_rnn")
def _(size):
    import flax.linen as nn

    b, t, f, h = pick(size, (4, 16, 32, 32), (32, 128, 256, 256))

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Bidirectional(nn.RNN(nn.LSTMCell(h)), nn.RNN(nn.LSTMCell(h)))(x)
            x = nn.Bidirectional(nn.RNN(nn.GRUCell(h)), nn.RNN(nn.GRUCell(h)))(x)
            return nn.Dense(1)(x)

    m = M()
    x = N(8, (b, t, f), 1.0)
    p = jax.jit(m.init)(jax.random.PRNGKey(0), x)
    return jax.grad(lambda p, x: (m.apply(p, x) ** 2).mean()), (p, x), {"rtol": 1e-3}


# ---------------------------------------------------------------- flax nnx
@program("nnx_mlp_optimizer")
def _(size):
    import optax
    from flax import nnx

    d, h, b = pick(size, (64, 128, 32), (1024, 2048, 256))

    class M(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(d, h, rngs=rngs)
            self.l2 = nnx.Linear(h, h, rngs=rngs)
            self.l3 = nnx.Linear(h, d, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    gd, state = nnx.split(M(nnx.Rngs(0)))
    opt = optax.adamw(1e-3)

    def loss(state, x, y):
        return ((nnx.merge(gd, state)(x) - y) ** 2).mean()

    x, y = N(9, (b, d), 1.0), N(10, (b, d), 1.0)
    return train_step(loss, opt), (state, jax.jit(opt.init)(state), x, y), {}


@program("nnx_transformer_module")
def _(size):
    from flax import nnx

    b, t, d, heads = pick(size, (2, 16, 64, 4), (8, 256, 512, 8))
    heads = heads if d % heads == 0 else 4

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.att = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
            self.f1 = nnx.Linear(d, 4 * d, rngs=rngs)
            self.f2 = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            x = x + self.att(self.ln1(x))
            return x + self.f2(nnx.gelu(self.f1(self.ln2(x))))

    model = Block(nnx.Rngs(0))

    def fn(model, x):
        return model(x)

    return fn, (model, N(11, (b, t, d), 1.0)), {"rtol": 1e-3}


# ---------------------------------------------------------------- equinox
@program("eqx_mlp_gru")
def _(size):
    import equinox as eqx

    d, h, t = pick(size, (32, 32, 16), (512, 512, 128))
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    mlp_ = eqx.nn.MLP(d, d, h, depth=3, key=k[0])
    g1 = eqx.nn.GRUCell(d, h, key=k[1])
    g2 = eqx.nn.GRUCell(d, h, key=k[2])
    params, static = eqx.partition((mlp_, g1, g2), eqx.is_array)

    def fn(params, xs):
        m, g1, g2 = eqx.combine(params, static)
        enc = jax.vmap(m)(xs)
        f1, _ = lax.scan(lambda c, x: (g1(x, c), None), jnp.zeros((h,)), xs)
        f2, _ = lax.scan(lambda c, x: (g2(x, c), None), jnp.zeros((h,)), xs[::-1])
        return enc.sum(0) + f1 + f2

    return fn, (params, N(12, (t, d), 1.0)), {"grad": True}


@program("eqx_ensemble_4")
def _(size):
    import equinox as eqx

    d, h, b = pick(size, (32, 64, 16), (512, 2048, 256))
    ms = [eqx.nn.MLP(d, d, h, depth=2, key=jax.random.PRNGKey(i)) for i in range(4)]
    params, static = eqx.partition(ms, eqx.is_array)

    def fn(params, x):
        ms = eqx.combine(params, static)
        return sum(jax.vmap(m)(x) for m in ms) / 4

    return fn, (params, N(13, (b, d), 1.0)), {"grad": True}


# ---------------------------------------------------------------- optax multi
@program("optax_two_optimizers")
def _(size):
    import optax

    wa, wb, b = pick(
        size, ((64, 128, 32), (64, 96, 32), 32), ((1024, 4096, 1024), (1024, 2048, 1024), 256)
    )
    oa, ob = optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9)
    pa, pb = mlp_params(20, wa), mlp_params(40, wb)
    x, y = N(21, (b, wa[0]), 1.0), N(22, (b, wa[-1]), 1.0)
    sa_, sb_ = (
        train_step(lambda p, x, y: ((mlp(p, x) - y) ** 2).mean(), oa),
        train_step(lambda p, x, y: ((mlp(p, x) - y) ** 2).mean(), ob),
    )

    def fn(pa, sa, pb, sb, x, y):
        return sa_(pa, sa, x, y), sb_(pb, sb, x, y)

    return fn, (pa, jax.jit(oa.init)(pa), pb, jax.jit(ob.init)(pb), x, y), {}


@program("optax_multi_transform")
def _(size):
    import optax

    w, b = pick(size, ((64, 128, 32), 32), ((1024, 4096, 1024), 256))
    params = {"enc": mlp_params(50, w), "dec": mlp_params(60, w[::-1])}
    opt = optax.multi_transform(
        {"a": optax.adamw(1e-3), "b": optax.lion(1e-4)}, {"enc": "a", "dec": "b"}
    )

    def loss(p, x):
        return ((mlp(p["dec"], mlp(p["enc"], x)) - x) ** 2).mean()

    return train_step(loss, opt), (params, jax.jit(opt.init)(params), N(61, (b, w[0]), 1.0)), {}


# ---------------------------------------------------------------- ensembles
@program("ensemble_same_8")
def _(size):
    w, b = pick(size, ((64, 128, 128, 10), 32), ((512, 1024, 1024, 10), 1024))
    ps = [mlp_params(100 + 10 * i, w) for i in range(8)]

    def fn(ps, x):
        outs = [mlp(p, x) for p in ps]
        return sum(outs) / len(outs)

    return fn, (ps, N(99, (b, w[0]), 1.0)), {"grad": True}


@program("ensemble_widths")
def _(size):
    base, b = pick(size, (64, 32), (512, 512))
    ps = [mlp_params(200 + 10 * i, (base, base * (i + 1), base * (i + 1), 10)) for i in range(4)]

    def fn(ps, x):
        return jnp.stack([mlp(p, x) for p in ps]).mean(0)

    return fn, (ps, N(98, (b, base), 1.0)), {"grad": True}


@program("ensemble_big_weights")
def _(size):
    d, b = pick(size, (512, 8), (4096, 64))
    ps = [mlp_params(300 + 10 * i, (d, d, d)) for i in range(4)]

    def fn(ps, x):
        return sum(mlp(p, x) for p in ps)

    return fn, (ps, N(97, (b, d), 1.0)), {}


@program("ensemble_big_outputs")
def _(size):
    # members produce large logits that are combined: stacked outputs are large
    d, v, b = pick(size, (64, 2048, 128), (256, 32000, 256))
    ps = [mlp_params(400 + 10 * i, (d, d, v)) for i in range(4)]

    def fn(ps, x):
        logits = [mlp(p, x) for p in ps]
        probs = [jax.nn.softmax(logit, -1) for logit in logits]
        return jnp.log(sum(probs) / 4 + 1e-9).mean()

    return fn, (ps, N(96, (b, d), 1.0)), {"grad": True}


@program("ensemble_big_intermediates")
def _(size):
    # each member makes a big hidden then reduces to small: sequential plain reuses memory
    d, h, b = pick(size, (32, 4096, 256), (64, 16384, 1024))
    ps = [mlp_params(500 + 10 * i, (d, h, d)) for i in range(6)]

    def fn(ps, x):
        return jnp.stack([mlp(p, x) for p in ps])

    return fn, (ps, N(95, (b, d), 1.0)), {}


@program("ensemble_written_vmap_grad")
def _(size):
    # ensemble loss and grad per member, written out
    w, b = pick(size, ((32, 64, 1), 64), ((256, 2048, 1), 2048))
    ps = [mlp_params(600 + 10 * i, w) for i in range(4)]

    def fn(ps, x, y):
        gs = [jax.grad(lambda p: ((mlp(p, x)[:, 0] - y) ** 2).mean())(p) for p in ps]
        return gs

    return fn, (ps, N(94, (b, w[0]), 1.0), N(93, (b,), 1.0)), {}


# ---------------------------------------------------------------- towers / siamese / moe
@program("siamese_grad")
def _(size):
    w, b = pick(size, ((64, 128, 32), 32), ((1024, 4096, 512), 512))
    p = mlp_params(700, w)

    def loss(p, a, bb):
        ea, eb = mlp(p, a), mlp(p, bb)
        return ((ea - eb) ** 2).sum(-1).mean()

    return jax.grad(loss), (p, N(701, (b, w[0]), 1.0), N(702, (b, w[0]), 1.0)), {}


@program("two_tower_grad")
def _(size):
    w, b = pick(size, ((64, 128, 32), 32), ((1024, 2048, 256), 1024))
    pq, pd = mlp_params(710, w), mlp_params(720, w)

    def loss(ps, q, d):
        eq, ed = mlp(ps[0], q), mlp(ps[1], d)
        s = eq @ ed.T
        return -jnp.mean(jax.nn.log_softmax(s, -1).diagonal())

    return (
        jax.grad(loss),
        ((pq, pd), N(711, (b, w[0]), 1.0), N(712, (b, w[0]), 1.0)),
        {"rtol": 1e-3},
    )


def moe(p, x):
    g = jax.nn.softmax(x @ p["router"], -1)
    out = jnp.zeros_like(x)
    for e, ex in enumerate(p["experts"]):
        out = out + g[:, e : e + 1] * (jax.nn.gelu(x @ ex["w1"]) @ ex["w2"])
    return out


def moe_params(seed, d, h, E):
    return {
        "router": N(seed, (d, E)),
        "experts": [
            {"w1": N(seed + 1 + 2 * e, (d, h)), "w2": N(seed + 2 + 2 * e, (h, d))} for e in range(E)
        ],
    }


@program("moe_fwd")
def _(size):
    t, d, h, E = pick(size, (64, 32, 64, 4), (4096, 512, 2048, 8))
    return moe, (moe_params(800, d, h, E), N(801, (t, d), 1.0)), {}


@program("moe_grad")
def _(size):
    t, d, h, E = pick(size, (64, 32, 64, 4), (2048, 512, 2048, 8))
    return (
        jax.grad(lambda p, x: (moe(p, x) ** 2).mean()),
        (moe_params(810, d, h, E), N(811, (t, d), 1.0)),
        {},
    )


# ---------------------------------------------------------------- RNNs via scan
def rnn_sizes(size):
    return pick(size, (16, 4, 32, 32), (256, 64, 512, 512))  # T, B, F, H


@program("lstm_uni_grad")
def _(size):
    T, B, F, H = rnn_sizes(size)
    p = lstm_params(900, F, H)

    def loss(p, xs):
        z = jnp.zeros((B, H))
        _, hs = lax.scan(lambda c, x: lstm_cell(p, c, x), (z, z), xs)
        return (hs**2).mean()

    return jax.grad(loss), (p, N(901, (T, B, F), 1.0)), {}


@program("bilstm_fwd")
def _(size):
    T, B, F, H = rnn_sizes(size)
    ps = [lstm_params(910 + 2 * k, F, H) for k in range(2)]

    def fn(ps, xs):
        z = jnp.zeros((B, H))
        _, f = lax.scan(lambda c, x: lstm_cell(ps[0], c, x), (z, z), xs)
        _, b = lax.scan(lambda c, x: lstm_cell(ps[1], c, x), (z, z), xs, reverse=True)
        return jnp.concatenate([f, b], -1)

    return fn, (ps, N(915, (T, B, F), 1.0)), {"grad": True}


@program("stacked_gru3")
def _(size):
    T, B, F, H = rnn_sizes(size)
    ps = [gru_params(920 + 2 * k, F if k == 0 else H, H) for k in range(3)]

    def fn(ps, xs):
        for p in ps:
            _, xs = lax.scan(lambda h, x, p=p: gru_cell(p, h, x), jnp.zeros((B, H)), xs)
        return xs

    return fn, (ps, N(929, (T, B, F), 1.0)), {"grad": True}


@program("stacked_bigru2_grad")
def _(size):
    T, B, F, H = rnn_sizes(size)
    ps = [
        [gru_params(930 + 4 * k + 2 * j, F if k == 0 else 2 * H, H) for j in range(2)]
        for k in range(2)
    ]

    def loss(ps, xs):
        for pf, pb in ps:
            z = jnp.zeros((B, H))
            _, f = lax.scan(lambda h, x, pf=pf: gru_cell(pf, h, x), z, xs)
            _, b = lax.scan(lambda h, x, pb=pb: gru_cell(pb, h, x), z, xs, reverse=True)
            xs = jnp.concatenate([f, b], -1)
        return (xs**2).mean()

    return jax.grad(loss), (ps, N(939, (T, B, F), 1.0)), {"rtol": 1e-3}


# ---------------------------------------------------------------- independent scans
@program("scans_identical_8")
def _(size):
    T, D = pick(size, (64, 64), (512, 512))
    ws = [N(1000 + i, (D, D)) for i in range(8)]

    def fn(ws, c0, xs):
        return [lax.scan(lambda c, x, w=w: (jnp.tanh(c @ w + x), None), c0, xs)[0] for w in ws]

    return fn, (ws, N(1010, (16, D), 1.0), N(1011, (T, 16, D), 1.0)), {"grad": True}


@program("scans_different_bodies")
def _(size):
    T, D = pick(size, (50, 64), (1000, 256))
    w = N(1020, (D, D))

    def fn(w, a, xs):
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ w + x), None), a, xs)
        r2, _ = lax.scan(lambda c, x: (jnp.sin(c) * x + c, None), a, xs)
        r3, _ = lax.scan(lambda c, x: (c + jnp.exp(-((x @ w) ** 2)), None), a, xs)
        return r1, r2, r3

    return fn, (w, N(1021, (8, D), 1.0), N(1022, (T, 8, D), 0.1)), {"grad": True}


@program("scans_ys_big")
def _(size):
    # two scans with big ys consumed by a reduction
    T, B, D = pick(size, (64, 32, 256), (1024, 64, 1024))
    w1, w2 = N(1030, (D, D)), N(1031, (D, D))

    def fn(w1, w2, a, xs):
        _, y1 = lax.scan(lambda c, x: (jnp.tanh(c @ w1 + x),) * 2, a, xs)
        _, y2 = lax.scan(lambda c, x: (jnp.tanh(c @ w2 - x),) * 2, a, xs)
        return (y1 * y2).sum(0)

    return fn, (w1, w2, N(1032, (B, D), 1.0), N(1033, (T, B, D), 0.1)), {}


@program("scans_broadcast_inside")
def _(size):
    T, D = pick(size, (100, 64), (1000, 256))

    def fn(a, b, x):
        xs = jnp.broadcast_to(x, (T, *x.shape))
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c * 0.9 + x), None), a, xs)
        r2, _ = lax.scan(lambda c, x: (jnp.sin(c) + x, None), b, xs * 2.0)
        return r1, r2

    return fn, (N(1040, (D, D), 1.0), N(1041, (D, D), 1.0), N(1042, (D, D), 0.01)), {}


@program("scans_prime_lengths")
def _(size):
    T1, T2, D = pick(size, (97, 101, 64), (1009, 1013, 256))
    w = N(1050, (D, D))

    def fn(w, a, x1, x2):
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ w + x), None), a, x1)
        r2, _ = lax.scan(lambda c, x: (jnp.tanh(c @ w - x), None), a, x2)
        r3, _ = lax.scan(lambda c, x: (jnp.tanh(c @ w * x), None), a, x1)
        return r1, r2, r3

    return (
        fn,
        (w, N(1051, (8, D), 1.0), N(1052, (T1, 8, D), 0.1), N(1053, (T2, 8, D), 0.1)),
        {"grad": True},
    )


@program("scans_nested")
def _(size):
    To, Ti, D = pick(size, (8, 16, 64), (32, 64, 256))
    w1, w2 = N(1060, (D, D)), N(1061, (D, D))

    def fn(w1, w2, a, xs):
        def outer(c, xo):
            r1, _ = lax.scan(lambda ci, x: (jnp.tanh(ci @ w1 + x), None), c, xo)
            r2, _ = lax.scan(lambda ci, x: (jnp.tanh(ci @ w2 - x), None), c, xo)
            return r1 + r2, r1 - r2

        return lax.scan(outer, a, xs)

    return fn, (w1, w2, N(1062, (8, D), 1.0), N(1063, (To, Ti, 8, D), 0.1)), {"grad": True}


@program("fori_while_loops")
def _(size):
    T, D = pick(size, (50, 64), (500, 512))
    w = N(1070, (D, D))

    def fn(w, a, b):
        r1 = lax.fori_loop(0, T, lambda i, c: jnp.tanh(c @ w + i), a)
        r2 = lax.fori_loop(0, T, lambda i, c: jnp.tanh(c @ w.T - i), b)
        r3 = lax.while_loop(
            lambda s: s[0] < T, lambda s: (s[0] + 1, jnp.sin(s[1]) + s[1] * 0.5), (0, b)
        )[1]
        return r1, r2, r3

    return fn, (w, N(1071, (16, D), 1.0), N(1072, (16, D), 1.0)), {}


@program("conds_branches")
def _(size):
    D, B = pick(size, (64, 16), (1024, 256))
    w1, w2 = N(1080, (D, D)), N(1081, (D, D))

    def fn(w1, w2, x, k):
        a = lax.cond(k > 0, lambda x: jnp.tanh(x @ w1), lambda x: jax.nn.relu(x @ w2), x)
        b = lax.cond(k > 1, lambda x: jnp.tanh(x @ w2), lambda x: jax.nn.relu(x @ w1), x)
        c = lax.switch(k, [lambda x: x @ w1, lambda x: x @ w2, lambda x: (x @ w1) @ w2], x)
        return a + b + c

    return fn, (w1, w2, N(1082, (B, D), 1.0), jnp.int32(1)), {}


@program("vmap_grad_inside")
def _(size):
    D, B, E = pick(size, (32, 16, 4), (512, 256, 8))
    ps = [mlp_params(1090 + 10 * i, (D, D, 1)) for i in range(E)]

    def fn(ps, xs):
        per_ex = [jax.vmap(jax.grad(lambda x, p=p: mlp(p, x[None])[0, 0]))(xs) for p in ps]
        return sum(per_ex)

    return fn, (ps, N(1099, (B, D), 1.0)), {}


# ---------------------------------------------------------------- adversarial memory
@program("adv_many_scans_big_carry")
def _(size):
    # 12 independent scans, each with a big carry (sum-of-carries vs one-at-a-time)
    K, T, R = pick(size, (12, 16, 256), (12, 64, 1024))

    def fn(a, xs):
        outs = []
        for k in range(K):
            c0 = a * (k + 1.0)
            r, _ = lax.scan(lambda c, x, k=k: (jnp.tanh(c + x * (k + 1)), None), c0, xs)
            outs.append(r.sum())
        return jnp.stack(outs)

    return fn, (N(1100, (R, R), 1.0), N(1101, (T, R, R), 0.1)), {}


@program("adv_order_unfriendly")
def _(size):
    # big scan inputs computed first (X1, X2, X3), then scans
    T, B, D = pick(size, (32, 64, 512), (128, 128, 1024))
    w = N(1110, (D, D))

    def fn(w, xs, a):
        X1 = jnp.tanh(xs @ w)
        X2 = jnp.sin(xs @ w.T)
        X3 = jnp.cos(xs @ (w * 2))
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), None), a, X1)
        r2, _ = lax.scan(lambda c, x: (jnp.tanh(c - x), None), a, X2)
        r3, _ = lax.scan(lambda c, x: (jnp.tanh(c * x), None), a, X3)
        return r1 + r2 + r3

    return fn, (w, N(1111, (T, B, D), 1.0), N(1112, (B, D), 1.0)), {}


@program("adv_order_friendly")
def _(size):
    # each scan's input computed right before it: plain can free X1 before X2
    T, B, D = pick(size, (32, 64, 512), (128, 128, 1024))
    w = N(1120, (D, D))

    def fn(w, xs, a):
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), None), a, jnp.tanh(xs @ w))
        r2, _ = lax.scan(lambda c, x: (jnp.tanh(c - x), None), a, jnp.sin(xs @ w.T))
        r3, _ = lax.scan(lambda c, x: (jnp.tanh(c * x), None), a, jnp.cos(xs @ (w * 2)))
        return r1 + r2 + r3

    return fn, (w, N(1121, (T, B, D), 1.0), N(1122, (B, D), 1.0)), {}


@program("adv_unroll_big_body")
def _(size):
    # long scan of a body with big intermediates: unrolling keeps copies
    T, B, D, H = pick(size, (64, 64, 128, 1024), (256, 256, 256, 4096))
    w1, w2 = N(1130, (D, H)), N(1131, (H, D))

    def fn(w1, w2, a, xs):
        def body(c, x):
            h = jax.nn.gelu((c + x) @ w1)
            return c + 0.1 * jnp.tanh(h @ w2), None

        return lax.scan(body, a, xs)[0]

    return fn, (w1, w2, N(1132, (B, D), 1.0), N(1133, (T, B, D), 0.1)), {"grad": True}


@program("adv_unroll_grad_residuals")
def _(size):
    # grad of a scan with big body: residuals stacked per trip
    T, B, D, H = pick(size, (32, 32, 128, 512), (128, 128, 512, 2048))
    w1, w2 = N(1140, (D, H)), N(1141, (H, D))

    def loss(ws, a, xs):
        w1, w2 = ws

        def body(c, x):
            return c + 0.1 * jnp.tanh(jax.nn.gelu((c + x) @ w1) @ w2), None

        return (lax.scan(body, a, xs)[0] ** 2).mean()

    return jax.grad(loss), ((w1, w2), N(1142, (B, D), 1.0), N(1143, (T, B, D), 0.1)), {"rtol": 1e-3}


@program("adv_identical_members_big_hidden")
def _(size):
    # identical members (same shapes) each with a big intermediate and a scan
    K, T, B, D, H = pick(size, (4, 16, 64, 64, 4096), (4, 64, 256, 256, 8192))
    ps = [(N(1150 + 2 * i, (D, H)), N(1151 + 2 * i, (H, D))) for i in range(K)]

    def fn(ps, a, xs):
        outs = []
        for w1, w2 in ps:
            r, _ = lax.scan(
                lambda c, x, w1=w1, w2=w2: (jnp.tanh(jax.nn.relu((c + x) @ w1) @ w2), None), a, xs
            )
            outs.append(r)
        return outs

    return fn, (ps, N(1160, (B, D), 1.0), N(1161, (T, B, D), 0.1)), {}


@program("adv_stacked_ys_members")
def _(size):
    # identical scans whose ys are big and returned through a transpose
    K, T, B, D = pick(size, (4, 64, 32, 256), (4, 512, 64, 512))
    ws = [N(1170 + i, (D, D)) for i in range(K)]

    def fn(ws, a, xs):
        ys = [lax.scan(lambda c, x, w=w: (jnp.tanh(c @ w + x),) * 2, a, xs)[1] for w in ws]
        return sum(jnp.swapaxes(y, 0, 1).sum(1) for y in ys)

    return fn, (ws, N(1171, (B, D), 1.0), N(1172, (T, B, D), 0.1)), {}


@program("adv_elementwise_chains")
def _(size):
    R = pick(size, 1024, 4096)

    def fn(x, y):
        a = x
        for i in range(20):
            a = jnp.sin(a) * 1.01 + jnp.cos(a * (i + 1))
        b = y
        for _ in range(20):
            b = jnp.tanh(b) * 0.99 + jnp.exp(-b * b)
        c = a @ b
        d = b @ a
        return c + d

    return fn, (N(1180, (R, R), 1.0), N(1181, (R, R), 1.0)), {}


@program("adv_scan_inputs_from_matmul_4")
def _(size):
    # 4 independent members: big projected inputs then scans with identical bodies
    K, T, B, D = pick(size, (4, 64, 32, 256), (4, 256, 64, 1024))
    ws = [N(1190 + i, (D, D)) for i in range(K)]
    u = N(1199, (D, D))

    def fn(ws, u, xs, a):
        outs = []
        for w in ws:
            proj = xs @ w
            r, _ = lax.scan(lambda c, x: (jnp.tanh(c @ u + x), None), a, proj)
            outs.append(r)
        return sum(outs)

    return fn, (ws, u, N(1198, (T, B, D), 1.0), N(1197, (B, D), 1.0)), {}


@program("adv_long_tiny_scans")
def _(size):
    # very long scans of tiny bodies: unroll temptation with big xs
    T, D = pick(size, (10007, 64), (100003, 128))

    def fn(a, b, xs):
        r1, y1 = lax.scan(lambda c, x: (c * 0.99 + x, c.sum()), a, xs)
        r2, y2 = lax.scan(lambda c, x: (jnp.sin(c) + x, c.mean()), b, xs)
        return r1, r2, y1 + y2

    return fn, (N(1200, (D,), 1.0), N(1201, (D,), 1.0), N(1202, (T, D), 0.01)), {}


@program("adv_uneven_unroll_big_xs")
def _(size):
    T, B, D = pick(size, (1000, 8, 256), (3000, 64, 512))

    def fn(a, xs):
        r1, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), None), a, xs)
        return r1

    return fn, (N(1210, (B, D), 1.0), N(1211, (T, B, D), 0.1)), {}


@program("adv_bidir_ys_consumed")
def _(size):
    # bidirectional scans whose ys feed a big matmul head
    T, B, D = pick(size, (64, 32, 256), (512, 64, 512))
    w1, w2, wh = N(1220, (D, D)), N(1221, (D, D)), N(1222, (2 * D, 4 * D))

    def fn(w1, w2, wh, a, xs):
        _, f = lax.scan(lambda c, x: (jnp.tanh(c @ w1 + x),) * 2, a, xs)
        _, b = lax.scan(lambda c, x: (jnp.tanh(c @ w2 + x),) * 2, a, xs, reverse=True)
        h = jnp.concatenate([f, b], -1) @ wh
        return jax.nn.logsumexp(h, -1).mean()

    return fn, (w1, w2, wh, N(1223, (B, D), 1.0), N(1224, (T, B, D), 0.1)), {"grad": True}


@program("adv_scan_big_carry_pair")
def _(size):
    T, R = pick(size, (64, 512), (256, 2048))

    def fn(a, b):
        r1, _ = lax.scan(lambda c, _: (jnp.tanh(c) * 1.01, None), a, None, length=T)
        r2, _ = lax.scan(lambda c, _: (jnp.sin(c) + 0.1, None), b, None, length=T)
        return r1 @ r2

    return fn, (N(1230, (R, R), 1.0), N(1231, (R, R), 1.0)), {}


@program("adv_members_cond_scan")
def _(size):
    K, T, B, D = pick(size, (3, 32, 16, 128), (3, 128, 128, 1024))
    ws = [N(1240 + i, (D, D)) for i in range(K)]

    def fn(ws, a, xs, flag):
        outs = []
        for w in ws:
            r, _ = lax.scan(
                lambda c, x, w=w: (
                    lax.cond(flag, lambda c: jnp.tanh(c @ w + x), lambda c: c + x, c),
                    None,
                ),
                a,
                xs,
            )
            outs.append(r)
        return outs

    return fn, (ws, N(1250, (B, D), 1.0), N(1251, (T, B, D), 0.1), jnp.bool_(True)), {}


@program("adv_gru_grad_long")
def _(size):
    T, B, F, H = pick(size, (128, 16, 64, 64), (1024, 64, 256, 256))
    ps = [gru_params(1260 + 2 * k, F, H) for k in range(2)]

    def loss(ps, xs):
        z = jnp.zeros((B, H))
        _, f = lax.scan(lambda h, x: gru_cell(ps[0], h, x), z, xs)
        _, b = lax.scan(lambda h, x: gru_cell(ps[1], h, x), z, xs, reverse=True)
        return (f * b).mean()

    return jax.grad(loss), (ps, N(1269, (T, B, F), 1.0)), {"rtol": 1e-3}


@program("adv_transformer_ensemble2")
def _(size):
    b, t, d, h = pick(size, (2, 16, 64, 256), (8, 512, 512, 2048))

    def block(p, x):
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        a = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(d), -1) @ v
        x = x + a @ p["o"]
        return x + jax.nn.gelu(x @ p["f1"]) @ p["f2"]

    def bp(seed):
        return {
            "q": N(seed, (d, d)),
            "k": N(seed + 1, (d, d)),
            "v": N(seed + 2, (d, d)),
            "o": N(seed + 3, (d, d)),
            "f1": N(seed + 4, (d, h)),
            "f2": N(seed + 5, (h, d)),
        }

    ps = [bp(1300), bp(1310)]

    def loss(ps, x):
        return sum((block(p, x) ** 2).mean() for p in ps)

    return jax.grad(loss), (ps, N(1320, (b, t, d), 1.0)), {"rtol": 1e-3}


# ---------------------------------------------------------------- batch 2: realistic memory hazards
@program("bilstm_hoisted_proj_first")
def _(size):
    # cuDNN-style: input projections of both directions computed first, then the two scans
    T, B, F, H = pick(size, (32, 16, 64, 64), (256, 64, 512, 512))
    ps = [lstm_params(1400 + 2 * k, F, H) for k in range(2)]

    def fn(ps, xs):
        gx_f = xs @ ps[0]["wx"] + ps[0]["b"]
        gx_b = xs @ ps[1]["wx"] + ps[1]["b"]
        z = jnp.zeros((B, H))

        _, f = lax.scan(hoisted_lstm_step(ps[0]["wh"]), (z, z), gx_f)
        _, b = lax.scan(hoisted_lstm_step(ps[1]["wh"]), (z, z), gx_b, reverse=True)
        return (f * b).mean(-1)

    return fn, (ps, N(1410, (T, B, F), 1.0)), {}


@program("bilstm_hoisted_proj_interleaved")
def _(size):
    T, B, F, H = pick(size, (32, 16, 64, 64), (256, 64, 512, 512))
    ps = [lstm_params(1420 + 2 * k, F, H) for k in range(2)]

    def fn(ps, xs):
        z = jnp.zeros((B, H))

        _, f = lax.scan(hoisted_lstm_step(ps[0]["wh"]), (z, z), xs @ ps[0]["wx"] + ps[0]["b"])
        _, b = lax.scan(
            hoisted_lstm_step(ps[1]["wh"]), (z, z), xs @ ps[1]["wx"] + ps[1]["b"], reverse=True
        )
        return (f * b).mean(-1)

    return fn, (ps, N(1430, (T, B, F), 1.0)), {}


@program("adv_precomputed_inputs_8")
def _(size):
    K, T, B, D = pick(size, (8, 16, 32, 256), (8, 128, 64, 1024))
    ws = [N(1440 + i, (D, D)) for i in range(K)]

    def fn(ws, xs, a):
        Xs = [jnp.tanh(xs[i % 2] @ w) for i, w in enumerate(ws)]
        outs = [
            lax.scan(lambda c, x, i=i: (jnp.tanh(c * (1 + 0.01 * i) + x), None), a, X)[0]
            for i, X in enumerate(Xs)
        ]
        return sum(outs)

    return fn, (ws, N(1450, (2, T, B, D), 1.0), N(1451, (B, D), 1.0)), {}


@program("many_independent_chains")
def _(size):
    # mode-change bait: many independent chains of small kernels with different shapes
    s = pick(size, 1, 4)
    ws = [
        [N(1500 + 10 * i + j, (32 * s * (i % 4 + 1), 32 * s * (i % 4 + 1))) for j in range(6)]
        for i in range(12)
    ]
    xs = [N(1600 + i, (16 * s, 32 * s * (i % 4 + 1)), 1.0) for i in range(12)]

    def fn(ws, xs):
        outs = []
        for chain, x in zip(ws, xs, strict=False):
            for w in chain:
                x = jnp.tanh(x @ w)
            outs.append(x.sum())
        return jnp.stack(outs)

    return fn, (ws, xs), {}


@program("inception_like")
def _(size):
    b, hw, c = pick(size, (4, 16, 32), (32, 56, 192))

    def conv(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    p = {
        "b1": N(1700, (1, 1, c, 64), 0.05),
        "b2a": N(1701, (1, 1, c, 96), 0.05),
        "b2b": N(1702, (3, 3, 96, 128), 0.05),
        "b3a": N(1703, (1, 1, c, 16), 0.05),
        "b3b": N(1704, (5, 5, 16, 32), 0.05),
        "b4": N(1705, (1, 1, c, 32), 0.05),
    }

    def fn(p, x):
        y1 = jax.nn.relu(conv(x, p["b1"]))
        y2 = jax.nn.relu(conv(jax.nn.relu(conv(x, p["b2a"])), p["b2b"]))
        y3 = jax.nn.relu(conv(jax.nn.relu(conv(x, p["b3a"])), p["b3b"]))
        y4 = jax.nn.relu(
            conv(
                lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"), p["b4"]
            )
        )
        return jnp.concatenate([y1, y2, y3, y4], -1)

    return fn, (p, N(1706, (b, hw, hw, c), 1.0)), {"grad": True, "rtol": 1e-3}


# ---------------------------------------------------------------- batch 2: crash hunting
@program("typed_keys_dropout_members")
def _(size):
    d, b = pick(size, (64, 32), (1024, 256))
    ps = [mlp_params(1800 + 10 * i, (d, d, d)) for i in range(4)]

    def fn(ps, x, keys):
        outs = []
        for i, p in enumerate(ps):
            h = jax.nn.relu(x @ p[0]["w"])
            keep = jax.random.bernoulli(keys[i], 0.9, h.shape)
            outs.append(jnp.where(keep, h / 0.9, 0) @ p[1]["w"])
        return sum(outs)

    return fn, (ps, N(1810, (b, d), 1.0), jax.random.split(jax.random.key(0), 4)), {}


@program("keys_in_scan_carry")
def _(size):
    T, D = pick(size, (32, 64), (256, 512))

    def fn(a, b, key):
        def body(carry, _):
            k, c = carry
            k, sub = jax.random.split(k)
            return (k, jnp.tanh(c + jax.random.normal(sub, c.shape) * 0.01)), None

        (k1, r1), _ = lax.scan(body, (key, a), None, length=T)
        (k2, r2), _ = lax.scan(body, (jax.random.fold_in(key, 1), b), None, length=T)
        return r1, r2, jax.random.key_data(k1), jax.random.key_data(k2)

    return fn, (N(1820, (16, D), 1.0), N(1821, (16, D), 1.0), jax.random.key(3)), {}


@program("bf16_ensemble")
def _(size):
    w, b = pick(size, ((64, 128, 10), 32), ((1024, 4096, 1000), 512))
    ps = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16), [mlp_params(1830 + 10 * i, w) for i in range(4)]
    )

    def fn(ps, x):
        return sum(mlp(p, x) for p in ps)

    return fn, (ps, N(1839, (b, w[0]), 1.0).astype(jnp.bfloat16)), {"rtol": 2e-2, "atol": 1e-2}


@program("scan_len0_len1")
def _(size):
    D = pick(size, 64, 512)

    def fn(a, xs0, xs1):
        r0, y0 = lax.scan(lambda c, x: (c + x, c * 2), a, xs0)
        r1, y1 = lax.scan(lambda c, x: (jnp.tanh(c + x), c * 3), a, xs1)
        r2, y2 = lax.scan(lambda c, x: (jnp.sin(c + x), c * 4), a, xs1)
        return r0, y0, r1, y1, r2, y2

    return fn, (N(1840, (8, D), 1.0), jnp.zeros((0, 8, D)), N(1841, (1, 8, D), 1.0)), {}


@program("remat_scans_grad")
def _(size):
    T, B, D = pick(size, (32, 16, 64), (256, 64, 512))
    w1, w2 = N(1850, (D, D)), N(1851, (D, D))

    def loss(ws, a, xs):
        outs = []
        for w in ws:
            body = jax.checkpoint(lambda c, x, w=w: (jnp.tanh(c @ w + x), None))
            outs.append(lax.scan(body, a, xs)[0])
        return sum((o**2).mean() for o in outs)

    return jax.grad(loss), ((w1, w2), N(1852, (B, D), 1.0), N(1853, (T, B, D), 0.1)), {"rtol": 1e-3}


@program("custom_vjp_in_scans")
def _(size):
    T, D = pick(size, (32, 64), (256, 512))

    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

    def loss(a, b, xs):
        r1, _ = lax.scan(lambda c, x: (clip_grad(jnp.tanh(c + x)), None), a, xs)
        r2, _ = lax.scan(lambda c, x: (clip_grad(jnp.sin(c) + x), None), b, xs)
        return (r1 * r2).sum()

    return (
        jax.value_and_grad(loss, argnums=(0, 1)),
        (N(1860, (8, D), 1.0), N(1861, (8, D), 1.0), N(1862, (T, 8, D), 0.1)),
        {},
    )


@program("int_carry_scans")
def _(size):
    T, D = pick(size, (64, 64), (1024, 1024))

    def fn(a, b, xs):
        r1, _ = lax.scan(lambda c, x: ((c * 3 + x) % 1000003, None), a, xs)
        r2, _ = lax.scan(lambda c, x: ((c * 5 + x) % 1000003, None), b, xs)
        r3, y = lax.scan(lambda c, x: (c ^ x, c.sum()), a, xs)
        return r1, r2, r3, y

    xs = jax.random.randint(jax.random.PRNGKey(1870), (T, D), 0, 1000)
    return fn, (jnp.arange(D, dtype=jnp.int32), jnp.arange(D, dtype=jnp.int32) * 2, xs), {}


@program("lax_map_pair")
def _(size):
    T, D = pick(size, (32, 64), (256, 512))
    w = N(1880, (D, D))

    def fn(w, xs):
        y1 = lax.map(lambda x: jnp.tanh(x @ w), xs)
        y2 = lax.map(lambda x: jnp.sin(x @ w.T), xs)
        return y1 + y2

    return fn, (w, N(1881, (T, 8, D), 1.0)), {}


@program("debug_print_scans")
def _(size):
    T = pick(size, 8, 16)

    def fn(a, b, xs):
        def b1(c, x):
            jax.debug.print("s1 {}", x[0, 0], ordered=False)
            return jnp.tanh(c + x), None

        def b2(c, x):
            return jnp.sin(c) + x, None

        return lax.scan(b1, a, xs)[0], lax.scan(b2, b, xs)[0]

    return fn, (N(1890, (8, 16), 1.0), N(1891, (8, 16), 1.0), N(1892, (T, 8, 16), 0.1)), {}


@program("dynamic_while_pair")
def _(size):
    D = pick(size, 64, 512)

    def fn(a, b, n):
        r1 = lax.fori_loop(0, n, lambda i, c: jnp.tanh(c * 1.1), a)
        r2 = lax.fori_loop(0, n, lambda i, c: jnp.sin(c) + 0.1, b)
        r3 = lax.while_loop(lambda c: c.sum() < 1e6, lambda c: c * 2 + 1, jnp.abs(a))
        return r1, r2, r3

    return fn, (N(1900, (16, D), 1.0), N(1901, (16, D), 1.0), jnp.int32(37)), {}


@program("user_unroll_and_full")
def _(size):
    T, D = pick(size, (60, 64), (600, 256))
    w = N(1910, (D, D))

    def fn(w, a, xs):
        r1, y1 = lax.scan(lambda c, x: (jnp.tanh(c @ w + x),) * 2, a, xs, unroll=True)
        r2, y2 = lax.scan(lambda c, x: (jnp.tanh(c @ w - x),) * 2, a, xs, unroll=7)
        r3, _ = lax.scan(lambda c, x: (jnp.tanh(c @ w * x), None), a, xs, unroll=1)
        return r1, r2, r3, (y1 - y2).sum(0)

    return fn, (w, N(1911, (8, D), 1.0), N(1912, (T, 8, D), 0.1)), {"grad": True}


@program("scan_pytree_xs_mixed_dtype")
def _(size):
    T, D = pick(size, (32, 64), (512, 512))

    def fn(a, b, xs):
        def body(c, x):
            return jnp.tanh(c + x["f"] * x["i"].astype(jnp.float32)), {"m": c.max(), "i": x["i"]}

        r1, y1 = lax.scan(body, a, xs)
        r2, y2 = lax.scan(body, b, xs)
        return r1, r2, y1, y2

    xs = {
        "f": N(1920, (T, D), 0.1),
        "i": jax.random.randint(jax.random.PRNGKey(1921), (T, D), 0, 3),
    }
    return fn, (N(1922, (D,), 1.0), N(1923, (D,), 1.0), xs), {}


@program("nested_cond_scan_members")
def _(size):
    T, B, D = pick(size, (16, 8, 64), (128, 64, 512))
    ws = [N(1930 + i, (D, D)) for i in range(3)]

    def fn(ws, a, xs, k):
        def member(w):
            def body(c, x):
                def inner(c):
                    return lax.scan(
                        lambda ci, xi: (jnp.tanh(ci @ w + xi), None), c, x[None].repeat(3, 0)
                    )[0]

                return lax.cond(k > 0, inner, lambda c: c * 0.5, c), c.sum()

            return lax.scan(body, a, xs)

        return [member(w) for w in ws]

    return fn, (ws, N(1940, (B, D), 1.0), N(1941, (T, B, D), 0.1), jnp.int32(1)), {}


@program("big_consts_identical_scans")
def _(size):
    # identical scan bodies closing over big distinct weights: batching stacks them
    T, D = pick(size, (32, 512), (64, 2048))
    ws = [N(1950 + i, (D, D)) for i in range(4)]

    def fn(ws, a):
        return [
            lax.scan(lambda c, _, w=w: (jnp.tanh(c @ w), None), a, None, length=T)[0] for w in ws
        ]

    return fn, (ws, N(1960, (8, D), 1.0)), {}


@program("siamese_scans_shared")
def _(size):
    # siamese GRU encoder applied to two sequences (identical bodies, shared weights)
    T, B, F, H = pick(size, (16, 4, 32, 32), (128, 64, 256, 512))
    p = gru_params(1970, F, H)

    def loss(p, xa, xb):
        z = jnp.zeros((B, H))
        ha, _ = lax.scan(lambda h, x: gru_cell(p, h, x), z, xa)
        hb, _ = lax.scan(lambda h, x: gru_cell(p, h, x), z, xb)
        return ((ha - hb) ** 2).mean()

    return (
        jax.value_and_grad(loss),
        (p, N(1971, (T, B, F), 1.0), N(1972, (T, B, F), 1.0)),
        {"rtol": 1e-3},
    )


# ---------------------------------------------------------------- batch 3
@program("siamese_scans_k4")
def _(size):
    K, T, B, F, H = pick(size, (4, 16, 4, 32, 32), (4, 128, 32, 256, 512))
    p = gru_params(2000, F, H)

    def loss(p, xs):
        z = jnp.zeros((B, H))
        hs = [lax.scan(lambda h, x: gru_cell(p, h, x), z, xs[k])[0] for k in range(K)]
        return sum(((hs[k] - hs[(k + 1) % K]) ** 2).mean() for k in range(K))

    return jax.value_and_grad(loss), (p, N(2001, (K, T, B, F), 1.0)), {"rtol": 1e-3}


@program("bilstm_hoisted_grad2")
def _(size):
    # ELMo-like: 2 stacked biLSTM layers, input projections computed before the scans, grad
    T, B, F, H = pick(size, (32, 8, 64, 64), (128, 32, 512, 512))
    ps = [
        [lstm_params(2010 + 4 * k + 2 * d, F if k == 0 else 2 * H, H) for d in range(2)]
        for k in range(2)
    ]

    def loss(ps, xs):
        z = jnp.zeros((B, H))
        for pf, pb in ps:
            gf = xs @ pf["wx"] + pf["b"]
            gb = xs @ pb["wx"] + pb["b"]
            _, f = lax.scan(hoisted_lstm_step(pf["wh"]), (z, z), gf)
            _, b = lax.scan(hoisted_lstm_step(pb["wh"]), (z, z), gb, reverse=True)
            xs = jnp.concatenate([f, b], -1)
        return (xs**2).mean()

    return jax.grad(loss), (ps, N(2030, (T, B, F), 1.0)), {"rtol": 1e-3}


@program("gru_lm_head")
def _(size):
    T, B, E, H, V = pick(size, (32, 8, 64, 128, 512), (128, 32, 512, 1024, 8192))
    p = {"emb": N(2040, (V, E), 0.1), "gru": gru_params(2041, E, H), "out": N(2043, (H, V))}

    def loss(p, toks):
        xs = p["emb"][toks]
        _, hs = lax.scan(lambda h, x: gru_cell(p["gru"], h, x), jnp.zeros((B, H)), xs)
        logits = hs @ p["out"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), toks[..., None], -1))

    toks = jax.random.randint(jax.random.PRNGKey(2044), (T, B), 0, V)
    return jax.value_and_grad(loss), (p, toks), {"rtol": 1e-3}


@program("rnn_ensemble_3")
def _(size):
    # 3 identical LSTMs over the same input (ensemble), forward
    T, B, F, H = pick(size, (32, 8, 32, 64), (128, 32, 256, 512))
    ps = [lstm_params(2050 + 2 * i, F, H) for i in range(3)]

    def fn(ps, xs):
        z = jnp.zeros((B, H))
        outs = [lax.scan(lambda c, x, p=p: lstm_cell(p, c, x), (z, z), xs)[1] for p in ps]
        return sum(outs) / 3

    return fn, (ps, N(2060, (T, B, F), 1.0)), {"grad": True, "rtol": 1e-3}


@program("mode_bait_wide_chains")
def _(size):
    # 16 independent chains of mid-size matmuls, all different shapes (no batching)
    s = pick(size, 1, 2)
    dims = [128 * s + 16 * i for i in range(16)]
    ws = [[N(2100 + 10 * i + j, (d, d)) for j in range(8)] for i, d in enumerate(dims)]
    xs = [N(2300 + i, (64 * s, d), 1.0) for i, d in enumerate(dims)]

    def fn(ws, xs):
        outs = []
        for chain, x in zip(ws, xs, strict=False):
            for w in chain:
                x = jax.nn.relu(x @ w) + 0.1 * x
            outs.append(x.mean())
        return jnp.stack(outs)

    return fn, (ws, xs), {}


@program("mode_bait_scans_refused")
def _(size):
    # 6 independent scans with different carry shapes (no batching) and moderate bodies
    T = pick(size, 64, 256)
    dims = [(16, 128), (32, 96), (24, 160), (8, 192), (40, 64), (12, 224)]
    ws = [N(2400 + i, (d, d)) for i, (_, d) in enumerate(dims)]
    cs = [N(2410 + i, (b, d), 1.0) for i, (b, d) in enumerate(dims)]

    def fn(ws, cs):
        return [
            lax.scan(lambda c, _, w=w: (jnp.tanh(c @ w) + 0.1 * c, None), c, None, length=T)[0]
            for w, c in zip(ws, cs, strict=False)
        ]

    return fn, (ws, cs), {}
