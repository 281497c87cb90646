"""The GPU suite: realistic programs, plain ``jax.jit`` against ``parallel_branches(target="gpu")``.

For every program it reports what decides whether jaxpar helps on a GPU:

* **launches** per run, plain -> jaxpar (loop bodies times their trip counts);
* **overlap**: stream regions in flight beside other work with no host-blocking op
  inside, out of all regions;
* the **estimated time ratio** jaxpar / plain from the compiled schedules
  (``jaxpar._compiled.estimate``), in XLA's default CUDA-graph mode (``lhs``) and with graphs
  ``off`` and ``concurrent``;
* **compile** status of the deviceless H200 compile (``ok``, an error, or a crash:
  every program runs in a child process, because XLA bugs kill the process);
* **values**: plain and jaxpar run on this machine's CPU give the same values.

Run::

    JAX_PLATFORMS=cpu python benchmarks/gpu_suite.py [--size full|small]
        [--programs a,b] [--json PATH] [--timeout S]
    python benchmarks/gpu_suite.py --list

On a machine with a GPU, ``--measure`` times both variants there instead of (as well
as) estimating, beside the estimate of the same compiled executables with this GPU's
profile (calibrated where ``benchmarks/calibrate.py`` wrote one): ``benchmarks/gpu.sh``
does that for a handful of programs after calibrating.

``tests/test_gpu_guard.py`` runs a few of these programs in-process (``evaluate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpar
from jaxpar._model.gpu import GPU_PROFILES, CommandBufferMode
from jaxpar._options import memory_floor
from jaxpar.passes import SUBGRAPH_KINDS

SIZES = ("full", "small")


@dataclasses.dataclass(frozen=True)
class Program:
    """One suite entry: ``build(size)`` returns ``(fn, args)`` with concrete arrays."""

    name: str
    description: str
    build: Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]
    rtol: float = 2e-4
    atol: float = 2e-5


PROGRAMS: dict[str, Program] = {}


def program(name: str, description: str, rtol: float = 2e-4, atol: float = 2e-5
            ) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    def register(build: Callable[[str], Any]) -> Callable[[str], Any]:
        PROGRAMS[name] = Program(name, description, build, rtol, atol)
        return build
    return register


def _normal(seed: int, shape: Sequence[int], scale: float | None = None) -> jax.Array:
    scale = 1.0 / math.sqrt(shape[-2]) if scale is None and len(shape) > 1 else (scale or 1.0)
    return jax.random.normal(jax.random.PRNGKey(seed), tuple(shape), jnp.float32) * scale


def _pick(size: str, full: Any, small: Any) -> Any:
    return full if size == "full" else small


# --------------------------------------------------------------------------- transformers


def _layer_norm(x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def _attention(p: Mapping[str, jax.Array], h: jax.Array, heads: int) -> jax.Array:
    b, s, d = h.shape
    q, k, v = (jnp.einsum("bsd,de->bse", h, p[n]).reshape(b, s, heads, d // heads)
               for n in ("wq", "wk", "wv"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    return out @ p["wo"]


def _mlp(p: Mapping[str, jax.Array], h: jax.Array) -> jax.Array:
    return jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def _block_params(seed: int, d: int, hidden: int) -> dict[str, jax.Array]:
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, hidden),
              "w2": (hidden, d)}
    return {n: _normal(seed + k, s) for k, (n, s) in enumerate(shapes.items())}


def _transformer_sizes(size: str) -> tuple[int, int, int, int, int]:
    return _pick(size, (4, 256, 512, 8, 2048), (2, 64, 128, 4, 256))  # b, s, d, heads, hidden


@program("transformer_block_grad", "pre-LN transformer block (attention + MLP), grad of "
         "a loss w.r.t. all weights")
def _transformer_block_grad(size: str) -> Any:
    b, s, d, heads, hidden = _transformer_sizes(size)

    def loss(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
        h = x + _attention(p, _layer_norm(x), heads)
        h = h + _mlp(p, _layer_norm(h))
        return (h ** 2).mean()

    return jax.grad(loss), (_block_params(0, d, hidden), _normal(9, (b, s, d), 1.0))


def _gptj_block(p: Mapping[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
    h = _layer_norm(x)
    return x + _attention(p, h, heads) + _mlp(p, h)


@program("gptj_parallel_block", "GPT-J parallel block: attention and MLP from one LN")
def _gptj(size: str) -> Any:
    b, s, d, heads, hidden = _transformer_sizes(size)
    return (lambda p, x: _gptj_block(p, x, heads)), (_block_params(1, d, hidden),
                                                    _normal(8, (b, s, d), 1.0))


@program("gptj_parallel_block_grad", "GPT-J parallel block, grad w.r.t. weights")
def _gptj_grad(size: str) -> Any:
    b, s, d, heads, hidden = _transformer_sizes(size)
    fn = jax.grad(lambda p, x: (_gptj_block(p, x, heads) ** 2).mean())
    return fn, (_block_params(2, d, hidden), _normal(7, (b, s, d), 1.0))


@program("attention", "multi-head causal self-attention, forward")
def _attention_program(size: str) -> Any:
    b, s, d, heads, _ = _pick(size, (4, 512, 512, 8, 0), (2, 64, 128, 4, 0))
    params = {n: _normal(3 + k, (d, d)) for k, n in enumerate(("wq", "wk", "wv", "wo"))}
    return (lambda p, x: _attention(p, x, heads)), (params, _normal(6, (b, s, d), 1.0))


# --------------------------------------------------------------------------- optax


def _mlp_params(seed: int, widths: Sequence[int]) -> list[dict[str, jax.Array]]:
    return [{"w": _normal(seed + k, (i, o)), "b": jnp.zeros((o,), jnp.float32)}
            for k, (i, o) in enumerate(itertools.pairwise(widths))]


def _mlp_apply(params: Sequence[Mapping[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def _adamw_step_fn(optimizer: Any) -> Callable[..., Any]:
    import optax

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(
            lambda p: ((_mlp_apply(p, x) - y) ** 2).mean())(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


@program("optax_adamw_step", "MLP training step with optax.adamw (6 leaves)")
def _optax_adamw(size: str) -> Any:
    import optax

    widths = _pick(size, (512, 1024, 1024, 256), (64, 128, 128, 32))
    batch = _pick(size, 256, 32)
    optimizer = optax.adamw(1e-3, weight_decay=1e-2)
    params = _mlp_params(10, widths)
    args = (params, jax.jit(optimizer.init)(params), _normal(11, (batch, widths[0]), 1.0),
            _normal(12, (batch, widths[-1]), 1.0))
    return _adamw_step_fn(optimizer), args


@program("optax_two_branch_step", "two independent models trained in one step "
         "(optax.adam each)")
def _optax_two_branch(size: str) -> Any:
    import optax

    widths = _pick(size, (512, 1024, 256), (64, 128, 32))
    batch = _pick(size, 256, 32)
    optimizer = optax.adam(1e-3)
    step = _adamw_step_fn(optimizer)

    def both(pa: Any, sa: Any, pb: Any, sb: Any, x: jax.Array, y: jax.Array) -> Any:
        return step(pa, sa, x, y), step(pb, sb, x, y)

    pa, pb = _mlp_params(20, widths), _mlp_params(30, widths)
    return both, (pa, jax.jit(optimizer.init)(pa), pb, jax.jit(optimizer.init)(pb),
                  _normal(21, (batch, widths[0]), 1.0), _normal(22, (batch, widths[-1]), 1.0))


# --------------------------------------------------------------------------- flax / equinox


@program("flax_linen_cnn_grad", "Flax Linen CNN (2 convs, dense head), grad of the loss")
def _flax_linen(size: str) -> Any:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(64, (3, 3))(x))
            x = x.mean((1, 2))
            return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))

    batch, hw = _pick(size, (64, 32), (8, 16))
    model = CNN()
    x = _normal(40, (batch, hw, hw, 3), 1.0)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), x)

    def loss(p: Any, x: jax.Array) -> jax.Array:
        return (model.apply(p, x) ** 2).mean()

    return jax.grad(loss), (params, x)


@program("flax_nnx_two_heads", "Flax NNX model with a shared trunk and two heads, "
         "functional grad (nnx.split/merge)")
def _flax_nnx(size: str) -> Any:
    from flax import nnx

    d, hidden, batch = _pick(size, (512, 1024, 256), (64, 128, 16))

    class TwoHeads(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.trunk = nnx.Linear(d, hidden, rngs=rngs)
            self.head_a = nnx.Linear(hidden, d, rngs=rngs)
            self.head_b = nnx.Linear(hidden, d, rngs=rngs)
            self.head_b2 = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = jax.nn.gelu(self.trunk(x))
            return jnp.tanh(self.head_a(h)) + self.head_b2(jax.nn.relu(self.head_b(h)))

    graphdef, state = nnx.split(TwoHeads(nnx.Rngs(0)))

    def loss(state: Any, x: jax.Array) -> jax.Array:
        return (nnx.merge(graphdef, state)(x) ** 2).mean()

    return jax.grad(loss), (state, _normal(41, (batch, d), 1.0))


@program("equinox_mlp_gru", "Equinox MLP encoder and a GRU over a sequence, side by side")
def _equinox(size: str) -> Any:
    import equinox as eqx

    d, hidden, steps = _pick(size, (256, 256, 64), (32, 32, 16))
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    mlp = eqx.nn.MLP(d, d, hidden, depth=3, key=keys[0])
    gru = eqx.nn.GRUCell(d, hidden, key=keys[1])
    params, static = eqx.partition((mlp, gru), eqx.is_array)

    def fn(params: Any, x: jax.Array, xs: jax.Array) -> Any:
        mlp, gru = eqx.combine(params, static)
        encoded = jax.vmap(mlp)(xs)

        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
            return gru(x, h), None

        final, _ = lax.scan(step, jnp.zeros((hidden,), jnp.float32), xs)
        return encoded.sum(0) + mlp(x), final

    return fn, (params, _normal(42, (d,), 1.0), _normal(43, (steps, d), 1.0))


# --------------------------------------------------------------------------- MoE, towers


def _moe(p: Mapping[str, Any], x: jax.Array) -> jax.Array:
    gates = jax.nn.softmax(x @ p["router"], axis=-1)
    out = jnp.zeros_like(x)
    for e, expert in enumerate(p["experts"]):
        out = out + gates[:, e:e + 1] * (jax.nn.gelu(x @ expert["w1"]) @ expert["w2"])
    return out


def _moe_params(size: str) -> tuple[dict[str, Any], jax.Array]:
    tokens, d, hidden = _pick(size, (1024, 512, 2048), (64, 64, 128))
    experts = [{"w1": _normal(50 + 2 * e, (d, hidden)), "w2": _normal(51 + 2 * e, (hidden, d))}
               for e in range(4)]
    return {"router": _normal(49, (d, 4)), "experts": experts}, _normal(48, (tokens, d), 1.0)


@program("moe_4_experts", "mixture of 4 experts, dense soft routing, forward")
def _moe_forward(size: str) -> Any:
    return _moe, _moe_params(size)


@program("moe_4_experts_grad", "mixture of 4 experts, grad w.r.t. weights")
def _moe_grad(size: str) -> Any:
    return jax.grad(lambda p, x: (_moe(p, x) ** 2).mean()), _moe_params(size)


@program("siamese_grad", "siamese network (shared tower on two inputs), contrastive "
         "loss, grad")
def _siamese(size: str) -> Any:
    widths, batch = _pick(size, ((512, 1024, 1024, 256), 256), ((64, 128, 32), 16))
    params = _mlp_params(60, widths)

    def loss(p: Any, a: jax.Array, b: jax.Array) -> jax.Array:
        za, zb = _mlp_apply(p, a), _mlp_apply(p, b)
        return ((za - zb) ** 2).sum(-1).mean()

    return jax.grad(loss), (params, _normal(61, (batch, widths[0]), 1.0),
                            _normal(62, (batch, widths[0]), 1.0))


@program("three_towers", "three towers with their own weights and inputs, joined by a "
         "head")
def _towers(size: str) -> Any:
    widths, batch = _pick(size, ((512, 1024, 512), 256), ((64, 128, 64), 16))
    towers = [_mlp_params(70 + 10 * t, widths) for t in range(3)]
    head = _normal(99, (3 * widths[-1], 10))

    def fn(towers: Any, head: jax.Array, xs: Sequence[jax.Array]) -> jax.Array:
        z = jnp.concatenate([_mlp_apply(t, x) for t, x in zip(towers, xs, strict=True)], -1)
        return z @ head

    xs = [_normal(80 + t, (batch, widths[0]), 1.0) for t in range(3)]
    return fn, (towers, head, xs)


@program("ensemble_same_width", "ensemble of 4 MLPs of one width")
def _ensemble_same(size: str) -> Any:
    widths, batch = _pick(size, ((256, 512, 512, 10), 256), ((32, 64, 10), 16))
    members = [_mlp_params(100 + 10 * m, widths) for m in range(4)]
    fn = (lambda members, x: jnp.stack([_mlp_apply(m, x) for m in members]).mean(0))
    return fn, (members, _normal(101, (batch, widths[0]), 1.0))


@program("ensemble_widths", "ensemble of 4 MLPs of different widths")
def _ensemble_widths(size: str) -> Any:
    base, batch = _pick(size, (128, 256), (16, 16))
    members = [_mlp_params(140 + 10 * m, (256 if size == "full" else 32, base * 2 ** m,
                                          base * 2 ** m, 10)) for m in range(4)]
    fn = (lambda members, x: jnp.stack([_mlp_apply(m, x) for m in members]).mean(0))
    return fn, (members, _normal(141, (batch, 256 if size == "full" else 32), 1.0))


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


@program("inception_block", "inception block: 1x1, 3x3, 5x5 and pool branches, "
         "concatenated", rtol=1e-3, atol=1e-4)
def _inception(size: str) -> Any:
    batch, hw, c = _pick(size, (16, 28, 128), (2, 8, 16))
    p = {"b1": _normal(200, (1, 1, c, c // 2), 0.1), "b3a": _normal(201, (1, 1, c, c // 2), 0.1),
         "b3b": _normal(202, (3, 3, c // 2, c), 0.05),
         "b5a": _normal(203, (1, 1, c, c // 4), 0.1),
         "b5b": _normal(204, (5, 5, c // 4, c // 2), 0.05),
         "bp": _normal(205, (1, 1, c, c // 2), 0.1)}

    def fn(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
        relu = jax.nn.relu
        pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
        return jnp.concatenate([
            relu(_conv(x, p["b1"])),
            relu(_conv(relu(_conv(x, p["b3a"])), p["b3b"])),
            relu(_conv(relu(_conv(x, p["b5a"])), p["b5b"])),
            relu(_conv(pooled, p["bp"]))], -1)

    return fn, (p, _normal(206, (batch, hw, hw, c), 1.0))


# --------------------------------------------------------------------------- training steps


def _train_step(loss: Callable[..., jax.Array], optimizer: Any) -> Callable[..., Any]:
    """One optax step of ``loss(params, *batch)``: new params, new state, the loss."""
    import optax

    def step(params: Any, opt_state: Any, *batch: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


@program("flax_vae_step", "Flax Linen VAE (flax/examples/vae: encoder, reparameterised "
         "latent, decoder), one optax.adam training step")
def _flax_vae(size: str) -> Any:
    import flax.linen as nn
    import optax

    pixels, hidden, latents, batch = _pick(size, (784, 500, 20, 128), (64, 48, 8, 16))

    class VAE(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, noise: jax.Array) -> Any:
            h = nn.relu(nn.Dense(hidden, name="enc_hidden")(x))
            mean = nn.Dense(latents, name="enc_mean")(h)
            logvar = nn.Dense(latents, name="enc_logvar")(h)
            z = mean + noise * jnp.exp(0.5 * logvar)
            h = nn.relu(nn.Dense(hidden, name="dec_hidden")(z))
            return nn.Dense(pixels, name="dec_out")(h), mean, logvar

    model = VAE()
    x = jax.nn.sigmoid(_normal(800, (batch, pixels), 1.0))
    noise = _normal(801, (batch, latents), 1.0)
    params = jax.jit(model.init)(jax.random.PRNGKey(8), x, noise)

    def loss(p: Any, x: jax.Array, noise: jax.Array) -> jax.Array:
        logits, mean, logvar = model.apply(p, x, noise)
        bce = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
        kld = -0.5 * (1 + logvar - mean ** 2 - jnp.exp(logvar)).sum(-1)
        return (bce + kld).mean()

    optimizer = optax.adam(1e-3)
    return _train_step(loss, optimizer), (params, jax.jit(optimizer.init)(params), x, noise)


def _wmt_sizes(size: str) -> tuple[int, int, int, int, int, int]:
    # batch, source length, target length, model width, heads, vocabulary
    return _pick(size, (8, 64, 64, 256, 8, 1024), (2, 16, 16, 64, 4, 128))


@program("wmt_transformer_step", "WMT-like encoder-decoder transformer (Flax Linen, as "
         "flax/examples/wmt), one optax.adamw step with a warm-up schedule",
         rtol=1e-3, atol=1e-4)
def _wmt_step(size: str) -> Any:
    import flax.linen as nn
    import optax

    batch, source_len, target_len, d, heads, vocab = _wmt_sizes(size)

    class Block(nn.Module):
        cross: bool = False
        causal: bool = False

        @nn.compact
        def __call__(self, x: jax.Array, memory: jax.Array | None = None) -> jax.Array:
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
            x = x + nn.SelfAttention(heads)(nn.LayerNorm()(x), mask=mask)
            if self.cross:
                x = x + nn.MultiHeadDotProductAttention(heads)(nn.LayerNorm()(x), memory)
            h = nn.relu(nn.Dense(4 * d)(nn.LayerNorm()(x)))
            return x + nn.Dense(d)(h)

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, source: jax.Array, target: jax.Array) -> jax.Array:
            embed = nn.Embed(vocab, d)
            memory = nn.LayerNorm()(Block()(embed(source)))
            y = Block(cross=True, causal=True)(embed(target), memory)
            return embed.attend(nn.LayerNorm()(y))

    model = Transformer()
    source = jax.random.randint(jax.random.PRNGKey(810), (batch, source_len), 0, vocab)
    target = jax.random.randint(jax.random.PRNGKey(811), (batch, target_len), 0, vocab)
    params = jax.jit(model.init)(jax.random.PRNGKey(812), source, target)

    def loss(p: Any, source: jax.Array, target: jax.Array) -> jax.Array:
        logits = model.apply(p, source, target)
        return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)
    optimizer = optax.adamw(schedule, b2=0.98, weight_decay=1e-4)
    return _train_step(loss, optimizer), (params, jax.jit(optimizer.init)(params), source, target)


@program("moe_train_step", "small mixture of 4 experts (Flax Linen, dense soft routing), "
         "one optax.adam training step")
def _moe_train_step(size: str) -> Any:
    import flax.linen as nn
    import optax

    tokens, d, hidden = _pick(size, (512, 256, 1024), (64, 32, 64))

    class MoE(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            gates = jax.nn.softmax(nn.Dense(4, name="router")(x), axis=-1)
            out = jnp.zeros_like(x)
            for e in range(4):
                h = nn.gelu(nn.Dense(hidden, name=f"expert{e}_in")(x))
                out = out + gates[:, e:e + 1] * nn.Dense(d, name=f"expert{e}_out")(h)
            return out

    model = MoE()
    x, y = _normal(820, (tokens, d), 1.0), _normal(821, (tokens, d), 1.0)
    params = jax.jit(model.init)(jax.random.PRNGKey(822), x)

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return ((model.apply(p, x) - y) ** 2).mean()

    optimizer = optax.adam(1e-3)
    return _train_step(loss, optimizer), (params, jax.jit(optimizer.init)(params), x, y)


# --------------------------------------------------------------------------- RNNs


def _lstm_cell(p: Mapping[str, jax.Array], carry: Any, x: jax.Array) -> Any:
    h, c = carry
    gates = x @ p["wx"] + h @ p["wh"] + p["b"]
    i, f, g, o = jnp.split(gates, 4, -1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h


def _gru_cell(p: Mapping[str, jax.Array], h: jax.Array, x: jax.Array) -> Any:
    z, r = jnp.split(jax.nn.sigmoid(x @ p["wx"][:, :2 * h.shape[-1]]
                                    + h @ p["wh"][:, :2 * h.shape[-1]]), 2, -1)
    n = jnp.tanh(x @ p["wx"][:, 2 * h.shape[-1]:] + (r * h) @ p["wh"][:, 2 * h.shape[-1]:])
    h = (1 - z) * n + z * h
    return h, h


def _rnn_sizes(size: str) -> tuple[int, int, int, int]:
    return _pick(size, (128, 32, 256, 256), (16, 4, 32, 32))  # steps, batch, features, hidden


@program("lstm_grad", "LSTM over a sequence (lax.scan), grad w.r.t. weights")
def _lstm(size: str) -> Any:
    steps, batch, features, hidden = _rnn_sizes(size)
    p = {"wx": _normal(300, (features, 4 * hidden)), "wh": _normal(301, (hidden, 4 * hidden)),
         "b": jnp.zeros((4 * hidden,), jnp.float32)}

    def loss(p: Any, xs: jax.Array) -> jax.Array:
        zeros = jnp.zeros((batch, hidden), jnp.float32)
        _, hs = lax.scan(lambda c, x: _lstm_cell(p, c, x), (zeros, zeros), xs)
        return (hs ** 2).mean()

    return jax.grad(loss), (p, _normal(302, (steps, batch, features), 1.0))


@program("bigru", "bidirectional GRU (two scans over the sequence), forward")
def _bigru(size: str) -> Any:
    steps, batch, features, hidden = _rnn_sizes(size)
    params = [{"wx": _normal(310 + 2 * k, (features, 3 * hidden)),
               "wh": _normal(311 + 2 * k, (hidden, 3 * hidden))} for k in range(2)]

    def fn(params: Any, xs: jax.Array) -> jax.Array:
        zeros = jnp.zeros((batch, hidden), jnp.float32)
        _, fwd = lax.scan(lambda h, x: _gru_cell(params[0], h, x), zeros, xs)
        _, bwd = lax.scan(lambda h, x: _gru_cell(params[1], h, x), zeros, xs, reverse=True)
        return jnp.concatenate([fwd, bwd], -1)

    return fn, (params, _normal(314, (steps, batch, features), 1.0))


@program("bilstm_grad", "bidirectional LSTM, grad w.r.t. weights")
def _bilstm(size: str) -> Any:
    steps, batch, features, hidden = _rnn_sizes(size)
    params = [{"wx": _normal(320 + 2 * k, (features, 4 * hidden)),
               "wh": _normal(321 + 2 * k, (hidden, 4 * hidden)),
               "b": jnp.zeros((4 * hidden,), jnp.float32)} for k in range(2)]

    def loss(params: Any, xs: jax.Array) -> jax.Array:
        zeros = jnp.zeros((batch, hidden), jnp.float32)
        _, fwd = lax.scan(lambda c, x: _lstm_cell(params[0], c, x), (zeros, zeros), xs)
        _, bwd = lax.scan(lambda c, x: _lstm_cell(params[1], c, x), (zeros, zeros), xs,
                          reverse=True)
        return (fwd * bwd).mean()

    return jax.grad(loss), (params, _normal(324, (steps, batch, features), 1.0))


# --------------------------------------------------------------------------- linalg


@program("slogdet_inv", "log-determinant and inverse of one SPD matrix, plus a solve",
         rtol=1e-3, atol=1e-4)
def _slogdet_inv(size: str) -> Any:
    n = _pick(size, 512, 32)
    a = _normal(400, (n, n))
    spd = a @ a.T + n * jnp.eye(n, dtype=jnp.float32) * 0.1

    def fn(s: jax.Array, b: jax.Array) -> Any:
        sign, logdet = jnp.linalg.slogdet(s)
        return sign * logdet, jnp.linalg.inv(s) @ b

    return fn, (spd, _normal(401, (n, 16), 1.0))


@program("expm_pair", "matrix exponentials of two matrices (jax.scipy.linalg.expm)",
         rtol=1e-3, atol=1e-4)
def _expm(size: str) -> Any:
    n = _pick(size, 256, 16)
    import jax.scipy.linalg as jsl
    fn = (lambda a, b: (jsl.expm(a), jsl.expm(b)))
    return fn, (_normal(410, (n, n), 0.5 / math.sqrt(n)), _normal(411, (n, n), 0.5 / math.sqrt(n)))


# --------------------------------------------------------------------------- realistic sizes
# Steps at the sizes users train at, where memory is what a user runs out of: jaxpar's
# program must need no more than the default budget (10%, or the H200's floor of 33 MiB)
# more temporary memory than plain jit's.


def _gpt_block(p: Mapping[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
    h = x + _attention(p, _layer_norm(x), heads)
    return h + _mlp(p, _layer_norm(h))


@program("transformer_train_step", "12-layer transformer training step (d 512, T 256, "
         "B 8 at full size), layers written out, optax.adamw", rtol=2e-3, atol=2e-4)
def _transformer_train_step(size: str) -> Any:
    import optax

    layers, batch, seq, d, heads, hidden = _pick(size, (12, 8, 256, 512, 8, 2048),
                                                 (2, 2, 32, 64, 4, 128))
    params = [_block_params(900 + 10 * k, d, hidden) for k in range(layers)]

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        for block in p:
            x = _gpt_block(block, x, heads)
        return ((_layer_norm(x) - y) ** 2).mean()

    optimizer = optax.adamw(1e-4)
    return _train_step(loss, optimizer), (
        params, jax.jit(optimizer.init)(params), _normal(950, (batch, seq, d), 1.0),
        _normal(951, (batch, seq, d), 1.0))


@program("mlp_ensemble_step", "8-member MLP ensemble (784-1024-1024-10 at full size), one "
         "optax.adam step of every member, members written out", rtol=1e-3, atol=1e-4)
def _mlp_ensemble_step(size: str) -> Any:
    import optax

    members, widths, batch = _pick(size, (8, (784, 1024, 1024, 10), 256),
                                   (4, (32, 64, 64, 10), 16))
    params = [_mlp_params(960 + 10 * k, widths) for k in range(members)]

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return sum(((_mlp_apply(member, x) - y) ** 2).mean() for member in p)

    optimizer = optax.adam(1e-3)
    return _train_step(loss, optimizer), (
        params, jax.jit(optimizer.init)(params), _normal(990, (batch, widths[0]), 1.0),
        _normal(991, (batch, widths[-1]), 1.0))


@program("two_tower_step", "two-tower retrieval training step (width 2048, batch 512 at "
         "full size): query and item towers, in-batch softmax, optax.adam",
         rtol=1e-3, atol=1e-4)
def _two_tower_step(size: str) -> Any:
    import optax

    width, features, batch = _pick(size, (2048, 512, 512), (64, 32, 16))
    towers = {"query": _mlp_params(1000, (features, width, width, 256)),
              "item": _mlp_params(1010, (features, width, width, 256))}

    def loss(p: Any, queries: jax.Array, items: jax.Array) -> jax.Array:
        q = _mlp_apply(p["query"], queries)
        v = _mlp_apply(p["item"], items)
        logits = q @ v.T
        return -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=-1)))

    optimizer = optax.adam(1e-3)
    return _train_step(loss, optimizer), (
        towers, jax.jit(optimizer.init)(towers), _normal(1020, (batch, features), 1.0),
        _normal(1021, (batch, features), 1.0))


# --------------------------------------------------------------------------- seeds


def _seed_step1(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return carry + x @ x @ x @ x @ x, None


def _seed_step2(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return carry + jnp.tanh(x @ x) @ x * 0.5, None


def _seed_args(size: str) -> tuple[jax.Array, ...]:
    n, steps = _pick(size, (100, 2000), (16, 40))
    return (_normal(500, (n, n), 0.1), _normal(501, (n, n), 0.1),
            _normal(502, (steps, n, n), 0.3), _normal(503, (steps, n, n), 0.3))


@program("seed_002_two_scans", "the two-scan story: two independent scans, different bodies",
         rtol=1e-3, atol=1e-3)
def _seed_two(size: str) -> Any:
    return (lambda a, b, xs1, xs2: (lax.scan(_seed_step1, a, xs1)[0],
                                    lax.scan(_seed_step2, b, xs2)[0])), _seed_args(size)


@program("seed_002_identical_scans", "the two-scan story: two independent scans, identical bodies",
         rtol=1e-3, atol=1e-3)
def _seed_identical(size: str) -> Any:
    return (lambda a, b, xs1, xs2: (lax.scan(_seed_step1, a, xs1)[0],
                                    lax.scan(_seed_step1, b, xs2)[0])), _seed_args(size)


@program("seed_000_bidirectional_matmul", "the collective matmul: one step, forward "
         "and backward ring shifts of two blocks, each with a matmul (one device: the "
         "ppermutes are local rolls)")
def _seed_000(size: str) -> Any:
    n = _pick(size, 1024, 64)

    def fn(x: jax.Array, w: jax.Array) -> jax.Array:
        left, right = jnp.split(x, 2, 0)
        forward = jnp.roll(left, 1, 0) @ w
        backward = jnp.roll(right, -1, 0) @ w
        return jnp.concatenate([forward, backward], 0) + x @ w

    return fn, (_normal(600, (n, n), 1.0), _normal(601, (n, n)))


@program("tiny_scan", "long scan with a tiny body (launch bound)", rtol=1e-3, atol=1e-4)
def _tiny_scan(size: str) -> Any:
    steps = _pick(size, 10_000, 100)

    def fn(c: jax.Array, xs: jax.Array) -> Any:
        return lax.scan(lambda c, x: (jnp.sin(c) * 0.9 + x, c.sum()), c, xs)

    return fn, (_normal(700, (64,), 1.0), _normal(701, (steps, 64), 0.1))


# --------------------------------------------------------------------------- evaluation


def _max_abs_diff(a: Any, b: Any) -> tuple[float, bool]:
    worst, same = 0.0, True
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(leaves_a) != len(leaves_b):
        return math.inf, False
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            return math.inf, False
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
        same = same and bool(np.allclose(x, y, rtol=_RTOL[0], atol=_ATOL[0], equal_nan=True))
    return worst, same


_RTOL, _ATOL = [2e-4], [2e-5]


def evaluate(name: str, size: str = "full", values: bool = True,
             gpu: str = "h200", command_buffers: str | None = None) -> dict[str, Any]:
    """One program: deviceless preview, estimates, and (``values``) the CPU comparison.

    ``command_buffers`` is the CUDA-graph mode jaxpar plans for and is judged in
    (``gpu_preview``'s argument; None: the mode ``XLA_FLAGS`` sets). ``mode`` and
    ``judged_ratio`` in the result say which mode and jaxpar's estimated time over plain
    in it.
    """
    entry = PROGRAMS[name]
    fn, args = entry.build(size)
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    result: dict[str, Any] = {"name": name, "description": entry.description, "size": size}
    started = time.perf_counter()
    try:
        preview = jaxpar.gpu_preview(fn, *specs, gpu=gpu, command_buffers=command_buffers)
    except Exception as error:  # a compile error is a result here, not a crash
        result["compile"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    else:
        result["compile"] = "ok"
        plain, fast = preview.plain, preview.jaxpar
        result.update({
            "launches": [plain.launches, fast.launches],
            # Temporary bytes of each compile (memory_analysis()), plain in the user's
            # mode, jaxpar in its own; and what the plan's memory model estimated.
            "temp_bytes": [plain.temp_bytes, fast.temp_bytes],
            "estimated_temp_bytes": ([preview.plan.memory.plain_bytes,
                                      preview.plan.memory.jaxpar_bytes]
                                     if preview.plan.memory is not None else None),
            "host_syncs": [plain.host_syncs, fast.host_syncs],
            "regions": len(fast.regions),
            "overlapping_regions": fast.overlapping_regions,
            "capturable_overlapping_regions": sum(r.overlaps and r.capturable
                                                  for r in fast.regions),
            "regions_detail": [r.to_dict() for r in fast.regions],
            "estimated_us": {mode: [dict(plain.estimated_us_by_mode)[mode], us]
                             for mode, us in fast.estimated_us_by_mode},
            "time_ratio": {mode: us / dict(plain.estimated_us_by_mode)[mode]
                           for mode, us in fast.estimated_us_by_mode},
            "verdict": preview.verdict,
            # jaxpar in the mode its plan chose, against plain in the user's mode.
            "chosen_mode": preview.jaxpar_command_buffers.value,
            # Each mode that beat the user's at the GPU model's nominal figures, with its
            # ratio at both ends of their ranges (a choice must hold at the pessimistic).
            "mode_ends": ({e.mode.value: [e.pessimistic_ratio, e.optimistic_ratio]
                           for e in preview.plan.mode.ends}
                          if preview.plan.mode is not None else {}),
            "xla_options": dict(preview.xla_options),
            "chosen_ratio": preview.time_ratio,
            "runs_concurrently": fast.runs_concurrently,
            "plain_runs_concurrently": plain.runs_concurrently,
            "concurrent_kernels": fast.concurrent_kernels,
            "kept_overlaps": fast.estimate.kept_overlaps if fast.estimate else 0,
            "mode": preview.command_buffers.value,
            # "chosen": plain in the user's mode, jaxpar in the one its plan chose; else
            # the one mode both were compiled in.
            "configuration": "chosen" if command_buffers is None else command_buffers,
            "judged_ratio": preview.time_ratio,
            "plan": {"sections": len(preview.plan.sections), "regions": preview.plan.num_regions,
                     "loops": sum(d.kind not in SUBGRAPH_KINDS for d in preview.plan.decisions),
                     "subgraphs": sum(d.kind in SUBGRAPH_KINDS for d in preview.plan.decisions)},
        })
    result["compile_s"] = time.perf_counter() - started
    if values:
        _RTOL[0], _ATOL[0] = entry.rtol, entry.atol
        try:
            expected = jax.jit(fn)(*args)
            got = jax.jit(jaxpar.parallel_branches(fn, target="gpu"))(*args)
            diff, same = _max_abs_diff(expected, got)
            result["values"] = "equal" if same else f"DIFFER (max abs diff {diff:.3g})"
            result["max_abs_diff"] = diff
        except Exception as error:
            result["values"] = f"error: {type(error).__name__}: {str(error)[:200]}"
    return result


# The most temporary memory jaxpar's program may need beyond plain jit's, once compiled:
# 10% or the H200's floor (1/4096 of its 141 GB), whichever is more (the default memory
# budget of the GPU the suite compiles for, ``parallel_branches(memory=)``).
MEMORY_FRACTION, MEMORY_BYTES = 0.10, memory_floor(GPU_PROFILES["h200"].memory_bytes)


def memory_failure(result: Mapping[str, Any]) -> str | None:
    """Why the compiles' temporaries break the memory bar (None when they do not)."""
    plain, fast = result.get("temp_bytes") or (None, None)
    if plain is None or fast is None:
        return None
    if fast > plain + max(MEMORY_FRACTION * plain, MEMORY_BYTES):
        return (f"temporary memory {plain / 2**20:.2f} -> {fast / 2**20:.2f} MiB "
                f"(x{fast / max(plain, 1):.2f})")
    return None


def guard_failures(result: Mapping[str, Any], slowdown: float = 0.01) -> list[str]:
    """Why ``result`` breaks the guard's bar (empty when it does not): a compile error,
    different values, more launches without a region that really overlaps other work, an
    estimate slower than plain by more than ``slowdown`` in the mode the program was
    judged in (``evaluate``'s ``mode``), or more temporary memory than the budget allows
    (``memory_failure``)."""
    problems = []
    if result.get("compile") != "ok":
        return [f"compile: {result.get('compile')}"]
    memory = memory_failure(result)
    if memory is not None:
        problems.append(memory)
    if "values" in result and result["values"] != "equal":
        problems.append(f"values: {result['values']}")
    plain, fast = result["launches"]
    # Real overlap: stream regions that overlap other work, or (in the mode jaxpar chose
    # for the function) independent kernels as parallel graph nodes.
    if fast > plain and not (result["overlapping_regions"] or result.get("runs_concurrently")):
        problems.append(f"more launches ({plain} -> {fast}) without real overlap")
    mode = result.get("mode", CommandBufferMode.LHS.value)
    ratio = result.get("judged_ratio", result["time_ratio"][mode])
    if ratio > 1 + slowdown:
        problems.append(f"estimated slowdown x{ratio:.3f} in {mode} mode ({result['verdict']})")
    return problems


def measure(name: str, size: str = "full", repeats: int = 20,
            command_buffers: str = "lhs") -> dict[str, Any]:
    """On a real GPU: median time of plain and jaxpar, interleaved, and their ratio.

    ``command_buffers`` names the CUDA-graph mode the process runs with (set through
    ``XLA_FLAGS`` by ``benchmarks/gpu.sh``); the estimate of the same compiled programs
    under that mode comes back beside the measurement, so the two can be compared.
    """
    from jaxpar._compiled.estimate import estimate_hlo
    from jaxpar._model.gpu import local_gpu_profile

    fn, args = PROGRAMS[name].build(size)
    args = jax.device_put(args)
    gpu = local_gpu_profile()  # this GPU's figures: calibrated, built-in, or generic
    profile = gpu.name
    # The executables estimated are the ones timed, each compiled once; first_call_s is
    # trace, plan, compile and the first run.
    variants, first = {}, {}
    for key, function in (("plain", fn), ("jaxpar", jaxpar.parallel_branches(fn))):
        started = time.perf_counter()
        variants[key] = jax.jit(function).lower(*args).compile()
        jax.block_until_ready(variants[key](*args))
        first[key] = time.perf_counter() - started
    estimated = {key: estimate_hlo(compiled.as_text() or "", gpu=gpu,
                                   command_buffers=command_buffers).microseconds
                 for key, compiled in variants.items()}
    samples: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(repeats):
        for key, compiled in variants.items():
            started = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            samples[key].append(time.perf_counter() - started)
    ratios = [j / p for p, j in zip(samples["plain"], samples["jaxpar"], strict=True)]
    return {"median_us": {k: statistics.median(v) * 1e6 for k, v in samples.items()},
            "ratio": statistics.median(ratios), "first_call_s": first,
            "command_buffers": command_buffers, "profile": profile,
            "profile_source": gpu.source, "calibrated": sorted(gpu.measured),
            "device_kind": jax.devices()[0].device_kind, "estimated_us": estimated,
            "estimated_ratio": estimated["jaxpar"] / estimated["plain"]}


# --------------------------------------------------------------------------- driver


def _child(name: str, size: str, out: str, values: bool, do_measure: bool,
           command_buffers: str) -> None:
    result = evaluate(name, size, values) if not do_measure else {"name": name}
    if do_measure:
        result["measured"] = measure(name, size, command_buffers=command_buffers)
    with open(out, "w") as handle:
        json.dump(result, handle)


def run_isolated(name: str, size: str, timeout: float, values: bool = True,
                 do_measure: bool = False, command_buffers: str = "lhs") -> dict[str, Any]:
    """``evaluate`` in a child process, so that an XLA crash is a row, not the end."""
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", name, "--size", size,
                   "--out", out] + ([] if values else ["--no-values"]) \
            + (["--measure", "--command-buffers", command_buffers] if do_measure else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"name": name, "compile": f"timeout after {timeout:.0f} s"}
        if os.path.exists(out):
            with open(out) as handle:
                return dict(json.load(handle))
        tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
        return {"name": name, "compile": f"crash (exit {done.returncode}): {tail[0][:200]}"}


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def table(results: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| program | launches plain -> jaxpar | overlap | est. ratio lhs | off | "
             "concurrent | compile | values |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("compile") == "ok":
            plain, fast = r["launches"]
            ratios = r["time_ratio"]
            overlap = f"{r['overlapping_regions']}/{r['regions']}" if r["regions"] else "-"
            lines.append(f"| {r['name']} | {plain:,} -> {fast:,} | {overlap} | "
                         f"x{ratios['lhs']:.3f} | x{ratios['off']:.3f} | "
                         f"x{ratios['concurrent']:.3f} | ok | {r.get('values', '-')} |")
        else:
            lines.append(f"| {r['name']} | - | - | - | - | - | {r.get('compile')} | "
                         f"{r.get('values', '-')} |")
    return "\n".join(lines)


def modes_table(results: Sequence[Mapping[str, Any]]) -> str:
    """jaxpar in its chosen CUDA-graph mode against plain in the user's, with every mode
    that won at the GPU model's nominal figures and its ratio at both ends of their
    ranges (pessimistic, optimistic): a choice holds at the pessimistic end."""
    lines = ["| program | chosen mode | launches plain -> jaxpar | parallel graph nodes | "
             "est. ratio (chosen vs plain lhs) | modes winning at nominal figures: "
             "ratio at the pessimistic / optimistic end |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if r.get("compile") != "ok" or "chosen_mode" not in r:
            continue
        plain, fast = r["launches"]
        ends = "; ".join(f"{mode} x{low:.3f} / x{high:.3f}"
                         for mode, (low, high) in r.get("mode_ends", {}).items()) or "-"
        lines.append(f"| {r['name']} | {r['chosen_mode']} | {plain:,} -> {fast:,} | "
                     f"{r['concurrent_kernels']:,} | x{r['chosen_ratio']:.3f} | {ends} |")
    return "\n".join(lines)


def memory_table(results: Sequence[Mapping[str, Any]]) -> str:
    """Temporary memory of each compile (``memory_analysis()``), plain in the user's mode
    against jaxpar in its own, beside the plan's memory model, and the bar."""
    lines = ["| program | plain temp | jaxpar temp | ratio | model: plain -> jaxpar | bar |",
             "|---|---|---|---|---|---|"]
    mib = 2**20
    for r in results:
        if r.get("compile") != "ok" or not r.get("temp_bytes"):
            continue
        plain, fast = r["temp_bytes"]
        model = r.get("estimated_temp_bytes") or [float("nan")] * 2
        lines.append(f"| {r['name']} | {plain / mib:,.2f} MiB | {fast / mib:,.2f} MiB | "
                     f"x{fast / max(plain, 1):.2f} | {model[0] / mib:,.2f} -> "
                     f"{model[1] / mib:,.2f} MiB | {memory_failure(r) or 'ok'} |")
    return "\n".join(lines)


def measured_table(results: Sequence[Mapping[str, Any]]) -> str:
    """``--measure`` results: measured time ratio jaxpar / plain against the estimate of
    the same compiled programs (a quotient far from 1 means the model is wrong there)."""
    lines = ["| program | mode | plain us | jaxpar us | measured ratio | estimated ratio | "
             "estimated / measured | profile |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("measured")
        if not m:
            lines.append(f"| {r['name']} | - | - | - | - | - | - | {r.get('compile')} |")
            continue
        calibrated = f"calibrated ({len(m['calibrated'])} figures)" if m.get("calibrated") \
            else "built-in"
        lines.append(f"| {r['name']} | {m['command_buffers']} | {m['median_us']['plain']:,.1f} | "
                     f"{m['median_us']['jaxpar']:,.1f} | x{m['ratio']:.3f} | "
                     f"x{m['estimated_ratio']:.3f} | {m['estimated_ratio'] / m['ratio']:.2f} | "
                     f"{m['profile']}, {calibrated} |")
    return "\n".join(lines)


def guard_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The guard's cases (``evaluate`` results with a ``mode``): one row per program, size
    and CUDA-graph mode, with launches, the estimated ratio in that mode and what fails."""
    lines = ["| program | size | mode | launches plain -> jaxpar | est. ratio | guard |",
             "|---|---|---|---|---|---|"]
    for r in results:
        failures = "; ".join(guard_failures(r)) or "ok"
        if r.get("compile") == "ok":
            plain, fast = r["launches"]
            shown = (f"chosen: {r['chosen_mode']} (plain {r['mode']})"
                     if r.get("configuration") == "chosen" else r["mode"])
            lines.append(f"| {r['name']} | {r['size']} | {shown} | {plain:,} -> {fast:,} | "
                         f"x{r['judged_ratio']:.3f} | {failures} |")
        else:
            lines.append(f"| {r['name']} | {r['size']} | - | - | - | {failures} |")
    return "\n".join(lines)


def summary(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r.get("compile") == "ok"]
    return {
        "programs": len(results), "compiled": len(ok),
        "geomean_ratio": {mode: geomean([r["time_ratio"][mode] for r in ok])
                          for mode in ("lhs", "off", "concurrent")},
        "with_real_overlap": sum(r["overlapping_regions"] > 0 for r in ok),
        "fewer_launches": sum(r["launches"][1] < r["launches"][0] for r in ok),
        "more_launches": sum(r["launches"][1] > r["launches"][0] for r in ok),
        "slower_than_1pct": sum(r["time_ratio"]["lhs"] > 1.01 for r in ok),
        "values_differ": sum(r.get("values") not in (None, "equal") for r in results),
        "guard_failures": sum(bool(guard_failures(r)) for r in results),
        "chosen_modes": {mode.value: sum(r.get("chosen_mode") == mode.value for r in ok)
                         for mode in CommandBufferMode},
        "over_memory_budget": sum(memory_failure(r) is not None for r in ok),
        "gaining_concurrency": sum(bool(r.get("runs_concurrently"))
                                   and r.get("chosen_ratio", 1.0) <= 0.95 for r in ok),
        "chosen_slower_than_1pct": sum(r.get("chosen_ratio", 1.0) > 1.01 for r in ok),
        "geomean_chosen_ratio": geomean([r["chosen_ratio"] for r in ok if "chosen_ratio" in r]),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--programs", default="", help="comma-separated names (default all)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per program")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--no-values", action="store_true", help="skip the CPU comparison")
    parser.add_argument("--measure", action="store_true",
                        help="time plain and jaxpar on this machine's GPU")
    parser.add_argument("--command-buffers", choices=[m.value for m in CommandBufferMode],
                        default=CommandBufferMode.LHS.value,
                        help="with --measure: the CUDA-graph mode XLA_FLAGS set, for the "
                        "estimate shown beside the measurement")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        _child(options.child, options.size, options.out, not options.no_values,
               options.measure, options.command_buffers)
        return {}
    if options.list:
        for entry in PROGRAMS.values():
            print(f"{entry.name:32} {entry.description}")
        return {}
    names = [n for n in options.programs.split(",") if n] or list(PROGRAMS)
    unknown = sorted(set(names) - set(PROGRAMS))
    if unknown:
        parser.error(f"unknown programs {unknown}; --list shows them")
    started = time.perf_counter()
    results = []
    for name in names:
        result = run_isolated(name, options.size, options.timeout, not options.no_values,
                              options.measure, options.command_buffers)
        results.append(result)
        if options.measure:
            m = result.get("measured", {})
            print(f"{name:32} measured x{m.get('ratio', float('nan')):.3f} "
                  f"estimated x{m.get('estimated_ratio', float('nan')):.3f} "
                  f"({options.command_buffers}) {m.get('median_us', result.get('compile'))}",
                  flush=True)
        else:
            print(f"{name:32} {result.get('compile')}: {result.get('verdict', '')} "
                  f"[values {result.get('values', '-')}]", flush=True)
    report: dict[str, Any] = {
        "meta": {"jax": jax.__version__, "jaxpar": jaxpar.__version__, "size": options.size,
                 "backend": jax.default_backend(), "wall_s": time.perf_counter() - started},
        "results": results}
    if options.measure:
        print()
        print(measured_table(results))
    else:
        report["summary"] = summary(results)
        print()
        print(table(results))
        print()
        print(modes_table(results))
        print()
        print(memory_table(results))
        print()
        print(json.dumps(report["summary"], indent=1))
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
