"""Program styles written apart from jaxmem (session 36's sweep), each a
:class:`~bench.unseen_programs.Case`. Two of them crashed the memory model before that
session's fixes (``tied``, ``dpsgd``):

* ``tied``: a decoder with tied input and output embeddings, ``jax.nn.dot_product_attention``
  (``is_causal``) over a fused q/k/v projection, a loss over ``x[:, :-1]`` with
  ``has_aux`` metrics, under ``optax.chain(clip_by_global_norm, adamw)`` with a warmup
  cosine schedule; a step counter in the state and a metrics dict out;
* ``dpsgd``: differentially private SGD: per-example gradients by ``jax.vmap(jax.grad)``,
  each clipped to norm 1, averaged, with Gaussian noise from a typed key;
* ``packed``: packed sequences: attention masked to each token's own segment (segment ids
  an argument), a loss weighted to within-segment targets, sequence length a multiple of
  8 (``"b, 8*k"``), under AdamW;
* ``bf16-params``: parameters, activations and gradients all in bfloat16 (softmax in
  float32), a dict batch with a loss mask, under ``optax.adam`` with float32 moments;
* ``rnn``: an LSTM language model, ``lax.scan`` over the symbolic time axis, under SGD
  with momentum;
* ``nnx-bn``: a Flax NNX model with ``nnx.BatchNorm`` and ``nnx.Dropout`` (its rng stream,
  typed keys, in the state), trained by ``nnx.Optimizer`` through ``nnx.split``/``merge``;
* ``misc``: grouped-query ``jax.nn.dot_product_attention`` with a distance bias, a
  ``jax.custom_jvp`` activation, spectral normalisation by power iteration in a
  ``lax.while_loop`` (under ``stop_gradient``), dropout keys split in the step and
  carried in the state;
* ``unet``: a Flax linen 1D U-Net (strided and transposed convolutions, concatenated
  skips) over length ``4 k``, under Adam;
* ``cls``: an encoder over ``uint8`` features with a random crop by ``dynamic_slice`` at
  a traced offset and a CLS token (``s + 1`` positions), under AdamW.

Example:
    >>> case = STYLES["dpsgd"](True)
    >>> state, norm = case.step(case.state, *case.data)
    >>> float(norm) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.programs import optax_step
from bench.unseen_programs import VOCAB, Case, tokens

WIDTH, HEADS = 64, 4


def _sizes(quick: bool, full_layers: int = 3) -> tuple[int, tuple[int, int]]:
    return (1, (2, 16)) if quick else (full_layers, (8, 64))


def _normal(seed: int, **shapes: tuple[int, ...]) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {n: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32) for n, s in shapes.items()}


def _layer(seed: int) -> dict[str, jax.Array]:
    d = WIDTH
    return {"g": jnp.ones(d), **_normal(seed, qkv=(d, 3 * d), o=(d, d), up=(d, 4 * d),
                                          down=(4 * d, d))}


def _norm(x: jax.Array, g: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g


def _heads(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """``[b, s, 3, heads, d / heads]``: q, k and v indexed off one projection."""
    return (_norm(x, p["g"]) @ p["qkv"]).reshape(*x.shape[:2], 3, HEADS, -1)


def tied_case(quick: bool) -> Case:
    """The tied-embedding decoder with ``has_aux`` metrics and a step counter."""
    layers, (b, s) = _sizes(quick)
    params = {"emb": _normal(0, e=(VOCAB, WIDTH))["e"],
              "layers": [_layer(k + 1) for k in range(layers)]}
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)))

    def loss(p: dict[str, Any], tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        x = p["emb"][tokens]
        for q in p["layers"]:
            h = _heads(x, q)
            a = jax.nn.dot_product_attention(h[:, :, 0], h[:, :, 1], h[:, :, 2],
                                             is_causal=True)
            x = x + a.reshape(x.shape) @ q["o"]
            x = x + jax.nn.gelu(_norm(x, q["g"]) @ q["up"]) @ q["down"]
        logits = x[:, :-1] @ p["emb"].T
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
        accuracy = (logits.argmax(-1) == tokens[:, 1:]).mean()
        return nll.mean(), {"accuracy": accuracy, "worst": nll.max()}

    def step(state: Any, tokens: jax.Array) -> Any:
        p, opt_state, count = state
        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(p, tokens)
        updates, opt_state = opt.update(grads, opt_state, p)
        metrics = {"loss": value, "grad_norm": optax.global_norm(grads), **aux}
        return (optax.apply_updates(p, updates), opt_state, count + 1), metrics

    state = (params, opt.init(params), jnp.zeros((), jnp.int32))
    return Case(step, state, (tokens((b, s)),), (None, "b, s"),
                (f"b <= {b}", f"s <= {s}", "s >= 2"))


def dpsgd_case(quick: bool) -> Case:
    """Per-example clipped gradients with Gaussian noise (DP-SGD) of a residual MLP LM."""
    _, (b, s) = _sizes(quick)
    d = WIDTH
    params = {**_normal(0, emb=(VOCAB, d), out=(d, VOCAB)),
              "layers": [{"g": jnp.ones(d), **_normal(k, up=(d, 4 * d), down=(4 * d, d))}
                         for k in range(1, 3)]}
    opt = optax.sgd(0.1)

    def example_loss(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for q in p["layers"]:
            x = x + jax.nn.gelu(_norm(x, q["g"]) @ q["up"]) @ q["down"]
        return optax.softmax_cross_entropy_with_integer_labels(
            x[:-1] @ p["out"], tokens[1:]).mean()

    def step(state: Any, tokens: jax.Array, key: jax.Array) -> Any:
        p, opt_state = state
        grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(p, tokens)
        leaves, tree = jax.tree.flatten(grads)
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in leaves))
        scale = jnp.minimum(1.0, 1.0 / (norms + 1e-6)) / tokens.shape[0]
        keys = jax.random.split(key, len(leaves))
        noisy = [jnp.einsum("b...,b->...", g, scale) + 0.01 * jax.random.normal(k, g.shape[1:])
                 for g, k in zip(leaves, keys, strict=True)]
        updates, opt_state = opt.update(tree.unflatten(noisy), opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), norms.mean()

    return Case(step, (params, opt.init(params)), (tokens((b, s)), jax.random.key(5)),
                (None, "b, s", None), (f"b <= {b}", f"s <= {s}", "s >= 2"))


def packed_case(quick: bool) -> Case:
    """Packed sequences: attention and loss kept within each segment."""
    layers, (b, s) = _sizes(quick, full_layers=2)
    params = {"emb": _normal(0, e=(VOCAB, WIDTH))["e"],
              "layers": [_layer(k + 1) for k in range(layers)]}

    def loss(p: dict[str, Any], tokens: jax.Array, segments: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
        same = (segments[:, :, None] == segments[:, None, :]) & causal
        for q in p["layers"]:
            h = _heads(x, q)
            scores = jnp.einsum("bqhd,bkhd->bhqk", h[:, :, 0], h[:, :, 1]) * 0.25
            scores = jnp.where(same[:, None], scores, jnp.finfo(scores.dtype).min)
            a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), h[:, :, 2])
            x = x + a.reshape(x.shape) @ q["o"]
            x = x + jax.nn.gelu(_norm(x, q["g"]) @ q["up"]) @ q["down"]
        nll = optax.softmax_cross_entropy_with_integer_labels(
            (x @ p["emb"].T)[:, :-1], tokens[:, 1:])
        within = (segments[:, 1:] == segments[:, :-1]).astype(jnp.float32)
        return (nll * within).sum() / jnp.maximum(within.sum(), 1.0)

    opt = optax.adamw(1e-3)
    segments = np.sort(np.random.default_rng(2).integers(0, 3, (b, s)), 1)
    return Case(optax_step(loss, opt), (params, opt.init(params)),
                (tokens((b, s)), jnp.asarray(segments, jnp.int32)), (None, "b, 8*k", "b, 8*k"),
                (f"b <= {b}", f"8*k <= {s}"))


def bf16_params_case(quick: bool) -> Case:
    """A decoder whose parameters and activations are bfloat16 throughout."""
    layers, (b, s) = _sizes(quick)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                          {"emb": _normal(0, e=(VOCAB, WIDTH))["e"],
                           "layers": [_layer(k + 1) for k in range(layers)]})

    def loss(p: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        x = p["emb"][batch["inputs"]]
        causal = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
        for q in p["layers"]:
            h = _heads(x, q)
            scores = jnp.einsum("bqhd,bkhd->bhqk", h[:, :, 0], h[:, :, 1]) / 4.0
            probs = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32))
            a = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(x.dtype), h[:, :, 2])
            x = x + a.reshape(x.shape) @ q["o"]
            x = x + jax.nn.relu(_norm(x, q["g"]) @ q["up"]) @ q["down"]
        nll = optax.softmax_cross_entropy_with_integer_labels(
            (x @ p["emb"].T).astype(jnp.float32), batch["targets"])
        return (nll * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1.0)

    opt = optax.adam(1e-3, mu_dtype=jnp.float32)
    mask = np.random.default_rng(3).random((b, s)) > 0.2
    batch = {"inputs": tokens((b, s)), "targets": tokens((b, s), 1),
             "mask": jnp.asarray(mask, jnp.float32)}
    spec = {"inputs": "b, s", "targets": "b, s", "mask": "b, s"}
    return Case(optax_step(loss, opt), (params, opt.init(params)), (batch,), (None, spec),
                (f"b <= {b}", f"s <= {s}"))


def rnn_case(quick: bool) -> Case:
    """An LSTM language model scanned over the (symbolic) time axis."""
    _, (b, s) = _sizes(quick)
    d = WIDTH
    params = _normal(0, emb=(VOCAB, d), wx=(d, 4 * d), wh=(d, 4 * d), out=(d, VOCAB))

    def loss(p: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
        inputs = jnp.swapaxes(p["emb"][tokens] @ p["wx"], 0, 1)

        def cell(carry: tuple[jax.Array, jax.Array], x: jax.Array) -> Any:
            h, c = carry
            i, f, g, o = jnp.split(x + h @ p["wh"], 4, -1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h, c), h

        zeros = jnp.zeros((tokens.shape[0], d))
        _, hs = jax.lax.scan(cell, (zeros, zeros), inputs)
        logits = jnp.swapaxes(hs, 0, 1)[:, :-1] @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    opt = optax.sgd(0.1, momentum=0.9)
    return Case(optax_step(loss, opt), (params, opt.init(params)), (tokens((b, s)),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}", "s >= 2"))


class _NNXBatchNormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(4 * WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(4 * WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.up(self.emb(tokens))
        h = self.bn(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return self.out(self.drop(nnx.gelu(h)))


def nnx_bn_case(quick: bool) -> Case:
    """Flax NNX BatchNorm and Dropout, ``nnx.Optimizer``, the step over ``nnx.split``."""
    _, (b, s) = _sizes(quick)
    model = _NNXBatchNormNet(nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))

    def step(state: Any, tokens: jax.Array) -> Any:
        model, opt = nnx.merge(graphdef, state)

        def loss(m: _NNXBatchNormNet) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(
                m(tokens)[:, :-1], tokens[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), value

    return Case(step, state, (tokens((b, s)),), (None, "b, s"),
                (f"b <= {b}", f"s <= {s}", "s >= 2"))


@jax.custom_jvp
def _soft_clip(x: jax.Array) -> jax.Array:
    return 3.0 * jnp.tanh(x)


_soft_clip.defjvps(lambda g, ans, x: g * 3.0 * (1 - jnp.tanh(x) ** 2))


def _spectral_normalised(w: jax.Array) -> jax.Array:
    def power(carry: tuple[int, jax.Array]) -> tuple[int, jax.Array]:
        i, u = carry
        v = w.T @ u
        u = w @ (v / jnp.linalg.norm(v))
        return i + 1, u / jnp.linalg.norm(u)

    start = jnp.ones(w.shape[0]) / np.sqrt(w.shape[0])
    _, u = jax.lax.while_loop(lambda c: c[0] < 3, power, (0, start))
    return w / jnp.linalg.norm(w.T @ jax.lax.stop_gradient(u))


def misc_case(quick: bool) -> Case:
    """Grouped-query attention with a bias, a custom_jvp, a while_loop, keys in the state."""
    layers, (b, s) = _sizes(quick, full_layers=2)
    d, kv_heads = WIDTH, 2
    params = {**_normal(0, emb=(VOCAB, d), out=(d, VOCAB)),
              "layers": [{"g": jnp.ones(d), **_normal(k, q=(d, d), o=(d, d), up=(d, 4 * d),
                                                       kv=(d, 2 * kv_heads * d // HEADS),
                                                       down=(4 * d, d))}
                         for k in range(1, layers + 1)]}

    def loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
        x, (rows, length) = p["emb"][tokens], tokens.shape
        distance = jnp.abs(jnp.arange(length)[:, None] - jnp.arange(length)[None])
        for q in p["layers"]:
            h = _norm(x, q["g"])
            kv = (h @ q["kv"]).reshape(rows, length, 2, kv_heads, d // HEADS)
            a = jax.nn.dot_product_attention(
                (h @ q["q"]).reshape(rows, length, HEADS, d // HEADS), kv[:, :, 0],
                kv[:, :, 1], bias=-0.1 * distance[None, None].astype(x.dtype), is_causal=True)
            x = x + a.reshape(x.shape) @ q["o"]
            h = _soft_clip(_norm(x, q["g"]) @ _spectral_normalised(q["up"]))
            keep = jax.random.bernoulli(key, 0.9, h.shape)
            x = x + jnp.where(keep, h / 0.9, 0.0) @ q["down"]
            key = jax.random.fold_in(key, 1)
        return optax.softmax_cross_entropy_with_integer_labels(
            x[:, :-1] @ p["out"], tokens[:, 1:]).mean()

    opt = optax.adamw(1e-3)

    def step(state: Any, tokens: jax.Array) -> Any:
        p, opt_state, key = state
        key, sub = jax.random.split(key)
        value, grads = jax.value_and_grad(loss)(p, tokens, sub)
        updates, opt_state = opt.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state, key), value

    return Case(step, (params, opt.init(params), jax.random.key(7)), (tokens((b, s)),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}", "s >= 2"))


class _UNet1D(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h1 = nn.relu(nn.Conv(32, (3,))(x))
        h2 = nn.relu(nn.Conv(64, (3,), strides=(2,))(h1))
        h3 = nn.relu(nn.Conv(64, (3,), strides=(2,))(h2))
        u2 = nn.ConvTranspose(64, (3,), strides=(2,))(h3)
        u2 = nn.relu(nn.Conv(64, (3,))(jnp.concatenate([u2, h2], -1)))
        u1 = nn.ConvTranspose(32, (3,), strides=(2,))(u2)
        u1 = nn.relu(nn.Conv(32, (3,))(jnp.concatenate([u1, h1], -1)))
        return nn.Conv(1, (1,))(u1)


def unet_case(quick: bool) -> Case:
    """A Flax linen 1D U-Net (strided convolutions down, transposed ones up, concatenated
    skips) regressing a product of its two input channels over length ``4 k``."""
    b, n = (8, 128) if quick else (16, 256)
    model = _UNet1D()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(b, n, 2)), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p: Any, x: jax.Array) -> jax.Array:
        y = model.apply({"params": p}, x)[..., 0]
        return jnp.mean((y - x[..., 0] * x[..., 1]) ** 2)

    opt = optax.adam(1e-3)
    return Case(optax_step(loss, opt), (params, opt.init(params)), (x,), (None, "b, 4*k, 2"),
                (f"b <= {b}", f"4*k <= {n}"))


def cls_case(quick: bool) -> Case:
    """An encoder over ``uint8`` features: a random crop by ``dynamic_slice`` at a traced
    offset, a CLS token concatenated in front (``s + 1`` positions, learned positions
    sliced to them), pooled with the mean of the rest for a classifier."""
    layers, (b, s) = _sizes(quick, full_layers=2)
    params = {**_normal(0, cls=(1, 1, WIDTH), pos=(129, WIDTH), inp=(12, WIDTH),
                        head=(2 * WIDTH, 10)), "layers": [_layer(k + 1) for k in range(layers)]}

    def loss(p: dict[str, Any], feats: jax.Array, labels: jax.Array, at: jax.Array) -> Any:
        x = jnp.pad(feats.astype(jnp.float32) / 255.0, ((0, 0), (2, 2), (0, 0)), mode="edge")
        x = jax.lax.dynamic_slice_in_dim(x, at, feats.shape[1], axis=1) @ p["inp"]
        cls = jnp.broadcast_to(p["cls"], (x.shape[0], 1, WIDTH))
        x = jnp.concatenate([cls, x], axis=1)
        x = x + p["pos"][: x.shape[1]]
        for q in p["layers"]:
            h = _heads(x, q)
            a = jax.nn.dot_product_attention(h[:, :, 0], h[:, :, 1], h[:, :, 2])
            x = x + a.reshape(x.shape) @ q["o"]
            x = x + jax.nn.gelu(_norm(x, q["g"]) @ q["up"]) @ q["down"]
        pooled = jnp.concatenate([x[:, 0], x[:, 1:].mean(1)], -1)
        return optax.softmax_cross_entropy_with_integer_labels(pooled @ p["head"], labels).mean()

    opt = optax.adamw(1e-3)

    def step(state: Any, feats: jax.Array, labels: jax.Array, key: jax.Array) -> Any:
        p, opt_state = state
        value, grads = jax.value_and_grad(loss)(p, feats, labels, jax.random.randint(key, (), 0, 5))
        updates, opt_state = opt.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), value

    rng = np.random.default_rng(1)
    feats = jnp.asarray(rng.integers(0, 256, (b, s, 12)), jnp.uint8)
    labels = jnp.asarray(rng.integers(0, 10, (b,)), jnp.int32)
    return Case(step, (params, opt.init(params)), (feats, labels, jax.random.key(3)),
                (None, "b, s, 12", "b", None), (f"b <= {b}", f"s <= {s}"))


STYLES: dict[str, Callable[[bool], Case]] = {
    "tied": tied_case, "dpsgd": dpsgd_case, "packed": packed_case,
    "bf16-params": bf16_params_case, "rnn": rnn_case, "nnx-bn": nnx_bn_case,
    "misc": misc_case, "unet": unet_case, "cls": cls_case,
}
