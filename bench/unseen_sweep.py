"""Programs written apart from jaxmem (session 37's sweep), each a
:class:`~bench.unseen_programs.Case`. None crashed; ``f16`` and ``relu`` are where the
memory model was furthest off (``docs/notes.md``, "Session 37"):

* ``f16``: float16 compute over float32 parameters with a dynamic loss scale, the state a
  ``NamedTuple`` whose update is skipped (``jnp.where``) when a gradient is not finite;
* ``relu``: a ReLU MLP language model, tied embeddings, under ``optax.adam``;
* ``clip``: a contrastive image-text loss over ``b x b`` logits (two MLP encoders,
  learned temperature), under AdamW;
* ``gnn``: message passing over ``n`` nodes and ``e`` edges (``jax.ops.segment_sum``
  with ``num_segments`` a symbolic dim), node classification under Adam;
* ``diffusion``: a denoiser over sequences with a sinusoidal timestep embedding, random
  timesteps and noise from a key, a linen ``LayerNorm`` applied functionally, under
  ``chain(clip_by_global_norm, adamw(warmup_cosine_decay_schedule))``;
* ``multiopt``: ``optax.multi_transform``: clipped AdamW for matrices, SGD with momentum
  for vectors, labelled by a tree of ranks;
* ``resize``: a linen convolutional autoencoder with ``avg_pool`` and
  ``jax.image.resize`` over images of side ``2 h``;
* ``ridge``: a meta-learning loss: features of a support set fitted by a ridge solve
  (``jnp.linalg.solve``), scored on a query set of its own size ``q``;
* ``sharded``: ``with_sharding_constraint`` on a one-device mesh and
  ``jax.nn.dot_product_attention`` with per-row sequence lengths, a masked loss;
* ``scanrev``: a reversed ``lax.scan`` over stacked layers with a tuple carry and
  per-layer outputs, through a ``custom_vjp`` with a non-differentiable argument;
* ``lookahead``: ``optax.lookahead(adam)`` over ``LookaheadParams``, per-example losses
  and ``argmax`` predictions among the outputs;
* ``einsum``: attention written with einsums whose operand and output orders are all
  different (``hbsk``, ``bhks``, ``shbk``).

Example:
    >>> case = SWEEP["gnn"](True)
    >>> state, loss = case.step(case.state, *case.data)
    >>> float(loss) > 0
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.programs import optax_step
from bench.unseen_programs import VOCAB, Case, normal, tokens

D = 64


def _params(seed: int, shapes: Any) -> Any:
    """This module's parameters: Normal(0, 0.1) arrays of a tree of shapes."""
    return normal(shapes, seed, 0.1)


def _lm_case(quick: bool, loss: Callable[..., jax.Array], opt: optax.GradientTransformation,
             params: Any) -> Case:
    b, s = (2, 16) if quick else (8, 64)
    return Case(optax_step(loss, opt), (params, opt.init(params)), (tokens((b, s)),),
                (None, "b, s"), (f"b <= {b}", f"s <= {s}", "s >= 2"))


def _mlp_lm(seed: int) -> dict[str, Any]:
    return _params(seed, {"emb": (VOCAB, D), "layers": [
        {"w1": (D, 4 * D), "w2": (4 * D, D)} for _ in range(3)]})


