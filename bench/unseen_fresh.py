"""A program written apart from jaxmem (session 42), as a :class:`~bench.unseen_programs.Case`.

``muon``: a plain-JAX encoder-decoder (bidirectional encoder, causal decoder with
cross-attention) over two symbolic lengths, ``s`` for the source and ``t`` for the
target, under a Muon-style update written by hand: momentum, then five Newton-Schulz
iterations (a ``fori_loop`` of matmuls) orthogonalise each matrix. The optimizer's own
matmuls run after the backward pass, on every parameter matrix. (An NNX
encoder-decoder and a top-2 mixture of experts, probed in the same session, are the
``encdec`` and ``moe`` of :mod:`bench.unseen_programs` already.)

Example:
    >>> case = FRESH["muon"](True)
    >>> state, loss = case.step(case.state, *case.data)
    >>> float(loss) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.unseen_programs import VOCAB, Case, normal, tokens

D, HEADS = 64, 4


def _norm(x: jax.Array) -> jax.Array:
    centred = x - x.mean(-1, keepdims=True)
    return centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5)


def _attention(x: jax.Array, memory: jax.Array, p: dict[str, jax.Array],
               causal: bool) -> jax.Array:
    b, s, _ = x.shape
    t = memory.shape[1]
    q = (x @ p["q"]).reshape(b, s, HEADS, D // HEADS)
    k = (memory @ p["k"]).reshape(b, t, HEADS, D // HEADS)
    v = (memory @ p["v"]).reshape(b, t, HEADS, D // HEADS)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D // HEADS)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, t), bool)), scores, -1e9)
    out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v)
    return out.reshape(b, s, D) @ p["o"]


def _mlp(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return jax.nn.gelu(_norm(x) @ p["up"]) @ p["down"]


def _encdec_params() -> Any:
    block = {n: (D, D) for n in "qkvo"}
    mlp = {"up": (D, 4 * D), "down": (4 * D, D)}
    return normal({"emb": (VOCAB, D), "enc": [{"self": block, **mlp} for _ in range(2)],
                   "dec": [{"self": block, "cross": block, **mlp} for _ in range(2)]}, 42)


def _encdec_loss(p: Any, source: jax.Array, target: jax.Array) -> jax.Array:
    memory = p["emb"][source]
    for q in p["enc"]:
        memory = memory + _attention(_norm(memory), _norm(memory), q["self"], False)
        memory = memory + _mlp(memory, q)
    x = p["emb"][target]
    for q in p["dec"]:
        x = x + _attention(_norm(x), _norm(x), q["self"], True)
        x = x + _attention(_norm(x), memory, q["cross"], False)
        x = x + _mlp(x, q)
    logits = _norm(x) @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], target[:, 1:]).mean()


def _two_lengths(quick: bool, step: Callable[..., Any], state: Any) -> Case:
    b, s, t = (2, 16, 12) if quick else (8, 64, 48)
    return Case(step, state, (tokens((b, s)), tokens((b, t), seed=1)), (None, "b, s", "b, t"),
                (f"b <= {b}", f"s <= {s}", f"t <= {t}", "t >= 2"))


def _orthogonalised(g: jax.Array, steps: int = 5) -> jax.Array:
    """Newton-Schulz iterations towards the nearest semi-orthogonal matrix (Muon's)."""
    a, b, c = 3.4445, -4.7750, 2.0315

    def body(_: Any, x: jax.Array) -> jax.Array:
        gram = x @ x.T
        return a * x + (b * gram + c * gram @ gram) @ x

    return jax.lax.fori_loop(0, steps, body, g / (jnp.linalg.norm(g) + 1e-7))


def muon_case(quick: bool) -> Case:
    """The encoder-decoder under a hand-written Muon-style update."""
    def step(state: Any, source: jax.Array, target: jax.Array) -> Any:
        params, momentum = state
        loss, grads = jax.value_and_grad(_encdec_loss)(params, source, target)
        momentum = jax.tree.map(lambda m, g: 0.95 * m + g, momentum, grads)
        updates = jax.tree.map(lambda m: _orthogonalised(m) if m.ndim == 2 else m, momentum)
        return (jax.tree.map(lambda w, u: w - 0.01 * u, params, updates), momentum), loss

    params = _encdec_params()
    return _two_lengths(quick, step, (params, jax.tree.map(jnp.zeros_like, params)))


#: name -> builder of the program's case (``quick``: CI-sized)
FRESH: dict[str, Callable[[bool], Case]] = {"muon": muon_case}
