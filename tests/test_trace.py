"""Tracing with symbolic dims (``jaxmem.trace``).

Covers: symbols in order of appearance, constraints read from the
``symbolic_shape`` scope, pytrees of specs, concrete arrays and scalars as
specs, rejection of non-array arguments, and the ``SymbolicError`` message for
comparisons the constraints leave open.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import ShapeOutOfRangeError, SymbolicError
from jaxmem.trace import symbols_of, trace


def test_symbols_and_constraints_are_read_from_the_specs() -> None:
    s, b = jax.export.symbolic_shape("s, b", constraints=("b <= 16", "s <= 512", "b*s <= 4096"))
    t = trace(lambda x, y: x.sum() + y.sum(), jax.ShapeDtypeStruct((b, s), jnp.float32),
              jax.ShapeDtypeStruct((s,), jnp.float32))
    assert t.symbols == ("b", "s")  # order of first appearance in the arguments
    assert set(t.constraints) == {"b <= 16", "s <= 512", "b*s <= 4096"}
    assert len(t.in_avals) == 2
    assert t.closed_jaxpr.jaxpr.invars[0].aval.shape == (b, s)


def test_pytrees_arrays_and_scalars() -> None:
    (b,) = jax.export.symbolic_shape("b")
    params = {"w": np.zeros((4, 3), np.float32), "bias": jnp.zeros((3,))}
    t = trace(lambda p, x, lr: (x @ p["w"] + p["bias"]).sum() * lr,
              params, jax.ShapeDtypeStruct((b, 4), jnp.float32), 0.5)
    assert t.symbols == ("b",)
    assert [a.shape for a in t.in_avals] == [(3,), (4, 3), (b, 4), ()]
    assert jax.tree_util.tree_structure(t.out_tree) is not None


def test_static_shapes_have_no_symbols() -> None:
    t = trace(lambda x: x * 2, jax.ShapeDtypeStruct((3, 4), jnp.float32))
    assert t.symbols == () and t.constraints == ()
    assert symbols_of([jax.ShapeDtypeStruct((2,), jnp.int32)]) == ((), ())


def test_non_array_arguments_are_rejected() -> None:
    with pytest.raises(ShapeOutOfRangeError, match="static_argnums"):
        trace(lambda f, x: x, "not an array", jax.ShapeDtypeStruct((2,), jnp.float32))


def test_inconclusive_comparison_becomes_symbolic_error() -> None:
    b, s = jax.export.symbolic_shape("b, s", constraints=("s <= 512",))

    def f(x):
        return x.sum() if x.shape[0] > x.shape[1] else x.mean()

    with pytest.raises(SymbolicError) as info:
        trace(f, jax.ShapeDtypeStruct((b, s), jnp.float32))
    msg = str(info.value)
    assert "'b' > 's'" in msg and 'Add the constraint "b > s"' in msg


def test_an_op_jax_cannot_trace_symbolically_names_the_dim() -> None:
    b, t = jax.export.symbolic_shape("b, t", constraints=("t <= 1024",))
    with pytest.raises(SymbolicError, match=r"symbolic dim\(s\) t: associative scan") as info:
        trace(lambda x: jax.lax.associative_scan(jnp.add, x, axis=1),
              jax.ShapeDtypeStruct((b, t), jnp.float32))
    assert "polymorphic_shapes" in str(info.value)


def test_other_errors_pass_through() -> None:
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(TypeError):
        trace(lambda x, y: x + y, jax.ShapeDtypeStruct((b, 3), jnp.float32),
              jax.ShapeDtypeStruct((b, 4), jnp.float32))
