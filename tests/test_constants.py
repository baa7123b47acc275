"""jaxmem.memory.constants: shared scalar constants of library fusions as buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import sympy

from jaxmem.graph import build_graph
from jaxmem.memory.constants import ConstantUse, shared_constants
from jaxmem.memory.fusion import used_nodes
from jaxmem.memory.library import constant_operands


def _graph():
    # nodes: 0 x*0.5 (outside any fusion), 1 x*0.5 -> 2 tanh, 3 x*0.5 -> 4 exp
    f = lambda x: (x * 0.5, jnp.tanh(x * 0.5), jnp.exp(x * 0.5))  # noqa: E731
    g = build_graph(jax.make_jaxpr(f)(jnp.ones((64, 64))))
    assert [n.primitive for n in g.nodes] == ["mul", "mul", "tanh", "mul", "exp"]
    return g, used_nodes(g)


def _uses(rows_first: int, rows_second: int) -> list[ConstantUse]:
    return [ConstantUse(frozenset({1}), frozenset({1, 2}), 2, rows_first, 0),
            ConstantUse(frozenset({3}), frozenset({3, 4}), 4, rows_second, 0)]


@pytest.mark.parametrize(("first", "second", "live"), [
    (8192, 8192, [(0, 4)]),  # both fusions exist: one buffer until the last
    (8192, 16, [(0, 2)]),  # the second is under the threshold: the buffer ends earlier
    (16, 8192, [(0, 4)]),  # a later fusion keeps the buffer from the start
    (16, 16, []),
])
def test_a_constant_is_a_buffer_until_the_last_fusion_that_exists(first, second, live):
    g, used = _graph()
    extras = shared_constants(g, used, _uses(first, second), "note")
    assert [(x.start, x.end) for x in extras if x.nbytes != 0] == live
    assert all(x.nbytes in (0, 64 * 64 * 4) for x in extras)


def test_a_constant_no_op_outside_reads_is_no_buffer():
    g, used = _graph()
    inside = frozenset(range(5))
    uses = [ConstantUse(frozenset({0, 1, 3}), inside, 4, 8192, 0)]
    assert shared_constants(g, used, uses, "note") == []
    taken = frozenset({(0.5, (64, 64), 4)})  # another rule counts it
    assert shared_constants(g, used, _uses(8192, 8192), "note", taken) == []


def test_a_constant_over_a_shifted_symbolic_shape_has_its_dtypes_itemsize():
    # x[:, :-1] is (b, s - 1): its size is held expanded (4*b*s - 4*b), which sympy does
    # not divide by b*(s - 1) on its own; the key's itemsize must still be the number 4.
    b, s = jax.export.symbolic_shape("b, s")
    f = lambda x: (x[:, :-1] * 0.5, jnp.tanh(x[:, :-1] * 0.5))  # noqa: E731
    g = build_graph(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((b, s), jnp.float32)))
    muls = [n.index for n in g.nodes if n.primitive == "mul"]
    keys = {k for n in muls for k in constant_operands(g, g.nodes[n])}
    assert [k[2] for k in keys] == [4]
    tanh = next(n.index for n in g.nodes if n.primitive == "tanh")
    uses = [ConstantUse(frozenset({muls[1]}), frozenset({muls[1], tanh}), tanh, 8192, 0)]
    (extra,) = shared_constants(g, used_nodes(g), uses, "note")
    size = g.values[g.nodes[muls[1]].outputs[0]].nbytes
    assert sympy.expand(extra.nbytes - size) == 0
