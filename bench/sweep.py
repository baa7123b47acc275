"""The memory model on steps from the sweeps of programs written apart (sessions 25, 26).

Seven training steps unlike the project's decoders, each the kind of program that
exposed a rule of XLA's CPU backend the model lacked (``docs/notes.md``, "Session 25"
and "Session 26"):
a linen convolutional autoencoder with max pooling and ``ConvTranspose`` under Adam, a
convolution's two gradients, ``lax.top_k`` and ``jnp.sort`` pooling, an
``optax.chain(clip_by_global_norm, adamw)`` step with a schedule, an embedding language
model with a log-softmax loss, ``jnp.take`` with ``cumsum`` positions and a one-hot
loss, and a GRU scanned over a symbolic length. For each, at two shapes: XLA's peak of
``jax.jit(step)`` (``argument + output - alias + temp``) against the memory model's
prediction for the order XLA's CPU scheduler picks (no plan: level 0).

    python -m bench.sweep [--quick] --out bench/results/sweep.json

``--quick``: the convolution's gradients and the sort pooling at their small shapes (the
test). Prints a table and writes ``{"rows": [...]}`` (``program``, ``shape``,
``xla_peak_bytes``, ``predicted_peak_bytes``, ``error``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bench.outputs import TextTable, add_output_arguments
from bench.residual_mlps import against_xla, finish, peak_columns

Step = tuple[Callable[..., Any], Callable[[int, int], tuple[Any, ...]]]


def _normal(seed: int, *shape: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape) * 0.1


def _with_optimizer(loss: Callable[..., jax.Array], opt: optax.GradientTransformation
                    ) -> Callable[..., Any]:
    def step(params: Any, state: Any, *batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value
    return step


class _AutoEncoder(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.max_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), strides=(2, 2))
        h = nn.max_pool(nn.relu(nn.Conv(16, (3, 3))(h)), (2, 2), strides=(2, 2))
        h = nn.relu(nn.ConvTranspose(8, (2, 2), strides=(2, 2))(h))
        return nn.ConvTranspose(1, (2, 2), strides=(2, 2))(h)


def autoencoder() -> Step:
    """Images ``(b, 4 k, 4 k, 1)``, reconstructed; Adam."""
    model, opt = _AutoEncoder(), optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    loss = lambda p, x: jnp.mean((model.apply(p, x) - x) ** 2)  # noqa: E731
    return _with_optimizer(loss, opt), lambda b, k: (params, opt.init(params),
                                                     _normal(1, b, 4 * k, 4 * k, 1))


def conv_gradients() -> Step:
    """Both gradients of a 3x3 convolution on ``(b, 8 k, 8 k, 8)``."""
    def conv(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    step = jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=(0, 1))
    return step, lambda b, k: (_normal(0, b, 8 * k, 8 * k, 8), _normal(1, 3, 3, 8, 16))


def sort_pooling() -> Step:
    """Top-8 rows and the median of ``(b, s, 64)`` features; SGD."""
    params = {"w": _normal(0, 64, 64), "score": _normal(1, 64), "head": _normal(2, 64, 5)}

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        h = jax.nn.gelu(x @ p["w"])
        top, idx = jax.lax.top_k(h @ p["score"], 8)
        picked = jnp.take_along_axis(h, idx[..., None], axis=1) * jax.nn.sigmoid(top)[..., None]
        median = jnp.sort(h, axis=1)[:, h.shape[1] // 2]
        logits = (picked.mean(1) + median) @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    opt = optax.sgd(0.05)
    return _with_optimizer(loss, opt), lambda b, s: (
        params, opt.init(params), _normal(3, b, s, 64), jnp.zeros((b,), jnp.int32))


def optax_chain() -> Step:
    """A one-block token model under ``clip_by_global_norm`` and AdamW with a schedule."""
    params = {"emb": _normal(0, 64, 64), "w1": _normal(1, 64, 256), "w2": _normal(2, 256, 64),
              "out": _normal(3, 64, 64)}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))

    def loss(p: Any, tok: jax.Array) -> jax.Array:
        x = p["emb"][tok]
        h = jax.nn.gelu(x @ p["w1"]) @ p["w2"] + x
        h = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return optax.softmax_cross_entropy_with_integer_labels(h[:, :-1] @ p["out"],
                                                               tok[:, 1:]).mean()

    return _with_optimizer(loss, opt), lambda b, s: (
        params, opt.init(params), jax.random.randint(jax.random.PRNGKey(b + s), (b, s), 0, 64))


def embedding_lm() -> Step:
    """An embedding, a tanh layer and a 4096-word log-softmax; SGD by hand."""
    params = {"emb": _normal(0, 4096, 128), "w": _normal(1, 128, 128),
              "out": _normal(2, 128, 4096)}

    def step(p: Any, tok: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            logits = jnp.tanh(p["emb"][tok] @ p["w"]) @ p["out"]
            return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

    return step, lambda b, s: (params, jnp.zeros((b, s), jnp.int32))


def take_cumsum() -> Step:
    """Token and position embeddings by ``jnp.take`` (positions by ``cumsum`` over the
    non-padding tokens), a causal mean, a one-hot loss; AdamW."""
    params = {"emb": _normal(0, 80, 64), "pos": _normal(1, 512, 64), "w": _normal(2, 64, 64)}

    def loss(p: Any, tok: jax.Array) -> jax.Array:
        mask = tok != 0
        pos = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
        x = jnp.take(p["emb"], tok, axis=0) + jnp.take(p["pos"], pos, axis=0)
        x = x + jnp.cumsum(x, axis=1) / (jnp.arange(tok.shape[1])[None, :, None] + 1.0)
        logp = jax.nn.log_softmax((jnp.tanh(x @ p["w"]) @ p["emb"].T)[:, :-1])
        m = mask[:, 1:].astype(jnp.float32)
        picked = jnp.sum(jax.nn.one_hot(tok[:, 1:], 80) * logp, -1)
        return -(picked * m).sum() / jnp.maximum(m.sum(), 1.0)

    opt = optax.adamw(1e-3)
    return _with_optimizer(loss, opt), lambda b, s: (
        params, opt.init(params), jax.random.randint(jax.random.PRNGKey(b + s), (b, s), 0, 80))


def gru_scan() -> Step:
    """A GRU run by ``lax.scan`` over time (the length is the dim), masked mean pooling,
    a softmax loss; Adam. From session 26's sweep: its input projection ``x @ w + b``
    feeds the loop, and each stacked output is allocated at the start."""
    hidden = 96
    params = {"wx": _normal(0, 24, 3 * hidden), "wh": _normal(1, hidden, 3 * hidden),
              "b": jnp.zeros(3 * hidden), "out": _normal(2, hidden, 6)}

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        xs = jnp.swapaxes(x, 0, 1) @ p["wx"] + p["b"]

        def cell(h: jax.Array, xp: jax.Array) -> tuple[jax.Array, jax.Array]:
            xr, xz, xn = jnp.split(xp, 3, -1)
            hr, hz, hn = jnp.split(h @ p["wh"], 3, -1)
            r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
            h = (1 - z) * jnp.tanh(xn + r * hn) + z * h
            return h, h

        _, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], hidden)), xs)
        logits = hs.mean(0) @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    opt = optax.adam(2e-3)
    return _with_optimizer(loss, opt), lambda b, t: (
        params, opt.init(params), jax.random.normal(jax.random.PRNGKey(b + t), (b, t, 24)),
        jnp.arange(b) % 6)


#: program -> (step maker, its two shapes).
PROGRAMS: dict[str, tuple[Callable[[], Step], tuple[tuple[int, int], ...]]] = {
    "autoencoder": (autoencoder, ((2, 4), (8, 16))),
    "conv-gradients": (conv_gradients, ((2, 4), (8, 8))),
    "sort-pooling": (sort_pooling, ((4, 33), (8, 256))),
    "optax-chain": (optax_chain, ((4, 64), (8, 128))),
    "embedding-lm": (embedding_lm, ((2, 32), (4, 64))),
    "take-cumsum": (take_cumsum, ((4, 40), (8, 256))),
    "gru-scan": (gru_scan, ((8, 20), (32, 200))),
}
QUICK = ("conv-gradients", "sort-pooling")


def measure(name: str, shape: tuple[int, int]) -> dict[str, Any]:
    """XLA's peak and the model's for program ``name`` at ``shape``.

    Example:
        >>> row = measure("conv-gradients", (1, 1))
        >>> row["xla_peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0
        True
    """
    step, make = PROGRAMS[name][0]()
    return {"program": name, "shape": list(shape), **against_xla(step, make(*shape))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, small")
    add_output_arguments(parser, "sweep.json")
    args = parser.parse_args(argv)
    log = TextTable()
    log("program          shape      xla MiB  predicted MiB   error")
    rows = []
    for name in QUICK if args.quick else PROGRAMS:
        for shape in PROGRAMS[name][1][:1 if args.quick else 2]:
            row = measure(name, shape)
            rows.append(row)
            log(f"{name:16s} {str(shape):9s} {peak_columns(row)}")
    finish(log, args, rows, "rows", "sweep.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
