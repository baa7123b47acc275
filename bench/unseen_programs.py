"""More programs written apart from jaxmem, beyond decoders over one token batch.

Each builder returns a :class:`Case`: the step ``step(state, *data) -> (state, loss)``,
its state and data (concrete arrays), the ``polymorphic_shapes`` of ``(state, *data)``
and the constraints of the shape domain.

* ``accum``: gradient accumulation, a ``lax.scan`` over microbatches whose body runs
  the forward and backward pass of a pre-LayerNorm decoder (plain JAX, Python loop
  over layers) and sums the gradients, under ``optax.adam``;
* ``cnn``: a Flax linen convolutional classifier (three conv + average-pool stages,
  global mean, two dense layers) over images of dynamic batch and side, under SGD
  with momentum;
* ``encdec``: a Flax NNX encoder-decoder (``nnx.MultiHeadAttention``, self-, causal
  and cross-attention, tied embeddings) with two sequence dims, under
  ``nnx.Optimizer(adamw)``;
* ``moe``: a plain-JAX decoder whose MLPs are top-2 mixtures of 4 experts (softmax
  router, ``lax.top_k``, one-hot dispatch by ``einsum``), under ``optax.lion``;
* ``remat-scan``: a Flax linen decoder as MaxText writes it, ``nn.scan`` over
  ``nn.remat`` blocks (the user's own checkpoint), under ``optax.adamw``;
* ``ssm``: a plain-JAX state-space LM whose layers run a diagonal linear recurrence by
  ``lax.associative_scan`` (strided slices, pads and concatenates instead of a loop),
  under SGD with Nesterov momentum;
* ``eval``: an evaluation step (no gradient) of a plain-JAX pre-LayerNorm decoder: its
  loss and next-token accuracy;
* ``vit``: a plain-JAX vision transformer (patches cut by ``reshape`` / ``transpose``
  from images of dynamic batch and side, exact ``erf`` GELU, mean pooling, one-hot
  cross-entropy), under ``optax.adafactor``.

Example:
    >>> case = CASES["cnn"](True)
    >>> state, loss = case.step(case.state, *case.data)
    >>> float(loss) > 0
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.programs import optax_step

D, VOCAB = 64, 128


@dataclasses.dataclass(frozen=True)
class Case:
    """One program: its step, state, data and shape domain."""

    step: Callable[..., Any]
    state: Any
    data: tuple[Any, ...]
    polymorphic_shapes: tuple[Any, ...]  # per argument: a spec, None, or a pytree of them
    constraints: tuple[str, ...]


def tokens(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    """Token ids below ``VOCAB``, drawn with numpy's ``seed``."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def normal(shapes: Any, seed: int, scale: float = 0.05) -> Any:
    """Normal(0, ``scale``) arrays of a tree of shapes (tuples are leaves)."""
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, s) for k, s in
                                     zip(keys, leaves, strict=True)])


def _layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * g + b


def _attention(x: jax.Array, p: dict[str, jax.Array], causal: bool = True) -> jax.Array:
    b, s, _ = x.shape
    q, k, v = ((x @ p[n]).reshape(b, s, 4, D // 4) for n in "qkv")
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D // 4)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    o = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v).reshape(b, s, D)
    return o @ p["o"]


def _lm_loss(x: jax.Array, emb: jax.Array, tokens: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ emb.T, jnp.roll(tokens, -1, 1)).mean()


def accumulation_step(loss: Callable[..., jax.Array], opt: optax.GradientTransformation
                      ) -> Callable[..., Any]:
    """``step((params, opt_state), microbatches)``: a ``lax.scan`` over the leading axis of
    ``microbatches`` whose body runs ``value_and_grad(loss)`` and sums the gradients, then
    one ``opt`` update; the loss is the microbatches' mean."""
    def step(state: Any, microbatches: Any) -> Any:
        p, opt_state = state

        def body(total: Any, batch: Any) -> tuple[Any, jax.Array]:
            value, grads = jax.value_and_grad(loss)(p, batch)
            return jax.tree.map(jnp.add, total, grads), value

        grads, values = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), microbatches)
        updates, opt_state = opt.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), values.mean()
    return step


