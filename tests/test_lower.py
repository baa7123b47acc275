"""Executing a graph by binding its equations: same results as JAX, orders enforced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmem.graph import build_graph
from jaxmem.lower import COMPILER_OPTIONS, as_function, compiler_options


def program(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Literals, constants, a pjit, a custom_jvp, a scan and a multi-result primitive."""
    const = jnp.arange(4.0)

    def body(c, xs):
        return c * 0.5 + jnp.tanh(xs @ w), c.sum()

    c, ys = lax.scan(body, jnp.zeros(4), x)
    a, b = jnp.split(x, 2, axis=0)
    y = jax.jit(lambda t: jax.nn.relu(t) + const)(c) * 2.0
    return y + jax.nn.softplus(a.sum()) - b.mean(), ys


W = jnp.asarray(np.random.default_rng(0).standard_normal((4, 4), np.float32))
X = jnp.asarray(np.random.default_rng(1).standard_normal((6, 4), np.float32))


@pytest.mark.parametrize("enforce", [False, True])
def test_as_function_matches_jax(enforce):
    closed = jax.make_jaxpr(program)(W, X)
    graph = build_graph(closed)
    got = jax.jit(as_function(graph, enforce_order=enforce))(W, X)
    want = jax.tree_util.tree_leaves(program(W, X))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_graph_matches_jax_grad():
    f = jax.grad(lambda w, x: jnp.sum(program(w, x)[0] ** 2))
    graph = build_graph(jax.make_jaxpr(f)(W, X))
    (got,) = jax.jit(as_function(graph))(W, X)
    np.testing.assert_allclose(got, f(W, X), rtol=1e-5, atol=1e-6)


def test_wrong_argument_count():
    graph = build_graph(jax.make_jaxpr(lambda x: x * 2)(jnp.ones(3)))
    with pytest.raises(TypeError, match="expected 1 flat arguments, got 2"):
        as_function(graph)(jnp.ones(3), jnp.ones(3))


def test_compiler_options_are_per_backend_copies():
    assert compiler_options("cpu") == {"xla_disable_hlo_passes": "cse_barrier_expander"}
    assert compiler_options("gpu") == {}
    compiler_options("cpu")["x"] = "y"
    assert "x" not in COMPILER_OPTIONS["cpu"]