def _xent(x: jax.Array, emb: jax.Array, toks: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(x @ emb.T, toks).mean()


class ScaledState(NamedTuple):
    """Parameters, optimizer state and the dynamic loss scale."""

    params: Any
    opt_state: Any
    scale: jax.Array


def f16_case(quick: bool) -> Case:
    """Float16 compute with a dynamic loss scale; a non-finite step is skipped."""
    b, s = (2, 16) if quick else (8, 64)
    params, opt = _mlp_lm(9), optax.adam(1e-3)

    def loss(p: Any, toks: jax.Array) -> jax.Array:
        p = jax.tree.map(lambda x: x.astype(jnp.float16), p)
        x = p["emb"][toks]
        for lp in p["layers"]:
            x = x + jax.nn.gelu(x @ lp["w1"]) @ lp["w2"]
        logits = (x @ p["emb"].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, toks).mean()

    def step(st: ScaledState, toks: jax.Array) -> tuple[ScaledState, jax.Array]:
        value, g = jax.value_and_grad(lambda p: loss(p, toks) * st.scale)(st.params)
        g = jax.tree.map(lambda x: x / st.scale, g)
        ok = jnp.all(jnp.array([jnp.isfinite(x).all() for x in jax.tree.leaves(g)]))
        updates, opt_state = opt.update(g, st.opt_state, st.params)
        pick = lambda new, old: jax.tree.map(lambda x, y: jnp.where(ok, x, y), new, old)  # noqa: E731
        return ScaledState(pick(optax.apply_updates(st.params, updates), st.params),
                           pick(opt_state, st.opt_state),
                           jnp.where(ok, st.scale * 1.001, st.scale / 2)), value / st.scale

    state = ScaledState(params, opt.init(params), jnp.float32(1024.0))
    return Case(step, state, (tokens((b, s)),), (None, "b, s"), (f"b <= {b}", f"s <= {s}"))


def relu_case(quick: bool) -> Case:
    """A ReLU MLP language model with tied embeddings."""
    def loss(p: Any, toks: jax.Array) -> jax.Array:
        x = p["emb"][toks]
        for lp in p["layers"]:
            x = x + jax.nn.relu(x @ lp["w1"]) @ lp["w2"]
        return _xent(x, p["emb"], toks)

    return _lm_case(quick, loss, optax.adam(1e-3), _mlp_lm(12))


def clip_case(quick: bool) -> Case:
    """A symmetric contrastive loss over the ``b x b`` similarities of two encoders."""
    b, s = (4, 8) if quick else (32, 32)
    p = _params(1, {"img": [(48, 128), (128, 64)], "emb": (VOCAB, D),
                    "txt": [(D, 128), (128, 64)], "t": ()})

    def encode(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        x = jax.nn.relu(x @ ws[0]) @ ws[1]
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    def loss(p: Any, images: jax.Array, toks: jax.Array) -> jax.Array:
        logits = (encode(images, p["img"]) @ encode(p["emb"][toks].mean(1), p["txt"]).T
                  * jnp.exp(p["t"]))
        labels = jnp.arange(images.shape[0])
        xent = optax.softmax_cross_entropy_with_integer_labels
        return (xent(logits, labels).mean() + xent(logits.T, labels).mean()) / 2

    opt = optax.adamw(1e-3)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(b, 48)), jnp.float32)
    return Case(optax_step(loss, opt), (p, opt.init(p)), (images, tokens((b, s))),
                (None, "b, _", "b, s"), (f"b <= {b}", f"s <= {s}"))


def gnn_case(quick: bool) -> Case:
    """Three rounds of mean-aggregated messages over a random graph."""
    n, e = (8, 16) if quick else (256, 1024)
    p = _params(2, {"layers": [{"w": (32, 32), "u": (32, 32)} for _ in range(3)],
                    "out": (32, 4)})

    def loss(p: Any, x: jax.Array, src: jax.Array, dst: jax.Array, labels: jax.Array
             ) -> jax.Array:
        deg = jax.ops.segment_sum(jnp.ones(dst.shape), dst, num_segments=x.shape[0])
        for lp in p["layers"]:
            agg = jax.ops.segment_sum(x[src] @ lp["w"], dst, num_segments=x.shape[0])
            x = jax.nn.gelu(x @ lp["u"] + agg / jnp.maximum(deg, 1.0)[:, None])
        return optax.softmax_cross_entropy_with_integer_labels(x @ p["out"], labels).mean()

    rng = np.random.default_rng(0)
    ints = lambda high, size: jnp.asarray(rng.integers(0, high, size), jnp.int32)  # noqa: E731
    x = jnp.asarray(rng.normal(size=(n, 32)), jnp.float32)
    opt = optax.adam(1e-3)
    return Case(optax_step(loss, opt), (p, opt.init(p)),
                (x, ints(n, e), ints(n, e), ints(4, n)),
                (None, "n, _", "e", "e", "n"), (f"n <= {n}", f"e <= {e}"))


def _timestep_embedding(t: jax.Array) -> jax.Array:
    freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(D // 2) / (D // 2))
    angles = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1)


def diffusion_case(quick: bool) -> Case:
    """A noise-prediction loss at random timesteps of a linear schedule."""
    b, s = (2, 16) if quick else (8, 64)
    steps = 100
    alphas = jnp.cumprod(1 - jnp.linspace(1e-4, 0.02, steps))
    p = _params(4, {"inp": (16, D), "t": (D, D), "out": (D, 16),
                    "blocks": [{"w1": (D, 4 * D), "w2": (4 * D, D)} for _ in range(3)]})
    norm = nn.LayerNorm(use_scale=False, use_bias=False)

    def loss(p: Any, x0: jax.Array, key: jax.Array) -> jax.Array:
        k_t, k_noise = jax.random.split(key)
        t = jax.random.randint(k_t, (x0.shape[0],), 0, steps)
        noise = jax.random.normal(k_noise, x0.shape)
        a = alphas[t][:, None, None]
        h = (jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise) @ p["inp"]
        h = h + jax.nn.silu(_timestep_embedding(t) @ p["t"])[:, None, :]
        for bp in p["blocks"]:
            h = h + jax.nn.silu(norm.apply({}, h) @ bp["w1"]) @ bp["w2"]
        return jnp.mean((h @ p["out"] - noise) ** 2)

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    x0 = jnp.asarray(np.random.default_rng(0).normal(size=(b, s, 16)), jnp.float32)
    return Case(optax_step(loss, opt), (p, opt.init(p)), (x0, jax.random.key(0)),
                (None, "b, s, _", None), (f"b <= {b}", f"s <= {s}"))


