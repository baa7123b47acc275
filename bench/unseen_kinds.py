"""More program kinds written apart from jaxmem (sessions 31 and 32's sweeps), each a
:class:`~bench.unseen_programs.Case`:

* ``batchnorm``: a Flax linen MLP classifier with ``nn.BatchNorm`` in every block
  (``batch_stats`` updated as a mutable collection), under SGD with momentum;
* ``nested-scan``: gradient accumulation (a ``lax.scan`` over microbatches) of a
  decoder whose layers run under a ``lax.scan`` over stacked params, under AdamW;
* ``switch``: a decoder whose layers pick their activation by ``lax.switch`` on the
  layer's static index, under Adam;
* ``rotary``: a decoder with Llama's original complex-valued rotary embedding
  (``complex64`` frequencies, ``lax.complex``), under Adam;
* ``padded``: a decoder over right-padded rows (a ``bool`` padding mask argument,
  ``-1`` labels ignored), dropout on the attention probabilities drawn from a typed key
  carried in the state, a loss with a z-loss term and a metrics dict, under
  ``optax.chain(clip_by_global_norm, adamw)`` with a schedule and a weight-decay mask;
* ``trainstate``: a Flax linen decoder trained through ``flax.training.train_state``'s
  ``TrainState`` (``apply_fn`` and ``tx`` as static fields, ``apply_gradients``), a
  dict batch in and a metrics dict out;
* ``gqa``: grouped-query attention (key/value heads shared through ``jnp.repeat``,
  ``jax.nn.dot_product_attention``), bias-free, under Adam;
* ``custom-vjp``: an RMSNorm with a hand-written ``jax.custom_vjp`` backward and a
  gradient-clipping identity on the attention output, under Adam;
* ``multisteps``: gradient accumulation by the optimizer
  (``optax.MultiSteps(adam, every_k_schedule=2)``: a ``cond`` on its step count).

Example:
    >>> case = KINDS["switch"](True)
    >>> state, loss = case.step(case.state, *case.data)
    >>> float(loss) > 0
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
from flax.training import train_state

from bench.programs import optax_step
from bench.unseen_programs import VOCAB, Case, accumulation_step

WIDTH, CLASSES = 64, 10
ACTIVATIONS = (jax.nn.gelu, jnp.tanh, jax.nn.relu)


def _ints(shape: tuple[int, ...], high: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


def _layer(key: jax.Array) -> dict[str, jax.Array]:
    shapes = {"qkv": (WIDTH, 3 * WIDTH), "o": (WIDTH, WIDTH), "up": (WIDTH, 4 * WIDTH),
              "down": (4 * WIDTH, WIDTH)}
    keys = jax.random.split(key, len(shapes))
    return {n: 0.05 * jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys,
                                                                   strict=True)}


def _block(x: jax.Array, p: dict[str, jax.Array], act: Callable = jax.nn.gelu) -> jax.Array:
    s = x.shape[1]
    h = x - x.mean(-1, keepdims=True)
    q, k, v = jnp.split(h @ p["qkv"], 3, -1)
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    x = x + jax.nn.softmax(scores, -1) @ v @ p["o"]
    return x + act(x @ p["up"]) @ p["down"]


def _next_token_loss(x: jax.Array, emb: jax.Array, tokens: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ emb.T, jnp.roll(tokens, -1, 1)).mean()


class _BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(4):
            h = nn.BatchNorm(use_running_average=False)(nn.Dense(4 * WIDTH)(x))
            x = x + nn.Dense(WIDTH)(nn.relu(h))
        return nn.Dense(CLASSES)(x)


def batchnorm_case(quick: bool) -> Case:
    """A BatchNorm MLP classifier over ``b`` feature vectors."""
    b = 8 if quick else 512
    model, opt = _BatchNormMLP(), optax.sgd(1e-2, momentum=0.9)
    variables = model.init(jax.random.key(0), jnp.ones((2, WIDTH)))
    params, stats = variables["params"], variables["batch_stats"]

    def step(state: Any, x: jax.Array, labels: jax.Array) -> Any:
        p, batch_stats, opt_state = state

        def loss(p: Any) -> tuple[jax.Array, Any]:
            logits, new = model.apply({"params": p, "batch_stats": batch_stats}, x,
                                      mutable=["batch_stats"])
            return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
                    new["batch_stats"])

        (value, batch_stats), grads = jax.value_and_grad(loss, has_aux=True)(p)
        updates, opt_state = opt.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), batch_stats, opt_state), value

    x = jax.random.normal(jax.random.key(1), (b, WIDTH))
    return Case(step, (params, stats, opt.init(params)), (x, _ints((b,), CLASSES)),
                (None, f"b, {WIDTH}", "b"), (f"b <= {b}", "b >= 2"))


def nested_scan_case(quick: bool) -> Case:
    """Gradient accumulation over 4 microbatches of a scan-over-layers decoder."""
    layers, (b, s) = (1, (2, 16)) if quick else (3, (8, 64))
    keys = jax.random.split(jax.random.key(2), layers + 1)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[_layer(k) for k in keys[1:]])
    params = {"emb": 0.05 * jax.random.normal(keys[0], (VOCAB, WIDTH)), "layers": stacked}
    opt = optax.adamw(1e-3)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(lambda c, lp: (_block(c, lp), None), p["emb"][tokens],
                            p["layers"])
        return _next_token_loss(x, p["emb"], tokens)

    return Case(accumulation_step(loss, opt), (params, opt.init(params)),
                (_ints((4, b, s), VOCAB),), (None, "4, b, s"), (f"b <= {b}", f"s <= {s}"))


def _decoder(quick: bool, seed: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """A small decoder's embedding and per-layer params, and its ``(b, s)``."""
    layers, shape = (1, (2, 16)) if quick else (3, (8, 64))
    keys = jax.random.split(jax.random.key(seed), layers + 1)
    return ({"emb": 0.05 * jax.random.normal(keys[0], (VOCAB, WIDTH)),
             "layers": [_layer(k) for k in keys[1:]]}, shape)


