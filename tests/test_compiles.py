"""Compile planning against brute force, and its bookkeeping."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.plan.compiles import CompileProblem, plan_compiles


def brute_force_s(problem: CompileProblem) -> float:
    """Least compiles + steps over every subset of candidate covers, each call on its
    cheapest chosen cover; infinite if a call can run nowhere."""
    axes = [problem.names.index(d) for d in problem.pad_dims]
    calls = set(problem.calls)
    candidates = sorted(calls | problem.compiled)

    def covers(c: tuple[int, ...], s: tuple[int, ...]) -> bool:
        return all(c[i] >= s[i] if i in axes else c[i] == s[i] for i in range(len(s)))

    best = math.inf
    for k in range(1, len(candidates) + 1):
        for chosen in itertools.combinations(candidates, k):
            cost = sum(problem.compile_s(c) for c in chosen if c not in problem.compiled)
            for call in problem.calls:
                steps = [problem.step_s(c) for c in chosen if covers(c, call)]
                steps = [x for x in steps if x is not None]
                cost += min(steps) if steps else math.inf
            best = min(best, cost)
    return best


@st.composite
def problems(draw: st.DrawFn, pad_dims: tuple[str, ...]) -> CompileProblem:
    bs = draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=2))
    ss = st.integers(1, 40)
    calls = tuple((draw(st.sampled_from(bs)), draw(ss))
                  for _ in range(draw(st.integers(1, 9))))
    per_elem = draw(st.floats(1e-4, 1.0))
    fixed_s = draw(st.floats(0.0, 1.0))
    limit = draw(st.integers(4, 200))  # the budget: elements beyond it fit no level
    compile_base = draw(st.floats(0.0, 5.0))
    compiled = frozenset(draw(st.lists(st.tuples(st.sampled_from(bs), ss), max_size=2)))

    def step_s(d: tuple[int, ...]) -> float | None:
        return None if d[0] * d[1] > limit else fixed_s + per_elem * d[0] * d[1]

    def compile_s(d: tuple[int, ...]) -> float:
        return compile_base + 0.01 * (d[1] % 7)  # not monotone: compile costs vary

    return CompileProblem(("b", "s"), calls, pad_dims, step_s, compile_s, compiled)


def plan_cost(problem: CompileProblem) -> float:
    plan = plan_compiles(problem)
    return math.inf if plan.infeasible else plan.predicted_s


@settings(max_examples=300, deadline=None)
@given(problems(("s",)))
def test_one_padded_dim_is_optimal(problem: CompileProblem) -> None:
    assert plan_cost(problem) == pytest.approx(brute_force_s(problem), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(problems(("b", "s")))
def test_two_padded_dims_are_optimal_on_small_sets(problem: CompileProblem) -> None:
    assert plan_cost(problem) == pytest.approx(brute_force_s(problem), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(problems(()))
def test_without_padding_every_call_runs_at_its_own_shape(problem: CompileProblem) -> None:
    plan = plan_compiles(problem)
    assert all(plan.cover(c) == c for c in problem.calls)
    assert plan.pad_fraction == 0.0


@settings(max_examples=200, deadline=None)
@given(problems(("s",)))
def test_covers_are_valid_and_accounted(problem: CompileProblem) -> None:
    plan = plan_compiles(problem)
    for call in problem.calls:
        cover = plan.cover(call)
        assert cover[0] == call[0] and cover[1] >= call[1]
        if call not in plan.infeasible:
            assert problem.step_s(cover) is not None
            assert cover in problem.compiled or cover in plan.compile
    assert not set(plan.compile) & problem.compiled
    assert plan.compile_s == pytest.approx(sum(problem.compile_s(c) for c in plan.compile))


def test_cheap_compiles_keep_exact_shapes_and_dear_ones_pad() -> None:
    calls = tuple((8, s) for s in (100, 130, 170, 240) for _ in range(3))

    def problem(compile_s: float) -> CompileProblem:
        return CompileProblem(("b", "s"), calls, ("s",), lambda d: 1e-3 * d[1],
                              lambda d: compile_s)

    warm = plan_compiles(problem(0.0))
    assert warm.pad_fraction == 0.0 and len(warm.compile) == 4
    cold = plan_compiles(problem(100.0))
    assert cold.compile == ((8, 240),) and cold.pad_fraction > 0.0
    assert "1 new executable" in cold.describe()


def test_a_compiled_cover_is_used_for_free() -> None:
    p = CompileProblem(("b", "s"), ((8, 100), (8, 200)), ("s",), lambda d: 1e-3 * d[1],
                       lambda d: 10.0, compiled=frozenset({(8, 256)}))
    plan = plan_compiles(p)
    assert plan.compile == () and plan.cover((8, 100)) == (8, 256)


def test_unfitting_calls_are_reported_not_covered() -> None:
    p = CompileProblem(("b", "s"), ((8, 100), (8, 300)), ("s",),
                       lambda d: None if d[1] > 200 else 1e-3 * d[1], lambda d: 1.0)
    plan = plan_compiles(p)
    assert plan.infeasible == ((8, 300),) and plan.cover((8, 100)) == (8, 100)


def test_bad_problems_are_refused() -> None:
    with pytest.raises(ValueError, match="pad_dims"):
        CompileProblem(("b", "s"), ((8, 1),), ("t",), lambda d: 1.0, lambda d: 1.0)
    with pytest.raises(ValueError, match="one value per dim"):
        CompileProblem(("b", "s"), ((8,),), ("s",), lambda d: 1.0, lambda d: 1.0)