def multiopt_case(quick: bool) -> Case:
    """Per-group optimizers: matrices and vectors labelled by rank."""
    p = _params(5, {"emb": (VOCAB, D), "layers": [
        {"w": (D, D), "bias": (D,), "scale": (D,)} for _ in range(3)]})

    def loss(p: Any, toks: jax.Array) -> jax.Array:
        x = p["emb"][toks]
        for lp in p["layers"]:
            x = x + jnp.tanh((x * lp["scale"]) @ lp["w"] + lp["bias"])
        logits = x @ p["emb"].T
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], toks[:, 1:]).mean()

    labels = jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", p)
    opt = optax.multi_transform(
        {"matrix": optax.chain(optax.clip_by_global_norm(1.0),
                               optax.adamw(1e-3, weight_decay=0.1)),
         "vector": optax.sgd(1e-2, momentum=0.9)}, labels)
    return _lm_case(quick, loss, opt, p)


class _AutoEncoder(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
        h = nn.relu(nn.Conv(16, (3, 3))(h))
        b, height, width, c = h.shape
        h = jax.image.resize(h, (b, 2 * height, 2 * width, c), "bilinear")
        return nn.Conv(3, (3, 3))(h)


def resize_case(quick: bool) -> Case:
    """Reconstruction through a pool and a bilinear resize back up."""
    b, side = (2, 8) if quick else (8, 32)
    model = _AutoEncoder()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(b, side, side, 3)), jnp.float32)
    params = model.init(jax.random.key(0), x)
    opt = optax.adam(1e-3)
    return Case(optax_step(lambda p, x: jnp.mean((model.apply(p, x) - x) ** 2), opt),
                (params, opt.init(params)), (x,), (None, "b, 2*h, 2*h, _"),
                (f"b <= {b}", f"h <= {side // 2}"))


def ridge_case(quick: bool) -> Case:
    """A closed-form ridge fit on learned features, scored on a query set."""
    b = 8 if quick else 256
    p = _params(8, {"f1": (16, D), "f2": (D, 32), "lam": ()})

    def loss(p: Any, xs: jax.Array, ys: jax.Array, xq: jax.Array, yq: jax.Array
             ) -> jax.Array:
        features = lambda x: jnp.tanh(jnp.tanh(x @ p["f1"]) @ p["f2"])  # noqa: E731
        fs = features(xs)
        w = jnp.linalg.solve(fs.T @ fs + jnp.exp(p["lam"]) * jnp.eye(32), fs.T @ ys)
        return jnp.mean((features(xq) @ w - yq) ** 2)

    rng = np.random.default_rng(0)
    data = [jnp.asarray(rng.normal(size=(b, n)), jnp.float32) for n in (16, 1, 16, 1)]
    opt = optax.adam(1e-3)
    return Case(optax_step(loss, opt), (p, opt.init(p)), tuple(data),
                (None, "b, _", "b, _", "q, _", "q, _"), (f"b <= {b}", f"q <= {b}"))


