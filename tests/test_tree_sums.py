"""``jaxmem.memory.tree_sums``: the float32 input XLA's CPU backend writes for a bf16 sum.

XLA is the oracle: whether the entry computation holds a float32 copy of the summed
input is read from the optimized HLO of each case, and the peak of a bf16 softmax
gradient (its ``dP * P`` row sum; -20 % against XLA without the rule) is checked.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.memory.tree_sums import TREE_MIN_ELEMENTS, tree_sum_inputs
from jaxmem.symbolic import ShapeDomain, sym

BF, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
S = jax.ShapeDtypeStruct

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU rules")


def _sum(axes):
    return lambda a, b: jax.lax.reduce_sum_p.bind(a * b, axes=axes, out_sharding=None)


# (name, shape, axes, dtype)
CASES = [
    ("row sum over 128", (64, 128, 128), (2,), BF),
    ("bias gradient over batch and sequence", (8, 64, 256), (0, 1), BF),
    ("column sum over 4096 rows", (4096, 64), (0,), BF),
    ("row sum over 32", (64, 128, 32), (2,), BF),
    ("row sum over 33", (64, 128, 33), (2,), BF),
    ("float16 row sum over 128", (64, 128, 128), (2,), F16),
    ("float32 row sum over 128", (64, 128, 128), (2,), F32),
]


@cpu_only
@pytest.mark.parametrize(("name", "shape", "axes", "dtype"), CASES, ids=[c[0] for c in CASES])
def test_the_float32_inputs_are_the_ones_xla_writes(name, shape, axes, dtype) -> None:
    specs = (S(shape, dtype), S(shape, dtype))
    fn = _sum(axes)
    g = build_graph(jax.make_jaxpr(fn)(*specs))
    extras = tree_sum_inputs(g, range(len(g.nodes)), [True] * len(g.nodes), "cpu")
    txt = jax.jit(fn).lower(*specs).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    dims = ",".join(map(str, shape))
    xla_copies = re.search(rf"= f32\[{dims}\]\S* fusion\(", entry) is not None
    assert bool(extras) == xla_copies
    assert [x.nbytes for x in extras] == ([4 * jnp.prod(jnp.array(shape)).item()]
                                         if xla_copies else [])


def test_symbolic_counts_decide_at_the_threshold() -> None:
    b = jax.export.symbolic_shape("b")[0]
    g = build_graph(jax.make_jaxpr(_sum((0,)))(S((b, 8), BF), S((b, 8), BF)))
    (x,) = tree_sum_inputs(g, range(len(g.nodes)), [True] * len(g.nodes), "cpu")
    sizes = [x.nbytes.subs(sym("b"), n) for n in (TREE_MIN_ELEMENTS - 1, TREE_MIN_ELEMENTS)]
    assert sizes == [0, TREE_MIN_ELEMENTS * 8 * 4]
    assert tree_sum_inputs(g, range(len(g.nodes)), [True] * len(g.nodes), "gpu") == []


@cpu_only
def test_a_bf16_softmax_gradient_within_ten_percent_of_xla() -> None:
    def loss(x, v):
        return (jax.nn.softmax(x, axis=-1) @ v).astype(F32).sum()

    step = jax.grad(loss, argnums=(0, 1))
    specs = (S((64, 128, 128), BF), S((128, 32), BF))
    g = build_graph(jax.make_jaxpr(step)(*specs))
    predicted = int(memory_model(g, ShapeDomain.from_constraints((), ())).peak_bytes)
    xla = jaxmem.xla_peak_bytes(jax.jit(step).lower(*specs).compile())
    assert abs(predicted / xla - 1) <= 0.10
