"""The matrix form of the live-bytes sweep (``jaxmem.memory.points``) against its definition.

``live_table`` must give, at every order position, exactly the dictionary sum of
the live temporaries (plus the position's extra bytes) that the memory model
computed before it; with it, the memory model of a real train step must be the
same model as the dictionary path gives, and so must every level the planner
derives (its peak, against a memory model built afresh on the level's graph).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from hypothesis import given
from hypothesis import strategies as st

import jaxmem.memory.model as model_module
from jaxmem.fastexpr import compile_expr
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.memory.frontier import undominated, undominated_table
from jaxmem.memory.liveness import Buffer
from jaxmem.memory.points import LIMIT, PointTable, distinct_rows, live_table
from jaxmem.plan.levels import plan_levels
from jaxmem.symbolic import ShapeDomain, sym

B, S = sym("b"), sym("s")
MONOMIALS = [sympy.Integer(1), B, S, B * S, B * S ** 2]
N = 12
size = st.lists(st.tuples(st.sampled_from(MONOMIALS), st.integers(0, 9)), min_size=1,
                max_size=3).map(lambda ts: sympy.Add(*[c * m for m, c in ts]))


@st.composite
def buffers(draw: st.DrawFn) -> list[Buffer]:
    out = []
    for k in range(draw(st.integers(0, 10))):
        start = draw(st.integers(0, N - 1))  # temporaries are written at a position
        end = draw(st.integers(start, N - 1))
        kind = draw(st.sampled_from(["temp", "temp", "temp", "argument", "output"]))
        out.append(Buffer(k, draw(size), start, end, kind))
    return out


def reference(bufs: list[Buffer], extra: dict[int, sympy.Expr], n: int) -> list[dict]:
    """The live temporaries' bytes at each position, summed as plain sympy."""
    out = []
    for p in range(n):
        total = sympy.Add(*[b.nbytes for b in bufs
                            if b.kind == "temp" and 0 <= b.start <= p <= b.end])
        total = sympy.expand(total + extra.get(p, 0))
        terms = collections.Counter()
        for t in sympy.Add.make_args(total):
            c, m = t.as_coeff_Mul()
            terms[m] += c
        out.append({m: c for m, c in terms.items() if c != 0})
    return out


@given(buffers(), st.dictionaries(st.integers(0, N - 1), size, max_size=3))
def test_table_is_the_sum_of_live_temporaries(bufs, extra) -> None:
    table = live_table(bufs, extra, N)
    assert table is not None and len(table) == N
    assert [dict(p) for p in table] == reference(bufs, extra, N)
    assert table == reference(bufs, extra, N)  # a table equals its points as pairs


@given(buffers())
def test_table_sweep_equals_the_dictionary_sweep(bufs) -> None:
    table = live_table(bufs, {}, N)
    fast, slow = collections.Counter(), collections.Counter()
    assert undominated_table(table, fast) == undominated([dict(p) for p in table], slow)
    assert fast == slow
    assert distinct_rows(table.matrix) == sorted(
        {tuple(r): i for i, r in reversed(list(enumerate(table.matrix.tolist())))}.values())


def test_non_integer_or_huge_coefficients_are_left_to_the_dictionaries() -> None:
    half = [Buffer(0, B / 2, 0, 1, "temp")]
    huge = [Buffer(0, LIMIT * B, 0, 1, "temp")]
    assert live_table(half, {}, 2) is None and live_table(huge, {}, 2) is None
    assert isinstance(live_table([], {}, 0), PointTable)


def gpt_graph(scanned: bool = False):
    from bench.programs import gpt_program, gpt_scan_program

    make = gpt_scan_program if scanned else gpt_program
    p = make(layers=2, d=64, heads=2, vocab=64, max_b=8, max_s=64)
    g = build_graph(jax.make_jaxpr(p.step)(*p.symbolic_args()))
    return g, ShapeDomain.from_constraints(p.symbols, p.constraints)


def test_memory_model_is_the_same_with_and_without_the_table(monkeypatch) -> None:
    g, dom = gpt_graph()
    fast = memory_model(g, dom, donated=(0,))
    monkeypatch.setattr(model_module, "live_table", lambda *a: None)
    slow = memory_model(g, dom, donated=(0,))
    assert not isinstance(slow.points, PointTable) and isinstance(fast.points, PointTable)
    assert fast.peak_bytes == slow.peak_bytes and fast.candidates == slow.candidates
    assert fast.comparisons == slow.comparisons and fast.points == slow.points
    assert fast.timeline == slow.timeline


@pytest.mark.parametrize(("offload", "scanned"), [(False, False), (True, False), (False, True)])
def test_every_level_predicts_what_a_fresh_memory_model_does(offload, scanned) -> None:
    """The planner's models (shared between chains, built on rewritten graphs, with the
    scan bodies' models cached) are the ones :func:`memory_model` builds from scratch
    on each level's graph, at every sample point."""
    g, dom = gpt_graph(scanned)
    model_module.forget_body_models()
    plans = plan_levels(g, dom, donated=(0,), offload=offload)
    assert len(plans.levels) > 1
    points = dom.sample_points()
    for level in plans.levels:
        model_module.forget_body_models()  # from scratch: no body's model reused
        fresh = memory_model(level.graph, dom, donated=(0,),
                             reuse_outputs=level.memory.reuse_outputs)
        fn = compile_expr([sym(n) for n in dom.symbols], fresh.peak_bytes)  # subs: minutes
        want = [int(fn(*[p[n] for n in dom.symbols])) for p in points]
        assert [int(level.peak_fn(p)) for p in points] == want


def test_matrix_is_read_only() -> None:
    table = live_table([Buffer(0, 4 * B, 0, 1, "temp")], {}, 2)
    with pytest.raises(ValueError):
        table.matrix[0, 0] = 1
    assert np.array_equal(table.matrix, [[4], [4]])


def test_tanh_grad_table() -> None:
    b, = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(jax.grad(lambda x: jnp.tanh(x @ x.T).sum()))(
        jax.ShapeDtypeStruct((b, 8), jnp.float32)))
    m = memory_model(g, ShapeDomain.from_constraints(("b",), ("b <= 64",)))
    assert isinstance(m.points, PointTable) and len(m.points) == len(g.nodes)
