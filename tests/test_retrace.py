"""Steps JAX cannot trace with their symbolic dims run per shape (``jaxmem.dispatch.retrace``).

Oracle: ``jax.jit`` of the same function for the outputs, and XLA's
``memory_analysis()`` of the executable each call ran for the budget.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import xla_peak_bytes

D = 16


def chunked_step(w: jax.Array, x: jax.Array) -> jax.Array:
    """Attention within chunks of 8 rows, the rows padded to a multiple of 8: jax.export
    cannot prove that ``s + (-s) % 8`` divides by 8."""
    def loss(w: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        padded = jnp.pad(x, ((0, 0), (0, (-s) % 8), (0, 0)))
        h = jnp.tanh(padded.reshape(b, -1, 8, D) @ w)
        scores = jax.nn.softmax(jnp.einsum("bncd,bned->bnce", h, h), -1)
        return jnp.tanh(scores @ h @ w).sum()

    return jax.grad(loss)(w)


def length_branch_step(w: jax.Array, x: jax.Array) -> jax.Array:
    """A Python branch on the sequence length, which no declared constraint settles."""
    def loss(w: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w)
        return (h @ w).sum() if x.shape[1] >= 12 else (h * h).sum()

    return jax.grad(loss)(w)


def python_dims_step(w: jax.Array, x: jax.Array) -> jax.Array:
    """Python arithmetic on a dim's value and ``jnp.split`` of the symbolic axis."""
    def loss(w: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w) / math.sqrt(x.shape[1])
        first, _ = jnp.split(h * np.arange(x.shape[1])[:, None], 2, axis=1)
        return (first @ w).sum()

    return jax.grad(loss)(w)


def args(b: int, s: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(b * 100 + s)
    w = jnp.asarray(rng.standard_normal((D, D), np.float32) * 0.3)
    return w, jnp.asarray(rng.standard_normal((b, s, D), np.float32))


@pytest.mark.parametrize("step", [chunked_step, length_branch_step, python_dims_step])
def test_an_untraceable_step_warns_once_and_runs_each_shape_as_jax_jit(step) -> None:
    f = jaxmem.jit(step, polymorphic_shapes=(None, "b, s, 16"),
                   constraints=("b <= 4", "s <= 40"))
    shapes = [(2, 14), (3, 8), (2, 14), (4, 40)]
    with pytest.warns(jaxmem.JaxmemWarning, match="cannot be traced with its symbolic dims") \
            as caught:
        for b, s in shapes:
            np.testing.assert_allclose(f(*args(b, s)), jax.jit(step)(*args(b, s)),
                                       rtol=1e-5, atol=1e-5)
    assert sum("symbolic dims" in str(w.message) for w in caught) == 1
    assert f.cache_info().analyses == 3  # one per distinct shape
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"s.*41.*40"):
        f(*args(2, 41))  # the declared range still holds


def test_an_untraceable_step_meets_a_budget_per_shape() -> None:
    a = args(4, 37)
    plain = xla_peak_bytes(jax.jit(chunked_step).lower(*a).compile())
    levels = jaxmem.jit(chunked_step, polymorphic_shapes=(None, "b, s, 16"),
                        constraints=("b <= 4", "s <= 40"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        smallest = min(levels.compile_level(k, *a).peak_bytes
                       for k in range(len(levels.plans(*a).levels)))
        assert smallest < plain  # the per-shape analysis plans levels, too
        f = levels.with_budget(smallest)
        out = f(*a)
    np.testing.assert_allclose(out, jax.jit(chunked_step)(*a), rtol=1e-5, atol=1e-5)
    assert f.plan_for(*a).peak_bytes <= smallest


def test_compile_plans_need_the_symbolic_analysis() -> None:
    f = jaxmem.jit(chunked_step, polymorphic_shapes=(None, "b, s, 16"),
                   constraints=("b <= 4", "s <= 40"), budget_bytes=10**7)
    w, _ = args(2, 8)
    calls = [(w, jax.ShapeDtypeStruct((2, n, D), jnp.float32)) for n in (8, 13, 20)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        with pytest.raises(jaxmem.JaxmemError, match="chunked_step cannot be traced"):
            f.plan_compiles(calls, pad_dims=("s",))


def test_without_polymorphic_shapes_each_shape_is_analysed_as_jax_jit_retraces() -> None:
    f = jaxmem.jit(chunked_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)  # nothing symbolic to fail
        for b, s in [(2, 13), (3, 8)]:
            np.testing.assert_allclose(f(*args(b, s)), jax.jit(chunked_step)(*args(b, s)),
                                       rtol=1e-5, atol=1e-5)
    assert f.cache_info().analyses == 2


def test_an_error_at_the_exact_shapes_too_is_the_steps_own_as_with_jax_jit() -> None:
    f = jaxmem.jit(python_dims_step, polymorphic_shapes=(None, "b, s, 16"),
                   constraints=("b <= 4", "s <= 40"))
    with pytest.raises(ValueError, match="equal division") as want:
        jax.jit(python_dims_step)(*args(2, 13))  # 13 rows do not split in two
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)  # not taken for a dims problem
        with pytest.raises(type(want.value), match="equal division") as got:
            f(*args(2, 13))
    assert got.value.__context__ is None  # not shown as raised while handling another
    assert f.cache_info().analyses == 0


def test_analyze_still_raises_the_symbolic_trace_error() -> None:
    b, s = jax.export.symbolic_shape("b, s", constraints=("s <= 40",))
    with pytest.raises(jaxmem.SymbolicTraceError, match="Add the constraint"):
        jaxmem.analyze(length_branch_step, jax.ShapeDtypeStruct((D, D), jnp.float32),
                       jax.ShapeDtypeStruct((b, s, D), jnp.float32))
