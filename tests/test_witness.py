"""Exact witnesses at the sample points (``jaxmem.symbolic.witness``) change no answer.

The shortcuts only skip sympy where its answer is already known: a pair whose
difference changes sign between sample points is UNKNOWN to every sound
comparison, and a sample point where the new peak is below the old one means it
lowers the peak somewhere. Checked as properties against :func:`compare` on random
polynomials, and on real train steps: the memory model with the frontier's
shortcut equals the one without it (the same peak, bound and candidates).
"""

from __future__ import annotations

import collections

import pytest
import sympy
from hypothesis import given
from hypothesis import strategies as st

from jaxmem.fastexpr import compile_expr
from jaxmem.memory import memory_model
from jaxmem.symbolic import Cmp, ShapeDomain, compare, is_exact, lowers_somewhere, signs_differ
from jaxmem.symbolic import sym as _sym
from tests.programs import analyze_program, small_llama_bf16

B, S = _sym("b"), _sym("s")
DOM = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 512"))
monomials = st.sampled_from([sympy.Integer(1), B, S, B * S, S ** 2, B * S ** 2, B ** 2])
polys = st.lists(st.tuples(st.integers(-64, 64), monomials), min_size=1, max_size=4).map(
    lambda terms: sympy.Add(*[c * m for c, m in terms]))


def at_samples(e: sympy.Expr) -> tuple:
    f = compile_expr([B, S], e)
    return tuple(f(p["b"], p["s"]) for p in DOM.sample_points())


def test_signs_differ_and_exactness() -> None:
    assert signs_differ((1, 5), (2, 3)) and not signs_differ((1, 5), (1, 3))
    assert not signs_differ(None, (1,)) and not signs_differ((1,), None)
    assert all(is_exact(v) for v in at_samples(B * S ** 2 / 3))
    assert not is_exact(0.5)


@given(polys, polys)
def test_differing_signs_mean_unknown(a, b) -> None:
    if signs_differ(at_samples(a), at_samples(b)):
        assert compare(a, b, DOM).result == Cmp.UNKNOWN, (a, b)


@given(polys, polys)
def test_lowers_somewhere_agrees_with_compare(new, old) -> None:
    by_compare = compare(new, old, DOM).result not in (Cmp.GE, Cmp.GT, Cmp.EQ)
    assert lowers_somewhere(new, old, DOM, True, collections.Counter()) == by_compare
    # The ablation answers from the sample points alone, as before.
    below = any(x < y for x, y in zip(at_samples(new), at_samples(old), strict=True))
    assert lowers_somewhere(new, old, DOM, False, collections.Counter()) == below


def test_witness_is_counted_as_fallback() -> None:
    tally: collections.Counter[str] = collections.Counter()
    assert lowers_somewhere(S, 3 * S - 100, DOM, True, tally)  # below at s = 512
    assert tally == {"fallback": 1}


# A program whose live points cross (one larger at some sampled shapes, another at
# others): the shortcut fires there. The small GPT and attention programs did until
# session 25: the zeros their gradients scatter into, now live from the program's start
# (``scatters.scattered_zeros``), leave one point above the others at every sample.
@pytest.mark.parametrize("program", [small_llama_bf16])
def test_frontier_shortcut_keeps_the_memory_model(program, monkeypatch) -> None:
    report = analyze_program(program())
    fired = []

    def counted(a, b) -> bool:
        fired.append(signs_differ(a, b))
        return fired[-1]

    for reuse in (True, False):
        # The reuse-free bound is derived when first read: read it under the patch.
        with monkeypatch.context() as m:
            m.setattr("jaxmem.memory.frontier.signs_differ", counted)
            fast = memory_model(report.graph, report.domain, reuse_outputs=reuse)
            fast_upper = fast.temp_bytes_without_reuse
        with monkeypatch.context() as m:
            m.setattr("jaxmem.memory.frontier.signs_differ", lambda a, b: False)
            slow = memory_model(report.graph, report.domain, reuse_outputs=reuse)
            slow_upper = slow.temp_bytes_without_reuse
        assert fast.peak_bytes == slow.peak_bytes
        assert fast_upper == slow_upper
        assert fast.candidates == slow.candidates
    assert any(fired), "the shortcut never fired: nothing was checked"
