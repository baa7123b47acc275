"""jaxmem.region labels parts of a model; plans and describe() use the labels."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem


def _step_with_regions():
    opt = optax.sgd(0.1)

    def loss(params, x):
        for i, w in enumerate(params):
            with jaxmem.region(f"layer_{i}/attention"):
                scores = jax.nn.softmax(jnp.einsum("bd,cd->bc", x @ w, x), axis=-1)
                x = x + scores @ x
        return jnp.mean(x ** 2)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = [jnp.eye(8) * 0.1 for _ in range(2)]
    return step, params, opt.init(params)


def test_region_names_reach_residual_groups_and_describe():
    step, params, opt_state = _step_with_regions()
    f = jaxmem.jit(step, polymorphic_shapes=(None, None, "b, 8"), constraints=("b <= 64",))
    x = jnp.linspace(-1.0, 1.0, 32 * 8).reshape(32, 8)
    plan = f.plan_for(params, opt_state, x)
    text = plan.describe()
    assert "layer_*/attention:" in text
    got, want = f(params, opt_state, x), jax.jit(step)(params, opt_state, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_region_works_as_decorator_and_is_reentrant():
    tag = jaxmem.region("block")

    @tag
    def f(x):
        with tag:
            return jnp.sin(x) * 2

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3))
    assert "block" in str(jaxpr.eqns[0].source_info.name_stack)
    assert repr(tag) == "jaxmem.region('block')"


@pytest.mark.parametrize("bad", ["", "3layers", "a b", None, 7])
def test_region_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="jaxmem.region name"):
        jaxmem.region(bad)
