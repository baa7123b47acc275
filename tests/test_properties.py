"""Property tests: ``jaxmem.jit`` computes what ``jax.jit`` computes (issue 7, item 2).

Hypothesis draws a small program (an MLP, attention, reshape or scan step, built
from a few drawn sizes) and shapes inside the declared ranges; ``jaxmem.jit`` of
the program's gradient step must return ``jax.jit``'s outputs within fp32
tolerance. Each new shape compiles twice (once per side), so the example counts
are modest; the ``Jitted`` of each program variant is built once and reused, as
a caller would (its symbolic analysis runs once per variant).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import jaxmem

MAX_B, MAX_S = 6, 12
CONSTRAINTS = (f"b <= {MAX_B}", f"s <= {MAX_S}")
TOL = 1e-5

COMPILES = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def assert_tree_close(got: Any, want: Any, tol: float = TOL) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _params(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(v, np.float32) * 0.3) for k, v in shapes.items()}


def _grad_step(loss: Callable[..., jax.Array]) -> Callable[..., Any]:
    """``(params, x) -> (new params, loss)`` with plain SGD: a whole train step."""
    def step(p: dict[str, jax.Array], x: jax.Array) -> Any:
        value, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), value

    return step


# --- the program families; each returns (step, param shapes, x shape as a dims string) ------


def mlp(width: int, layers: int, act: str) -> tuple[Callable, dict, str, Callable]:
    f = {"relu": jax.nn.relu, "tanh": jnp.tanh, "gelu": jax.nn.gelu}[act]
    shapes = {f"w{i}": (width, width) for i in range(layers)} | {"out": (width, 2)}

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h = x
        for i in range(layers):
            h = f(h @ p[f"w{i}"])
        return jnp.mean((h @ p["out"]) ** 2)

    return _grad_step(loss), shapes, f"b, {width}", lambda b, s: (b, width)


def attention(d: int, heads: int, causal: bool) -> tuple[Callable, dict, str, Callable]:
    shapes = {"qkv": (d, 3 * d), "o": (d, d)}

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q, k, v = jnp.split((x @ p["qkv"]).reshape(b, s, 3 * heads, d // heads), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        if causal:
            mask = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
            scores = jnp.where(mask, scores, -1e9)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, s, d)
        return jnp.mean(jnp.tanh(ctx @ p["o"] + x) ** 2)

    return _grad_step(loss), shapes, f"b, s, {d}", lambda b, s: (b, s, d)


def reshape(width: int, stride: int) -> tuple[Callable, dict, str, Callable]:
    shapes = {"up": (2, width), "mix": (width, width)}

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        b, two_s = x.shape
        h = jnp.tanh(x.reshape(b * (two_s // 2), 2) @ p["up"])  # (b*s, width)
        h = h.reshape(b, two_s // 2, width)[:, ::stride]
        return jnp.mean(jnp.tanh(h @ p["mix"]) ** 2)

    return _grad_step(loss), shapes, "b, 2*s", lambda b, s: (b, 2 * s)


def scan(width: int, reverse: bool) -> tuple[Callable, dict, str, Callable]:
    shapes = {"w": (width, width), "u": (width, width)}

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:  # an RNN over s
        def cell(h: jax.Array, xt: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = jnp.tanh(h @ p["w"] + xt @ p["u"])
            return h, h
        h0 = jnp.zeros((x.shape[0], width), x.dtype)
        _, hs = jax.lax.scan(cell, h0, jnp.swapaxes(x, 0, 1), reverse=reverse)
        return jnp.mean(hs ** 2)

    return _grad_step(loss), shapes, f"b, s, {width}", lambda b, s: (b, s, width)


VARIANTS = st.one_of(
    st.tuples(st.just("mlp"), st.sampled_from((4, 8)), st.integers(1, 2),
              st.sampled_from(("relu", "tanh", "gelu"))),
    st.tuples(st.just("attention"), st.just(8), st.sampled_from((1, 2)), st.booleans()),
    st.tuples(st.just("reshape"), st.sampled_from((4, 8)), st.sampled_from((1, 2))),
    st.tuples(st.just("scan"), st.sampled_from((4, 8)), st.booleans()),
)
FAMILIES = {"mlp": mlp, "attention": attention, "reshape": reshape, "scan": scan}


@functools.cache
def compiled(variant: tuple) -> tuple[jaxmem.Jitted, Callable, dict, Callable]:
    step, shapes, spec, x_shape = FAMILIES[variant[0]](*variant[1:])
    planned = jaxmem.jit(step, polymorphic_shapes=(None, spec), constraints=CONSTRAINTS)
    return planned, jax.jit(step), shapes, x_shape


@COMPILES
@given(variant=VARIANTS, b=st.integers(1, MAX_B), s=st.integers(1, MAX_S),
       seed=st.integers(0, 2**16))
def test_jaxmem_jit_matches_jax_jit(variant: tuple, b: int, s: int, seed: int) -> None:
    planned, plain, shapes, x_shape = compiled(variant)
    params = _params(shapes, seed)
    x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(x_shape(b, s), np.float32))
    got = planned(params, x)
    want = plain(params, x)
    assert_tree_close(got, want)
    assert planned.plan_for(params, x).peak_bytes > 0


@functools.cache
def budgeted(fraction: float) -> tuple[jaxmem.Jitted, int]:
    """Attention under a budget at ``fraction`` of its unconstrained peak at the largest
    shape: big shapes must recompute (or be refused), small ones fit as they are."""
    step, shapes, spec, x_shape = attention(8, 2, True)
    big = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
    x = jax.ShapeDtypeStruct(x_shape(MAX_B, MAX_S), jnp.float32)
    free = compiled(("attention", 8, 2, True))[0].plan_for(big, x).peak_bytes
    budget = int(free * fraction)
    return jaxmem.jit(step, polymorphic_shapes=(None, spec), constraints=CONSTRAINTS,
                      budget_bytes=budget), budget


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(MAX_B - 2, MAX_B), s=st.integers(MAX_S - 4, MAX_S),
       seed=st.integers(0, 2**16), fraction=st.sampled_from((0.7, 0.9)))
def test_tight_budget_changes_the_plan_not_the_result(b: int, s: int, seed: int,
                                                      fraction: float) -> None:
    """A budget below the unconstrained peak may pick recomputation: same values."""
    planned, budget = budgeted(fraction)
    _, plain, shapes, x_shape = compiled(("attention", 8, 2, True))
    params = _params(shapes, seed)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(x_shape(b, s), np.float32))
    try:
        got = planned(params, x)
    except jaxmem.BudgetInfeasibleError as e:
        assert e.min_peak_bytes > budget  # an honest refusal: nothing fits
        event("refused")
        return
    plan = planned.plan_for(params, x)
    event(f"level {plan.level}")
    assert plan.peak_bytes <= budget
    assert_tree_close(got, plain(params, x))


@given(variant=VARIANTS)
@settings(max_examples=200, deadline=None, database=None)
def test_out_of_range_shapes_are_refused(variant: tuple) -> None:
    planned, _, shapes, x_shape = compiled(variant)
    params = _params(shapes, 0)
    x = jnp.zeros(x_shape(MAX_B + 1, 2), jnp.float32)
    try:
        planned(params, x)
    except jaxmem.ShapeOutOfRangeError:
        return
    raise AssertionError(f"b={MAX_B + 1} is outside b <= {MAX_B} but was accepted")


@functools.cache
def offloading(variant: tuple) -> jaxmem.Jitted:
    """The family's step with offload planned and transfers priced near free."""
    from jaxmem.plan.offload import Costs

    step, *_ = FAMILIES[variant[0]](*variant[1:])
    return jaxmem.jit(step, polymorphic_shapes=(None, compiled(variant)[0].polymorphic_shapes[1]),
                      constraints=CONSTRAINTS, offload=True, offload_costs=Costs(1e11, 1e16))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(variant=VARIANTS, b=st.integers(1, MAX_B), s=st.integers(1, MAX_S),
       seed=st.integers(0, 2**16))
@example(variant=("attention", 8, 1, False), b=2, s=5, seed=0)  # one op, two offloaded outputs
def test_every_level_with_offload_matches_jax_jit(variant: tuple, b: int, s: int,
                                                  seed: int) -> None:
    """Any level of a plan set that may offload as well as recompute computes the same.

    Transfers are priced near free so that offload competes with recomputation even
    in these tiny programs.
    """
    _, plain, shapes, x_shape = compiled(variant)
    planned = offloading(variant)
    params = _params(shapes, seed)
    x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(x_shape(b, s), np.float32))
    analysis = planned.analysis(params, x)
    levels = analysis.plans.levels
    n_off = sum(bool(lv.offload) for lv in levels)
    event(f"{variant[0]}: {len(levels)} levels, {n_off} offloading")
    want = plain(params, x)
    for k in range(len(levels)):
        plan = planned.compile_level(k, params, x)
        assert_tree_close(plan.run(params, x), want)
