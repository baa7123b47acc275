"""Index tuples of gathers and scatters with batching dims (``jaxmem.memory.scatters``)
against XLA's CPU peak."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.memory.fusion import materialised
from jaxmem.memory.scatters import batched_index_tuples, scattered_zeros
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


def _embedding_step(p: dict[str, jax.Array], tok: jax.Array) -> dict[str, jax.Array]:
    def loss(p: dict[str, jax.Array]) -> jax.Array:
        logits = jnp.tanh(p["emb"][tok] @ p["w"]) @ p["out"]
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))


def test_an_embeddings_gradient_adds_into_zeros_made_at_the_start() -> None:
    # The transpose of emb[tok] scatters into zeros, which read nothing: XLA's
    # breadth-first schedule makes them among the first instructions, and the 2 MiB
    # table's gradient lives through the forward pass (without the rule: -8.7 %).
    params = {"emb": jnp.ones((4096, 128)), "w": jnp.ones((128, 128)),
              "out": jnp.ones((128, 4096))}
    tok = jnp.zeros((2, 32), jnp.int32)
    graph = build_graph(jax.make_jaxpr(_embedding_step)(params, tok))
    peak = int(memory_model(graph, ShapeDomain((), (), ())).peak_bytes)
    xla = jaxmem.xla_peak_bytes(jax.jit(_embedding_step).lower(params, tok).compile())
    assert abs(peak / xla - 1) <= 0.03, (peak, xla)
    (zeros,) = scattered_zeros(graph, range(len(graph.nodes)), "cpu", materialised(graph))
    assert zeros.start == 0 and int(zeros.nbytes) == 4096 * 128 * 4
    assert scattered_zeros(graph, range(len(graph.nodes)), "gpu", materialised(graph)) == []


def test_a_scatter_at_constant_indices_adds_into_no_zeros() -> None:
    # With a symbolic dim JAX indexes qkv[:, :, 0] by a gather at constant indices, whose
    # transpose scatters into zeros; the concrete trace XLA compiles slices and pads
    # instead, and makes no zeros at the program's start (a packed-sequence decoder's
    # deeper levels were +16..+21 %, two such [b, s, 3, h, d] buffers).
    b, s = jax.export.symbolic_shape("b, s")

    def grad(x: jax.Array) -> jax.Array:
        return x - 0.1 * jax.grad(lambda x: jnp.tanh(x[:, :, 0]).sum())(x)

    graph = build_graph(jax.make_jaxpr(grad)(jax.ShapeDtypeStruct((b, s, 3, 8), jnp.float32)))
    scatters = [n for n in graph.nodes if n.primitive == "scatter-add"]
    assert scatters and all(n.inputs[1] in graph.constant for n in scatters)
    assert scattered_zeros(graph, range(len(graph.nodes)), "cpu", materialised(graph)) == []