_ATTENTION = {"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D)}


def accum_case(quick: bool) -> Case:
    """Gradient accumulation over 4 microbatches of ``(b, s)`` tokens."""
    layers, (b, s) = (1, (2, 16)) if quick else (3, (8, 64))
    shapes = {"emb": (VOCAB, D), "layers": [
        {"attn": _ATTENTION, "w1": (D, 4 * D), "w2": (4 * D, D), "g": (D,), "b": (D,)}
        for _ in range(layers)]}
    params = normal(shapes, 0)
    opt = optax.adam(1e-3)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for lp in p["layers"]:
            x = x + _attention(_layer_norm(x, lp["g"], lp["b"]), lp["attn"])
            x = x + jax.nn.gelu(_layer_norm(x, lp["g"], lp["b"]) @ lp["w1"]) @ lp["w2"]
        return _lm_loss(x, p["emb"], tokens)

    return Case(accumulation_step(loss, opt), (params, opt.init(params)), (tokens((4, b, s)),),
                (None, "4, b, s"), (f"b <= {b}", f"s <= {s}"))


class _ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for features in (16, 32, 32):
            x = nn.avg_pool(nn.relu(nn.Conv(features, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x.mean((1, 2)))))


def cnn_case(quick: bool) -> Case:
    """The linen classifier on ``(b, 8 h, 8 h, 3)`` images (side a multiple of 8)."""
    b, side = (4, 16) if quick else (16, 32)
    model = _ConvNet()
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(b, side, side, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, (b,)), jnp.int32)
    params = model.init(jax.random.key(0), images)
    opt = optax.sgd(1e-2, momentum=0.9)

    def loss(p: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(
            model.apply(p, images), labels).mean()

    return Case(optax_step(loss, opt), (params, opt.init(params)), (images, labels),
                (None, "b, 8*h, 8*h, 3", "b"), (f"b <= {b}", f"h <= {side // 8}"))


class _EncoderDecoder(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs) -> None:
        def attention() -> nnx.MultiHeadAttention:
            return nnx.MultiHeadAttention(4, D, decode=False, rngs=rngs)

        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.encoder = nnx.List([attention() for _ in range(layers)])
        self.decoder = nnx.List([attention() for _ in range(layers)])
        self.cross = nnx.List([attention() for _ in range(layers)])
        self.mlps = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(2 * layers)])
        self.norms = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(3 * layers)])

    def __call__(self, source: jax.Array, target: jax.Array) -> jax.Array:
        n = len(self.encoder)
        x = self.embed(source)
        for i, attend in enumerate(self.encoder):
            x = x + attend(self.norms[i](x))
            x = x + jax.nn.relu(self.mlps[i](x))
        y, mask = self.embed(target), nnx.make_causal_mask(target)
        for i in range(n):
            y = y + self.decoder[i](self.norms[n + i](y), mask=mask)
            y = y + self.cross[i](self.norms[2 * n + i](y), x)
            y = y + jax.nn.relu(self.mlps[n + i](y))
        return self.embed.attend(y)


def encdec_case(quick: bool) -> Case:
    """The NNX encoder-decoder on ``(b, s)`` source and ``(b, t)`` target tokens."""
    layers, (b, s, t) = (1, (2, 16, 8)) if quick else (2, (8, 48, 32))
    model = _EncoderDecoder(layers, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, source: jax.Array, target: jax.Array) -> Any:
        model, optimizer = nnx.merge(graphdef, state)

        def loss(m: _EncoderDecoder) -> jax.Array:
            logits = m(source, target)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], target[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), value

    return Case(step, state, (tokens((b, s)), tokens((b, t), 1)), (None, "b, s", "b, t"),
                (f"b <= {b}", f"s <= {s}", f"t <= {t}", "t >= 2"))


def moe_case(quick: bool) -> Case:
    """The top-2 mixture-of-experts decoder on ``(b, s)`` tokens."""
    layers, experts, (b, s) = (1, 4, (2, 16)) if quick else (2, 4, (8, 64))
    shapes = {"emb": (VOCAB, D), "layers": [
        {"attn": _ATTENTION, "router": (D, experts), "w1": (experts, D, 2 * D),
         "w2": (experts, 2 * D, D), "g": (D,), "b": (D,)} for _ in range(layers)]}
    params = normal(shapes, 1)
    opt = optax.lion(1e-4)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for lp in p["layers"]:
            x = x + _attention(_layer_norm(x, lp["g"], lp["b"]), lp["attn"])
            h = _layer_norm(x, lp["g"], lp["b"])
            top, chosen = jax.lax.top_k(jax.nn.softmax(h @ lp["router"], -1), 2)
            weights = (jax.nn.one_hot(chosen, experts) * top[..., None]).sum(2)
            hidden = jax.nn.relu(jnp.einsum("bsd,edf->bsef", h, lp["w1"]))
            x = x + jnp.einsum("bsef,efd,bse->bsd", hidden, lp["w2"], weights)
        return _lm_loss(x, p["emb"], tokens)

    return Case(optax_step(loss, opt), (params, opt.init(params)), (tokens((b, s)),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}"))


class _ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=4, deterministic=True)(nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x)))), None


class _RematScanDecoder(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, D)
        stack = nn.scan(nn.remat(_ScannedBlock), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.layers)
        x, _ = stack(name="blocks")(embed(tokens), None)
        return embed.attend(nn.LayerNorm()(x))


