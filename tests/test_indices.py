"""Index tuples of gathers and scatters with batching dims (``jaxmem.memory.indices``)
against XLA's CPU peak."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.memory.indices import batched_index_tuples
from jaxmem.symbolic import ShapeDomain, sym

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's rules")


def _top_rows_gradient(x: jax.Array) -> jax.Array:
    return jax.grad(lambda x: jnp.sum(jnp.sort(x, axis=1)[:, :4] ** 2))(x)


def _cross_entropy_gradient(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss(w: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(x @ w)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))
    return jax.grad(loss)(w)


@pytest.mark.parametrize(("fn", "specs", "bound"), [
    # The sort's gradient scatters through indices with two batching dims: XLA builds
    # [b * s * 64, 3] index tuples, three times the operand (without: -42.6 %).
    (_top_rows_gradient, lambda b: (jax.ShapeDtypeStruct((b, 256, 64), jnp.float32),), 0.01),
    (_cross_entropy_gradient, lambda b: (jax.ShapeDtypeStruct((64, 512), jnp.float32),
                                         jax.ShapeDtypeStruct((b, 256, 64), jnp.float32),
                                         jax.ShapeDtypeStruct((b, 256), jnp.int32)), 0.03),
])
def test_batched_gathers_and_scatters_take_their_index_tuples(fn, specs, bound) -> None:
    (b,) = jax.export.symbolic_shape("b", constraints=("b <= 16",))
    graph = build_graph(jax.make_jaxpr(fn)(*specs(b)))
    model = memory_model(graph, ShapeDomain.from_constraints(("b",), ("b <= 16",)))
    for n in (2, 8):
        xla = jaxmem.xla_peak_bytes(jax.jit(fn).lower(*specs(n)).compile())
        assert abs(int(model.peak_bytes.subs(sym("b"), n)) / xla - 1) <= bound, (n, xla)
    extras = batched_index_tuples(graph, range(len(graph.nodes)), "cpu")
    assert len(extras) == 1 and batched_index_tuples(graph, range(len(graph.nodes)), "gpu") == []
