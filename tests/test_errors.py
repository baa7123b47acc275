"""Bad inputs: each case raises the documented error type, naming what was wrong.

One test per case. Every message must name the offending argument / dim /
value / bound, so that a user can fix the call without reading jaxmem.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jaxmem

W = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8), np.float32))


def grad_step(w: jax.Array, x: jax.Array) -> jax.Array:
    return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)


@pytest.fixture(scope="module")
def f() -> jaxmem.Jitted:
    return jaxmem.jit(grad_step, polymorphic_shapes=(None, "b, 8"),
                      constraints=("b <= 64", "b >= 2"))


def test_errors_are_jaxmem_errors():
    for e in (jaxmem.ShapeOutOfRangeError, jaxmem.BudgetInfeasibleError):
        assert issubclass(e, jaxmem.JaxmemError) and issubclass(e, ValueError)
    assert issubclass(jaxmem.ScheduleError, jaxmem.JaxmemError)


def test_rank_mismatch(f):
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"args\[1\] has rank 3.*\(b, 8\)"):
        f(W, jnp.ones((4, 8, 1)))


def test_dim_below_range(f):
    with pytest.raises(jaxmem.ShapeOutOfRangeError,
                       match=r"b=1 is below its lower bound 2 \(b is the size of "
                             r"args\[1\] axis 0\)"):
        f(W, jnp.ones((1, 8)))


def test_dim_above_range(f):
    with pytest.raises(jaxmem.ShapeOutOfRangeError,
                       match=r"b=65 is above its upper bound 64 \(b is the size of "
                             r"args\[1\] axis 0\)"):
        f(W, jnp.ones((65, 8)))


def test_fixed_dim_mismatch(f):
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"args\[1\] axis 1 is 9.*fixes it to 8"):
        f(W, jnp.ones((4, 9)))


def test_constraint_violated():
    g = jaxmem.jit(lambda x: (x * 2).sum(), polymorphic_shapes=("b, s",),
                   constraints=("b*s <= 4096",))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"b\*s <= 4096.*'b': 64, 's': 65"):
        g(jnp.ones((64, 65)))
    assert float(g(jnp.ones((64, 64)))) == 2 * 64 * 64


def test_inconsistent_dim_between_arguments():
    g = jaxmem.jit(lambda x, y: x + y, polymorphic_shapes=("b", "b"))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"dimension b is 3 .* 4 in args\[1\]"):
        g(jnp.ones(3), jnp.ones(4))


@pytest.mark.parametrize("spec,needle", [
    ("b, ,8", "b, ,8"),           # jax's parser rejects it
    ("b; 8", "polymorphic_shapes[1]"),  # not a dims string at all
    (5, "polymorphic_shapes[1]"),
])
def test_malformed_polymorphic_shapes(spec, needle):
    with pytest.raises(jaxmem.ShapeOutOfRangeError) as info:
        jaxmem.jit(grad_step, polymorphic_shapes=(None, spec))(W, jnp.ones((4, 8)))
    assert needle in str(info.value)


def test_polymorphic_shapes_of_wrong_rank():
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"args\[1\] has rank 2.*\(b, 8, c\)"):
        jaxmem.jit(grad_step, polymorphic_shapes=(None, "b, 8, c"))(W, jnp.ones((4, 8)))


def test_polymorphic_shapes_wrong_count():
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"1 entries .* 2 positional"):
        jaxmem.jit(grad_step, polymorphic_shapes=("b, 8",))(W, jnp.ones((4, 8)))


def test_malformed_constraint():
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"b <<= 3"):
        jaxmem.jit(grad_step, polymorphic_shapes=(None, "b, 8"),
                   constraints=("b <<= 3",))(W, jnp.ones((4, 8)))


@pytest.mark.parametrize("budget,kind", [(-1, ValueError), (0, ValueError), (1.5, TypeError),
                                         (True, TypeError), ("1GB", TypeError)])
def test_bad_budget(budget, kind):
    with pytest.raises(kind, match=repr(budget).replace(".", r"\.")):
        jaxmem.jit(grad_step, budget_bytes=budget)


def test_budget_below_state_is_infeasible():
    params = jnp.ones((64, 64))
    step = jaxmem.jit(grad_step, polymorphic_shapes=(None, "b, 64"), budget_bytes=params.nbytes)
    with pytest.raises(jaxmem.BudgetInfeasibleError) as info:
        step(params, jnp.ones((4, 64)))
    assert info.value.min_peak_bytes > params.nbytes
    assert f"budget_bytes={params.nbytes}" in str(info.value)


@pytest.mark.parametrize("leaf,name", [("abc", "str"), (object(), "object"), (None, None)])
def test_non_array_leaves(leaf, name):
    g = jaxmem.jit(lambda x, s: x * 2, polymorphic_shapes=("b", None))
    if leaf is None:  # None is an empty pytree, as for jax.jit
        assert g(jnp.ones(3), None).shape == (3,)
        return
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=rf"args\[1\]\['k'\] is a {name}"):
        g(jnp.ones(3), {"k": leaf})


def test_python_scalars_are_traced_like_jax_jit():
    g = jaxmem.jit(lambda x, y: x * y, polymorphic_shapes=("b", None))
    x = jnp.ones(3, jnp.bfloat16)
    assert g(x, 2.0).dtype == jax.jit(lambda x, y: x * y)(x, 2.0).dtype == jnp.bfloat16
    assert float(g(x, 3.0)[0]) == 3.0 and g.compiles == 1


def test_static_argnum_missing():
    g = jaxmem.jit(lambda x, n: x * n, polymorphic_shapes=("b", None), static_argnums=(1,))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"static_argnums=\(1,\).*argument 1"):
        g(jnp.ones(3))


def test_unhashable_static_argument():
    g = jaxmem.jit(lambda x, n: x * n[0], polymorphic_shapes=("b", None), static_argnums=(1,))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match="hashable.*list"):
        g(jnp.ones(3), [2])


def test_new_dtype_retraces_like_jax_jit():
    g = jaxmem.jit(lambda x: x * 2, polymorphic_shapes=("b",))
    assert g(jnp.ones(3)).dtype == jnp.float32
    assert g(jnp.ones(3, jnp.int32)).dtype == jnp.int32
    assert g.compiles == 2 and g.cache_info().analyses == 2


def test_pure_callback_warns_and_runs():
    def f(x: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        y = jax.pure_callback(lambda a: np.asarray(a) * 2, out, x)
        return (y + 1).sum()

    with pytest.warns(jaxmem.JaxmemWarning, match="pure_callback"):
        g = jaxmem.jit(f, polymorphic_shapes=("b",))
        out = g(jnp.ones(3))
    assert float(out) == 9.0
    assert g.plan_for(jnp.ones(3)).predicted_peak_bytes > 0


def _my_double() -> Primitive:
    p = Primitive("jaxmem_test_double")
    p.def_impl(lambda x: x * 2)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    return p


def test_unknown_primitive_warns_conservative_and_runs():
    p = _my_double()
    with pytest.warns(jaxmem.JaxmemWarning, match="unknown primitive 'jaxmem_test_double'"):
        g = jaxmem.jit(lambda x: p.bind(x).sum(), polymorphic_shapes=("b",))
        assert float(g(jnp.ones(5))) == 10.0


def test_data_dependent_while_loop_runs():
    def f(x: jax.Array) -> jax.Array:
        return lax.while_loop(lambda s: s.sum() < 100.0, lambda s: s * 2, x)

    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)
        g = jaxmem.jit(f, polymorphic_shapes=("b",))
        np.testing.assert_array_equal(g(jnp.ones(3)), jax.jit(f)(jnp.ones(3)))


def test_non_callable():
    with pytest.raises(TypeError, match="callable.*int"):
        jaxmem.jit(3)


def test_bad_scheduler():
    with pytest.raises(TypeError, match="Scheduler"):
        jaxmem.jit(grad_step, scheduler="fast")


def test_warnings_point_at_the_users_line() -> None:
    # A host callback jaxmem cannot model warns at the line that asked for the analysis,
    # not inside jaxmem (a filter by module, or -W error, then sees the user's file).
    def step(x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda v: None, x)
        return jnp.tanh(x).sum()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        jaxmem.analyze(step, jax.ShapeDtypeStruct((8, 4), jnp.float32))
    ours = [w for w in seen if issubclass(w.category, jaxmem.JaxmemWarning)]
    assert ours and all(w.filename == __file__ for w in ours), [w.filename for w in ours]