def switch_case(quick: bool) -> Case:
    """Layers whose activation is chosen by ``lax.switch`` on the static layer index."""
    params, (b, s) = _decoder(quick, 3)
    opt = optax.adam(1e-3)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for i, lp in enumerate(p["layers"]):
            x = jax.lax.switch(i % 3, [lambda x, lp=lp, a=a: _block(x, lp, a)
                                       for a in ACTIVATIONS], x)
        return _next_token_loss(x, p["emb"], tokens)

    return Case(optax_step(loss, opt), (params, opt.init(params)), (_ints((b, s), VOCAB),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}"))


def _rotate(x: jax.Array) -> jax.Array:
    """Llama's original rotary embedding: pairs of features as complex numbers."""
    s, half = x.shape[1], x.shape[-1] // 2
    angles = jnp.arange(s)[:, None] / 10000.0 ** (jnp.arange(half) / half)
    turned = jax.lax.complex(x[..., ::2], x[..., 1::2]) * jnp.exp(
        1j * angles.astype(jnp.complex64))[None, :, None]
    return jnp.stack([turned.real, turned.imag], -1).reshape(x.shape)


def _heads(x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    b, s, _ = x.shape
    h = x - x.mean(-1, keepdims=True)
    return tuple(a.reshape(b, s, 4, WIDTH // 4) for a in jnp.split(h @ p["qkv"], 3, -1))


def _attend(probs: jax.Array, v: jax.Array, x: jax.Array, p: dict[str, jax.Array]
            ) -> jax.Array:
    x = x + jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape) @ p["o"]
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


def _rotary_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    causal = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
    q, k, v = _heads(x, p)
    scores = jnp.einsum("bqhd,bkhd->bhqk", _rotate(q), _rotate(k)) / 4.0
    return _attend(jax.nn.softmax(jnp.where(causal, scores, -1e9), -1), v, x, p)


def rotary_case(quick: bool) -> Case:
    """Rotary attention with complex-valued frequencies."""
    return _decoder_case(quick, 4, _rotary_block, optax.adam(1e-3))


def padded_case(quick: bool) -> Case:
    """Right-padded rows, attention dropout from a typed key, metrics, a clipped AdamW."""
    params, (b, s) = _decoder(quick, 5)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1,
        mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)))

    def loss(p: Any, tokens: jax.Array, mask: jax.Array, key: jax.Array) -> Any:
        x = p["emb"][jnp.maximum(tokens, 0)]
        visible = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool)) & mask[:, None, None, :]
        for lp, k in zip(p["layers"], jax.random.split(key, len(p["layers"])), strict=True):
            q, kk, v = _heads(x, lp)
            scores = jnp.where(visible, jnp.einsum("bqhd,bkhd->bhqk", q, kk) / 4.0, -1e9)
            probs = jax.nn.softmax(scores, -1)
            probs = jnp.where(jax.random.bernoulli(k, 0.9, probs.shape), probs / 0.9, 0.0)
            x = _attend(probs, v, x, lp)
        logits = x @ p["emb"].T
        norm = jax.nn.logsumexp(logits, -1)
        picked = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[..., None], -1)[..., 0]
        weight = (tokens >= 0) & mask
        count = jnp.maximum(weight.sum(), 1)
        hits = (logits.argmax(-1) == tokens) & weight
        return (((norm - picked + 1e-4 * norm ** 2) * weight).sum() / count,
                {"accuracy": hits.sum() / count, "tokens": count})

    def step(state: Any, tokens: jax.Array, mask: jax.Array) -> Any:
        p, opt_state, key = state
        key, sub = jax.random.split(key)
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(p, tokens, mask, sub)
        updates, opt_state = opt.update(grads, opt_state, p)
        return ((optax.apply_updates(p, updates), opt_state, key),
                {"loss": value, "grad_norm": optax.global_norm(grads), **metrics})

    mask = jnp.asarray(np.arange(s)[None] < s - np.arange(b)[:, None] % 5)
    tokens = jnp.where(mask, _ints((b, s), VOCAB), -1)
    return Case(step, (params, opt.init(params), jax.random.key(6)), (tokens, mask),
                (None, "b, s", "b, s"), (f"b <= {b}", f"s <= {s}", "s >= 6"))


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        causal = nn.make_causal_mask(x[..., 0])
        x = x + nn.SelfAttention(num_heads=4, deterministic=True)(nn.LayerNorm()(x), causal)
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))