def sharded_case(quick: bool) -> Case:
    """Sharding constraints on a one-device mesh; attention masked by row lengths."""
    b, s = (2, 16) if quick else (8, 64)
    heads = 4
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    p = _params(10, {"emb": (VOCAB, D), "layers": [
        {"qkv": (D, 3 * D), "o": (D, D), "w1": (D, 4 * D), "w2": (4 * D, D)}
        for _ in range(3)]})

    def loss(p: Any, toks: jax.Array, lengths: jax.Array) -> jax.Array:
        x = jax.lax.with_sharding_constraint(p["emb"][toks], rows)
        bb, ss = toks.shape
        for lp in p["layers"]:
            qkv = (x @ lp["qkv"]).reshape(bb, ss, 3 * heads, D // heads)
            q, k, v = jnp.split(qkv, 3, axis=2)
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             query_seq_lengths=lengths,
                                             key_value_seq_lengths=lengths)
            x = x + a.reshape(bb, ss, D) @ lp["o"]
            x = jax.lax.with_sharding_constraint(
                x + jax.nn.gelu(x @ lp["w1"]) @ lp["w2"], rows)
        mask = jnp.arange(ss)[None] < lengths[:, None]
        xent = optax.softmax_cross_entropy_with_integer_labels(x @ p["emb"].T, toks)
        return (xent * mask).sum() / mask.sum()

    opt = optax.adamw(1e-3)
    lengths = jnp.asarray(np.random.default_rng(0).integers(1, s + 1, b), jnp.int32)
    return Case(optax_step(loss, opt), (p, opt.init(p)), (tokens((b, s)), lengths),
                (None, "b, s", "b"), (f"b <= {b}", f"s <= {s}"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scaled_tanh(x: jax.Array, k: float) -> jax.Array:
    return jnp.tanh(x) * k


def _scaled_tanh_fwd(x: jax.Array, k: float) -> tuple[jax.Array, jax.Array]:
    y = jnp.tanh(x)
    return y * k, y


def _scaled_tanh_bwd(k: float, y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return ((1 - y * y) * g * k,)


_scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def scanrev_case(quick: bool) -> Case:
    """A reversed scan over stacked layers: a tuple carry and per-layer outputs."""
    p = _params(11, {"emb": (VOCAB, D), "w1": (3, D, 4 * D), "w2": (3, 4 * D, D)})

    def loss(p: Any, toks: jax.Array) -> jax.Array:
        def body(carry: tuple[jax.Array, jax.Array], w: tuple[jax.Array, jax.Array]
                 ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
            x, aux = carry
            h = _scaled_tanh(x @ w[0], 0.5)
            x = x + h @ w[1]
            return (x, aux + jnp.mean(h ** 2)), jnp.mean(x, axis=(0, 1))

        (x, aux), means = jax.lax.scan(body, (p["emb"][toks], 0.0), (p["w1"], p["w2"]),
                                       reverse=True)
        return _xent(x, p["emb"], toks) + 1e-3 * (aux + means.sum())

    return _lm_case(quick, loss, optax.adam(1e-3), p)


def lookahead_case(quick: bool) -> Case:
    """``optax.lookahead`` over fast and slow weights; per-example losses and argmax
    predictions are outputs too."""
    b, s = (4, 32) if quick else (8, 64)  # (2, 16): nothing worth recomputing
    opt = optax.lookahead(optax.adam(1e-3), sync_period=2, slow_step_size=0.5)

    def per_example(p: Any, toks: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = p["emb"][toks]
        for lp in p["layers"]:
            x = x + jax.nn.relu(x @ lp["w1"]) @ lp["w2"]
        logits = x @ p["emb"].T
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, toks)
        return xent.mean(-1), logits.argmax(-1)

    def step(state: Any, toks: jax.Array) -> Any:
        params, opt_state = state
        mean = lambda fast: (lambda r: (r[0].mean(), r))(per_example(fast, toks))  # noqa: E731
        (value, (losses, preds)), g = jax.value_and_grad(mean, has_aux=True)(params.fast)
        updates, opt_state = opt.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (value, losses, preds)

    params = optax.LookaheadParams.init_synced(_mlp_lm(12))
    return Case(step, (params, opt.init(params)), (tokens((b, s)),), (None, "b, s"),
                (f"b <= {b}", f"s <= {s}"))


def einsum_case(quick: bool) -> Case:
    """Attention by einsums in mismatched orders."""
    heads, dh = 4, 16
    p = _params(13, {"emb": (VOCAB, D), "layers": [
        {n: (D, heads, dh) for n in "qkv"} | {"o": (heads, dh, D)} for _ in range(2)]})

    def loss(p: Any, toks: jax.Array) -> jax.Array:
        x = p["emb"][toks]
        for lp in p["layers"]:
            q = jnp.einsum("bsd,dhk->hbsk", x, lp["q"])
            k = jnp.einsum("bsd,dhk->bhks", x, lp["k"])
            v = jnp.einsum("bsd,dhk->shbk", x, lp["v"])
            probs = jax.nn.softmax(jnp.einsum("hbsk,bhkt->bhst", q, k) / 4.0, axis=-1)
            x = x + jnp.einsum("bshk,hkd->bsd", jnp.einsum("bhst,thbk->bshk", probs, v),
                               lp["o"])
        return optax.softmax_cross_entropy_with_integer_labels(
            jnp.einsum("bsd,vd->bsv", x, p["emb"]), toks).mean()

    return _lm_case(quick, loss, optax.adamw(1e-3), p)


#: name -> builder of the program's case (``quick``: CI-sized)
SWEEP: dict[str, Callable[[bool], Case]] = {
    "f16": f16_case, "relu": relu_case, "clip": clip_case, "gnn": gnn_case,
    "diffusion": diffusion_case, "multiopt": multiopt_case, "resize": resize_case,
    "ridge": ridge_case, "sharded": sharded_case, "scanrev": scanrev_case,
    "lookahead": lookahead_case, "einsum": einsum_case}
