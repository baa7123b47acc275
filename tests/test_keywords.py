"""Keyword arguments of a ``jaxmem.jit`` call (``jaxmem.dispatch.keywords``), taken as
``jax.jit`` takes them. Oracle: ``jax.jit`` of the same function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

MLP_PARAMS = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((4, 8), np.float32))}


def rows(b: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(2).standard_normal((b, 4), np.float32))


def assert_tree_close(got: object, want: object) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _keyword_step(w: jax.Array, x: jax.Array, lr: float = 0.1, power: int = 2,
                  bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    def loss(w: jax.Array) -> jax.Array:
        h = x @ w + (0.0 if bias is None else bias)
        return jnp.mean(jnp.tanh(h) ** power)

    value, g = jax.value_and_grad(loss)(w)
    return w - lr * g, value



def test_keyword_arguments_as_jax_jit_takes_them():
    ref = jax.jit(_keyword_step, static_argnames=("power",))
    f = jaxmem.jit(_keyword_step, polymorphic_shapes=(None, "b, 4"), constraints=("b <= 8",),
                   static_argnames="power")
    w, bias = MLP_PARAMS["w"], jnp.linspace(0, 1, 8)
    for b, kw in [(3, {"lr": 0.5}), (5, {"lr": 0.25}), (3, {"lr": 0.75}),
                  (5, {"lr": 0.25, "power": 3}),
                  (2, {"bias": bias, "lr": 0.2, "power": 3})]:
        assert_tree_close(f(w, rows(b), **kw), ref(w, rows(b), **kw))
    assert f.cache_info().analyses == 3  # one per keyword signature and static value
    assert f.compiles == 4  # lr is a traced scalar: (3, lr=0.75) reuses (3, lr=0.5)
    plan = f.plan_for(w, rows(6), lr=0.5)
    assert plan.dims == {"b": 6} and plan.predicted_peak_bytes > 0
    assert f.compile_level(0, w, rows(6), lr=0.5, apply_order=False).level == 0
    assert f.plans(w, rows(6), lr=0.5, power=3).levels


def test_a_keyword_argument_with_symbolic_dims_takes_its_parameters_place():
    # step(w, x=batch) as jax.jit takes it: x has a polymorphic_shapes entry, so it is
    # passed in its place and shares the positional call's analysis and executable.
    f = jaxmem.jit(_keyword_step, polymorphic_shapes=(None, "b, 4"), constraints=("b <= 8",))
    w = MLP_PARAMS["w"]
    for args, kw in [((w,), {"x": rows(3)}), ((), {"w": w, "x": rows(3), "lr": 0.5}),
                     ((w, rows(3)), {})]:
        assert_tree_close(f(*args, **kw), jax.jit(_keyword_step)(*args, **kw))
    assert f.plan_for(w, x=rows(5)).dims == {"b": 5}
    assert f.cache_info().analyses == 2  # positional, and with lr as a keyword
    assert f.compiles == 3


def test_keyword_argument_errors_name_the_argument():
    f = jaxmem.jit(_keyword_step, polymorphic_shapes=(None, "b, 4"), static_argnames=("power",))
    def keyword_only(w, *, x):
        return _keyword_step(w, x)

    g = jaxmem.jit(keyword_only, polymorphic_shapes=(None, "b, 4"))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"2 entries .* 1 positional.*x"):
        g(MLP_PARAMS["w"], x=rows(3))  # symbolic dims need a position; x has none
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match="hashable"):
        f(MLP_PARAMS["w"], rows(3), power=[2])
    with pytest.raises(ValueError, match="static_argnames must hold argument names, got 3"):
        jaxmem.jit(_keyword_step, static_argnames=(3,))
    sharded = jaxmem.jit(_keyword_step, polymorphic_shapes=(None, "b, 4"),
                         in_shardings=(None, None))
    with pytest.raises(ValueError, match=r"keyword arguments \(lr\) cannot be passed"):
        sharded(MLP_PARAMS["w"], rows(3), lr=0.5)