class _LinenDecoder(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, WIDTH)
        x = embed(tokens)
        for _ in range(self.layers):
            x = _LinenBlock()(x)
        return embed.attend(x)


def trainstate_case(quick: bool) -> Case:
    """A linen decoder under ``TrainState.apply_gradients``, batches as dicts."""
    layers, (b, s) = (1, (2, 16)) if quick else (3, (8, 64))
    model = _LinenDecoder(layers)
    params = model.init(jax.random.key(7), jnp.ones((1, 4), jnp.int32))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(1e-3))

    def step(state: train_state.TrainState, batch: dict[str, jax.Array]) -> Any:
        def loss(p: Any) -> jax.Array:
            logits = state.apply_fn({"params": p}, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    tokens = _ints((b, s + 1), VOCAB)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    return Case(step, state, (batch,), (None, {"tokens": "b, s", "labels": "b, s"}),
                (f"b <= {b}", f"s <= {s}"))


def _gqa_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    b, s, _ = x.shape
    h = x - x.mean(-1, keepdims=True)
    q = (h @ p["qkv"][:, :WIDTH]).reshape(b, s, 4, WIDTH // 4)
    k, v = ((h @ w).reshape(b, s, 2, WIDTH // 4)
            for w in (p["qkv"][:, WIDTH:3 * WIDTH // 2], p["qkv"][:, 2 * WIDTH:5 * WIDTH // 2]))
    k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    heads = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    x = x + heads.reshape(b, s, WIDTH) @ p["o"]
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


@jax.custom_vjp
def _rms_norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def _rms_norm_fwd(x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    r = jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    return x * r, (x, r)


def _rms_norm_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array]:
    x, r = res
    n = x * r
    return (r * (g - n * (g * n).mean(-1, keepdims=True)),)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def _clip_gradient(x: jax.Array) -> jax.Array:
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _custom_vjp_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    s = x.shape[1]
    q, k, v = jnp.split(_rms_norm(x) @ p["qkv"], 3, -1)
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    x = x + _clip_gradient(jax.nn.softmax(scores, -1) @ v @ p["o"])
    return x + jax.nn.gelu(_rms_norm(x) @ p["up"]) @ p["down"]


def _decoder_case(quick: bool, seed: int, block: Callable[..., jax.Array],
                  opt: optax.GradientTransformation) -> Case:
    params, (b, s) = _decoder(quick, seed)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for lp in p["layers"]:
            x = block(x, lp)
        return _next_token_loss(x, p["emb"], tokens)

    return Case(optax_step(loss, opt), (params, opt.init(params)), (_ints((b, s), VOCAB),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}"))


def gqa_case(quick: bool) -> Case:
    """Grouped-query attention: 4 query heads over 2 repeated key/value heads."""
    return _decoder_case(quick, 8, _gqa_block, optax.adam(1e-3))


def custom_vjp_case(quick: bool) -> Case:
    """Hand-written backward passes: an RMSNorm's and a clipping identity's."""
    return _decoder_case(quick, 9, _custom_vjp_block, optax.adam(1e-3))


def multisteps_case(quick: bool) -> Case:
    """Accumulation inside the optimizer: an update every second step."""
    return _decoder_case(quick, 10, _block, optax.MultiSteps(optax.adam(1e-3), 2))


#: name -> builder of the program's case (``quick``: CI-sized)
KINDS: dict[str, Callable[[bool], Case]] = {
    "batchnorm": batchnorm_case, "nested-scan": nested_scan_case, "switch": switch_case,
    "rotary": rotary_case, "padded": padded_case, "trainstate": trainstate_case,
    "gqa": gqa_case, "custom-vjp": custom_vjp_case, "multisteps": multisteps_case}
