"""jaxmem.dispatch.traced: ``jaxmem.jit`` under outer transformations, ``eval_shape``,
``trace``, ``lower`` and ``clear_cache`` as ``jax.jit`` has them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem.dispatch.traced import has_tracer

LAYERS, D = 4, 64


def _step(ws: list[jax.Array], x: jax.Array, scale: float) -> tuple[list[jax.Array], jax.Array]:
    def loss(ws: list[jax.Array]) -> jax.Array:
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    value, grads = jax.value_and_grad(loss)(ws)
    return [w - scale * g for w, g in zip(ws, grads, strict=True)], value


def _args(b: int = 256) -> tuple[list[jax.Array], jax.Array, float]:
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(D, D)) / 8, jnp.float32) for _ in range(LAYERS)]
    return ws, jnp.asarray(rng.normal(size=(b, D)), jnp.float32), 0.1


def _jitted(budget_bytes: int | None = None) -> jaxmem.Jitted:
    return jaxmem.jit(_step, polymorphic_shapes=(None, "b, 64", None),
                      constraints=("b <= 256",), budget_bytes=budget_bytes,
                      static_argnums=(2,))


def _close(got: object, want: object) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_under_grad_vmap_and_an_outer_jit_it_computes_what_jax_jit_does() -> None:
    ws, x, scale = _args()
    f, g = _jitted(), jax.jit(_step, static_argnums=(2,))
    f(ws, x, scale)  # a planned call first: the fast path then meets tracers
    loss_of = lambda h: lambda x: h(ws, x, scale)[1]  # noqa: E731
    _close(jax.grad(loss_of(f))(x), jax.grad(loss_of(g))(x))
    _close(jax.vmap(loss_of(f))(x[:, None]), jax.vmap(loss_of(g))(x[:, None]))
    _close(jax.jit(loss_of(f))(x), g(ws, x, scale)[1])
    assert f.cache_info().plans == 1  # nothing was planned for the traced calls


def test_eval_shape_is_jax_jits_and_compiles_nothing() -> None:
    ws, x, scale = _args()
    f = _jitted()
    got = f.eval_shape(ws, x[:7], scale)
    assert got == jax.jit(_step, static_argnums=(2,)).eval_shape(ws, x[:7], scale)
    assert f.compiles == 0


def test_trace_is_jax_jits_and_plans_nothing() -> None:
    ws, x, scale = _args()
    f = _jitted()
    got = f.trace(ws, x[:7], scale)
    want = jax.jit(_step, static_argnums=(2,)).trace(ws, x[:7], scale)
    assert str(got.jaxpr) == str(want.jaxpr)
    assert f.cache_info().plans == 0


def test_clear_cache_drops_the_executables_and_the_next_call_compiles_again() -> None:
    ws, x, scale = _args()
    f = _jitted()
    want = f(ws, x[:5], scale)
    f(ws, x[:6], scale)
    assert f.compiles == 2 and f.cache_info().analyses == 1
    f.clear_cache()
    assert f.compiles == 0 and f.cache_info().plans == 0
    _close(f(ws, x[:5], scale), want)  # the fast path holds nothing stale
    assert f.compiles == 1 and f.cache_info().analyses == 1  # the analysis is kept


def test_lower_compiles_to_the_executable_a_call_runs() -> None:
    ws, x, scale = _args()
    probe = _jitted()
    levels = len(probe.plans(ws, x, scale).levels)
    deepest = probe.compile_level(levels - 1, ws, x, scale).peak_bytes
    f = _jitted(budget_bytes=deepest)
    plan = f.plan_for(ws, x, scale)
    assert plan.level > 0
    compiled = f.lower(ws, x, scale).compile()
    assert jaxmem.xla_peak_bytes(compiled) == plan.peak_bytes
    _close(compiled(ws, x), jax.jit(_step, static_argnums=(2,))(ws, x, scale))


def test_has_tracer_looks_at_every_leaf() -> None:
    assert not has_tracer(({"a": jnp.ones(2)}, 1.0), {"k": np.ones(2)})
    seen = []
    jax.grad(lambda x: seen.append(has_tracer(([1.0, x],))) or x.sum())(jnp.ones(2))
    assert seen == [True]
