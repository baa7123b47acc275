"""Jitted.plan_compiles: announced calls priced by measured compile and step times."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.plan.compiles import CompilePlan, CompileProblem


def step(w: jax.Array, x: jax.Array) -> jax.Array:
    return jax.grad(lambda w: jnp.tanh(jnp.tanh(x @ w) @ w).sum())(w)


W = jnp.ones((32, 32)) * 0.01
LENGTHS = (10, 12, 30, 31, 64) * 4


def calls(lengths=LENGTHS) -> list[tuple]:
    return [(W, jax.ShapeDtypeStruct((2, s, 32), jnp.float32)) for s in lengths]


def make(**kw) -> jaxmem.Jitted:
    return jaxmem.jit(step, polymorphic_shapes=(None, "b, s, 32"),
                      constraints=("b <= 4", "s <= 64"), **kw)


def test_first_plan_compiles_the_largest_call_and_covers_every_call() -> None:
    f = make()
    plan = f.plan_compiles(calls(), pad_dims=("s",))
    assert f.cache_info().executables == 1 and len(f.costs.compiles) == 1
    assert f.costs.compiles[0][0] == {"b": 2, "s": 64}
    for s in LENGTHS:
        cover = dict(zip(plan.names, plan.cover(tuple({"b": 2, "s": s}[n]
                                                     for n in plan.names)), strict=True))
        assert cover["b"] == 2 and s <= cover["s"] <= 64
    assert plan.compile_s >= 0 and plan.step_s > 0


def test_slow_steps_buy_exact_shapes_and_fast_steps_buy_padding() -> None:
    f = make()
    f.plan_compiles(calls(), pad_dims=("s",))  # times the first compile
    f.costs.record_step({"b": 2, "s": 64}, 1e3)  # steps far dearer than compiles
    slow = f.plan_compiles(calls(), pad_dims=("s",))
    assert slow.pad_fraction == 0.0 and len(slow.compile) == len(set(LENGTHS)) - 1
    g = make()
    g.plan_compiles(calls(), pad_dims=("s",))
    g.costs.record_step({"b": 2, "s": 64}, 1e-9)  # steps free: run everything on one
    fast = g.plan_compiles(calls(), pad_dims=("s",))
    assert fast.compile == () and fast.pad_fraction > 0.0


def test_padded_runs_give_the_exact_results() -> None:
    f = make()
    plan = f.plan_compiles(calls(), pad_dims=("s",))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 10, 32)), jnp.float32)
    names = plan.names
    cover = dict(zip(names, plan.cover(tuple({"b": 2, "s": 10}[n] for n in names)),
                     strict=True))
    padded = jnp.pad(x, ((0, 0), (0, cover["s"] - 10), (0, 0)))  # zero rows add nothing
    np.testing.assert_allclose(f(W, padded), jax.jit(step)(W, x), rtol=1e-5, atol=1e-6)


def test_a_scheduler_can_choose_the_compile_plan() -> None:
    seen: list[CompileProblem] = []

    class Exact(jaxmem.Scheduler):
        def compile_plan(self, problem: CompileProblem) -> CompilePlan:
            seen.append(problem)
            covers = {c: c for c in problem.calls}
            return CompilePlan(problem.names, covers, tuple(sorted(set(problem.calls))),
                               0.0, 0.0, 0.0)

    f = make(scheduler=Exact())
    plan = f.plan_compiles(calls(), pad_dims=("s",))
    assert len(seen) == 1 and plan.pad_fraction == 0.0
    assert len(seen[0].calls) == len(LENGTHS)


def test_covers_fit_the_budget_and_unfitting_calls_are_named() -> None:
    budget = make().plan_for(*calls((30,))[0]).peak_bytes
    g = make(budget_bytes=budget)
    plan = g.plan_compiles(calls((10, 12, 30, 64)), pad_dims=("s",))
    for shape, cover in plan.covers.items():
        spec = jax.ShapeDtypeStruct(cover, jnp.float32)  # names are ("b", "s") here
        if shape in plan.infeasible:
            with pytest.raises(jaxmem.BudgetInfeasibleError):
                g.plan_for(W, jax.ShapeDtypeStruct((*shape, 32), jnp.float32))
        else:
            assert g.plan_for(W, jax.ShapeDtypeStruct((*spec.shape, 32), jnp.float32)
                              ).peak_bytes <= budget


def test_bad_pad_dims_are_refused() -> None:
    f = make()
    with pytest.raises(ValueError, match="pad_dims"):
        f.plan_compiles(calls(), pad_dims=("t",))
    with pytest.raises(jaxmem.ShapeOutOfRangeError):
        f.plan_compiles(calls((65,)), pad_dims=("s",))
    assert f.plan_compiles([], pad_dims=("s",)).covers == {}
