"""``jaxmem.memory.random_bits``: the threefry loop's buffers behind a dropout mask.

XLA is the oracle: the model's peak of a train step with dropout after every layer is
checked against XLA's buffer assignment of the same step (without the rule, the mask's
bits take no buffer and the step is under-predicted by about a third).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.memory.random_bits import random_bits_counters, random_bits_sizes
from jaxmem.symbolic import ShapeDomain

S = jax.ShapeDtypeStruct
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU rules")


def _dropout_mlp(key, ws, x):
    """Gradients of a tanh MLP with dropout (rate 0.1) after every layer."""
    def loss(ws):
        h, k = x, key
        for w in ws:
            k, sub = jax.random.split(k)
            h = jnp.tanh(h @ w)
            h = jnp.where(jax.random.bernoulli(sub, 0.9, h.shape), h / 0.9, 0.0)
        return jnp.mean(h ** 2)
    return jax.grad(loss)(ws)


@cpu_only
def test_a_dropout_step_follows_xla() -> None:
    args = (jax.random.key(0), [S((256, 256), jnp.float32)] * 3, S((1024, 256), jnp.float32))
    g = build_graph(jax.make_jaxpr(_dropout_mlp)(*args))
    xla = jaxmem.xla_peak_bytes(jax.jit(_dropout_mlp).lower(*args).compile())
    pred = int(memory_model(g, ShapeDomain.from_constraints((), ()), backend="cpu").peak_bytes)
    assert abs(pred - xla) / xla <= 0.05, (pred, xla)


def test_two_words_per_element_on_cpu_only() -> None:
    f = lambda key, x: jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0)  # noqa: E731
    g = build_graph(jax.make_jaxpr(f)(jax.random.key(0), jnp.ones((16, 32))))
    (v, nbytes), = random_bits_sizes(g, "cpu").items()
    assert nbytes == 2 * 4 * 16 * 32 and g.nodes[g.producers[v]].primitive == "random_bits"
    order = list(range(len(g.nodes)))
    assert [x.nbytes for x in random_bits_counters(g, order, random_bits_sizes(g, "cpu"))
            ] == [nbytes]
    assert random_bits_sizes(g, "gpu") == {} and random_bits_counters(
        g, order, random_bits_sizes(g, "gpu")) == []