def remat_scan_case(quick: bool) -> Case:
    """A linen decoder as MaxText writes it: ``nn.scan`` over ``nn.remat`` blocks (the
    user's own checkpoint, saving nothing inside a layer), under ``optax.adamw``."""
    layers, (b, s) = (2, (4, 32)) if quick else (3, (8, 64))
    model = _RematScanDecoder(layers)
    params = model.init(jax.random.key(0), tokens((b, s)))
    opt = optax.adamw(1e-3)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        return _lm_loss_logits(model.apply(p, tokens), tokens)

    return Case(optax_step(loss, opt), (params, opt.init(params)), (tokens((b, s)),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}"))


def vit_case(quick: bool) -> Case:
    """The vision transformer on ``(b, 4 h, 4 h, 3)`` images (4x4 patches)."""
    layers, (b, side) = (1, (2, 8)) if quick else (3, (16, 32))
    patch = 4
    shapes = {"patch": (patch * patch * 3, D), "head": (D, 10), "layers": [
        {"attn": _ATTENTION, "w1": (D, 4 * D), "w2": (4 * D, D), "g": (D,), "b": (D,)}
        for _ in range(layers)]}
    params = normal(shapes, 2)
    opt = optax.adafactor(1e-3)

    def loss(p: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        n, h, w, c = images.shape
        x = images.reshape(n, h // patch, patch, w // patch, patch, c)
        x = x.transpose(0, 1, 3, 2, 4, 5).reshape(n, -1, patch * patch * c) @ p["patch"]
        for lp in p["layers"]:
            x = x + _attention(_layer_norm(x, lp["g"], lp["b"]), lp["attn"], causal=False)
            hidden = _layer_norm(x, lp["g"], lp["b"]) @ lp["w1"]
            x = x + jax.nn.gelu(hidden, approximate=False) @ lp["w2"]
        logits = x.mean(1) @ p["head"]
        return -(jax.nn.one_hot(labels, 10) * jax.nn.log_softmax(logits)).sum(-1).mean()

    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(b, side, side, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, (b,)), jnp.int32)
    return Case(optax_step(loss, opt), (params, opt.init(params)), (images, labels),
                (None, "b, 4*h, 4*h, 3", "b"), (f"b <= {b}", f"h <= {side // 4}"))


def _linear_recurrence(decay: jax.Array, u: jax.Array) -> jax.Array:
    """``h_t = decay * h_{t-1} + u_t`` along axis 1, by ``lax.associative_scan`` (the
    parallel form of an S5/LRU-style state space layer)."""
    def combine(left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]
                ) -> tuple[jax.Array, jax.Array]:
        return left[0] * right[0], right[0] * left[1] + right[1]

    return jax.lax.associative_scan(combine, (jnp.broadcast_to(decay, u.shape), u),
                                    axis=1)[1]


def ssm_case(quick: bool) -> Case:
    """A state-space LM on ``(b, 64)`` tokens: per layer a diagonal linear recurrence run by
    ``lax.associative_scan`` (strided slices and pads, no loop), gated by a GELU branch,
    under ``optax.sgd`` with Nesterov momentum. The scan needs a static length, so only
    the batch is dynamic."""
    layers, (b, s) = (1, (2, 16)) if quick else (3, (16, 64))
    shapes = {"emb": (VOCAB, D), "layers": [
        {"decay": (D,), "in": (D, D), "gate": (D, D), "out": (D, D), "g": (D,), "b": (D,)}
        for _ in range(layers)]}
    params = normal(shapes, 3)
    opt = optax.sgd(1e-2, momentum=0.9, nesterov=True)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for lp in p["layers"]:
            h = _layer_norm(x, lp["g"], lp["b"])
            states = _linear_recurrence(jax.nn.sigmoid(lp["decay"]), h @ lp["in"])
            x = x + (states * jax.nn.gelu(h @ lp["gate"])) @ lp["out"]
        return _lm_loss(x, p["emb"], tokens)

    return Case(optax_step(loss, opt), (params, opt.init(params)), (tokens((b, s)),),
                (None, f"b, {s}"), (f"b <= {b}",))


def _lm_loss_logits(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.roll(tokens, -1, 1)).mean()


def eval_case(quick: bool) -> Case:
    """An evaluation step, no gradient: the pre-LayerNorm decoder's loss and next-token
    accuracy; the state passes through unchanged. At ``(8, 256)``: attention's scores
    outweigh the rest."""
    layers, (b, s) = (1, (2, 16)) if quick else (3, (8, 256))
    shapes = {"emb": (VOCAB, D), "layers": [
        {"attn": _ATTENTION, "w1": (D, 4 * D), "w2": (4 * D, D), "g": (D,), "b": (D,)}
        for _ in range(layers)]}
    params = normal(shapes, 3)

    def step(p: Any, tokens: jax.Array) -> Any:
        x = p["emb"][tokens]
        for lp in p["layers"]:
            x = x + _attention(_layer_norm(x, lp["g"], lp["b"]), lp["attn"])
            x = x + jax.nn.gelu(_layer_norm(x, lp["g"], lp["b"]) @ lp["w1"]) @ lp["w2"]
        logits, targets = x @ p["emb"].T, jnp.roll(tokens, -1, 1)
        accuracy = (logits.argmax(-1) == targets).mean()
        return p, (_lm_loss_logits(logits, tokens), accuracy)

    return Case(step, params, (tokens((b, s)),), (None, "b, s"), (f"b <= {b}", f"s <= {s}"))


#: name -> builder of the program's case (``quick``: CI-sized)
CASES: dict[str, Callable[[bool], Case]] = {
    "accum": accum_case, "cnn": cnn_case, "encdec": encdec_case, "eval": eval_case,
    "moe": moe_case, "remat-scan": remat_scan_case, "ssm": ssm_case, "vit": vit_case}
