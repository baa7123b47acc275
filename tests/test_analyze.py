"""``jaxmem.analyze``: the contract's report (docs/design.md section 2).

Covers: ``report.symbols``, ``peak_bytes`` as a sympy expression over
``Symbol("b")``/``Symbol("s")``, ``peak_bytes_at`` (exact agreement with the
expression, speed), ``report.comparisons``, ``ShapeOutOfRangeError`` for bad dims,
the fallback-only ablation, and ``SymbolicError`` for a comparison the
constraints do not settle. Optax's softmax cross-entropy with ``s``
unconstrained does *not* need one (verified below): it traces fine.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
import pytest
import sympy
from programs import analyze_program, small_gpt

import jaxmem
from jaxmem.symbolic import sym


@pytest.fixture(scope="module")
def report() -> jaxmem.Report:
    return analyze_program(small_gpt())


def test_symbols(report) -> None:
    assert report.symbols == ("b", "s")


def test_peak_bytes_is_sympy_over_b_and_s(report) -> None:
    peak = report.peak_bytes
    assert isinstance(peak, sympy.Expr)
    assert peak.free_symbols == {sympy.Symbol("b", integer=True, positive=True),
                                 sympy.Symbol("s", integer=True, positive=True)}
    assert {str(x) for x in peak.free_symbols} == {"b", "s"}


def test_peak_bytes_at_agrees_with_the_expression(report) -> None:
    b, s = sym("b"), sym("s")
    for dims in ({"b": 1, "s": 1}, {"b": 8, "s": 256}, {"b": 3, "s": 37}, {"b": 8, "s": 256}):
        value = report.peak_bytes_at(**dims)
        assert isinstance(value, int)
        exact = report.peak_bytes.subs({b: dims["b"], s: dims["s"]})
        assert abs(value - float(exact)) <= 1, dims


def test_peak_bytes_at_grows_with_the_shape(report) -> None:
    small = report.peak_bytes_at(b=1, s=16)
    assert report.peak_bytes_at(b=8, s=16) >= small
    assert report.peak_bytes_at(b=8, s=256) > report.peak_bytes_at(b=8, s=16)
    # Parameters, gradients' outputs and optimizer state are paid at every shape.
    assert small >= int(report.memory.argument_bytes.subs({sym("b"): 1, sym("s"): 16}))


def test_peak_bytes_at_is_fast(report) -> None:
    report.peak_bytes_at(b=2, s=2)  # compiles the expression once
    t0 = time.perf_counter()
    for i in range(200):
        report.peak_bytes_at(b=1 + i % 8, s=1 + i)
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 2e-3, f"{per_call * 1e6:.0f} us per call"


def test_comparisons_are_counted(report) -> None:
    c = report.comparisons
    assert set(c) >= {"symbolic", "fallback"}
    assert all(isinstance(v, int) and v >= 0 for v in c.values())
    assert c["symbolic"] > 0
    assert c["symbolic"] >= c["fallback"]


def test_fallback_only_ablation() -> None:
    p = small_gpt()
    r = jaxmem.analyze(p.step, *p.symbolic_args(), symbolic=False)
    assert r.comparisons["symbolic"] == 0
    assert r.comparisons["fallback"] > 0
    # Same peak either way where both are decided (the ablation only prunes less).
    for dims in ({"b": 1, "s": 8}, {"b": 8, "s": 256}):
        ours, theirs = r.peak_bytes_at(**dims), analyze_program(p).peak_bytes_at(**dims)
        assert abs(ours - theirs) <= 0.01 * theirs


@pytest.mark.parametrize(("dims", "match"), [
    ({"b": 17, "s": 8}, "above its upper bound 8"),
    ({"b": 0, "s": 8}, "below its lower bound"),
    ({"b": 2}, "missing"),
    ({"b": 2, "s": 8, "t": 3}, "unknown"),
    ({"b": 2.0, "s": 8}, "must be an int"),
])
def test_out_of_range_dims_raise(report, dims, match) -> None:
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=match):
        report.peak_bytes_at(**dims)
    assert issubclass(jaxmem.ShapeOutOfRangeError, ValueError)


def test_general_constraint_is_checked() -> None:
    b, s = jax.export.symbolic_shape("b, s", constraints=("b*s <= 4096",))
    r = jaxmem.analyze(lambda x: (x * 2).sum(), jax.ShapeDtypeStruct((b, s), jnp.float32))
    assert r.peak_bytes_at(b=4, s=1024) > 0
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match="b\\*s <= 4096"):
        r.peak_bytes_at(b=8, s=1024)


def test_optax_cross_entropy_with_unconstrained_s_traces() -> None:
    b, s = jax.export.symbolic_shape("b, s")
    emb = jnp.zeros((64, 32))

    def loss(emb, tokens):
        logits = emb[tokens] @ emb.T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    r = jaxmem.analyze(jax.value_and_grad(loss), emb, jax.ShapeDtypeStruct((b, s), jnp.int32))
    assert r.symbols == ("b", "s")
    assert r.domain.upper == (None, None)
    assert r.peak_bytes_at(b=4, s=100) > 0


def test_unsettled_comparison_names_the_constraint_to_add() -> None:
    b, s = jax.export.symbolic_shape("b, s")

    def step(x):
        if x.shape[1] >= 128:  # e.g. a long-sequence code path
            return x.sum()
        return (x * 2).sum()

    with pytest.raises(jaxmem.SymbolicError) as info:
        jaxmem.analyze(step, jax.ShapeDtypeStruct((b, s), jnp.float32))
    msg = str(info.value)
    assert "'s' >= '128'" in msg
    assert 'Add the constraint "s >= 128"' in msg
    b, s = jax.export.symbolic_shape("b, s", constraints=("s >= 128",))
    assert jaxmem.analyze(step, jax.ShapeDtypeStruct((b, s), jnp.float32)).symbols == ("b", "s")


def test_describe_and_repr(report) -> None:
    text = report.describe()
    assert "b" in text and "peak" in text and "comparisons" in text
    assert "Report(symbols=('b', 's')" in repr(report)


def test_timeline_at_matches_the_buffers(report) -> None:
    tl = report.timeline_at(b=2, s=16)
    assert len(tl) == len(report.graph.nodes)
    assert all(t >= 0 for t in tl)
