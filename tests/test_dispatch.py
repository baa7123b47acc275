"""Dispatch: dims bound from argument shapes, checked, and made per-device under sharding.

The sharded case runs in a subprocess with 4 forced host devices (XLA_FLAGS must be
set before JAX starts). Its oracle is ``jax.jit`` with the same shardings, and
XLA's per-device ``memory_analysis()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmem
from jaxmem.dispatch.bind import bind_dims
from jaxmem.plan.analysis import analyze_specs, local_dims, merge_args


def analysis(fn, dynamic, shapes, constraints=()):
    return analyze_specs(fn, (), dynamic, (), shapes, constraints, None, (), True)


def test_merge_args_reinterleaves_static_and_dynamic():
    assert merge_args((1, 3), ("s1", "s3"), ("d0", "d2")) == ["d0", "s1", "d2", "s3"]
    assert merge_args((), (), (1, 2)) == [1, 2]


def test_bind_dims_reads_plain_and_derived_dims():
    a = analysis(lambda x, y: x.sum() + y.sum(), (jnp.ones((3, 4)), jnp.ones(6)),
                 ("b, s", "2*b"), ("b <= 8",))
    assert bind_dims(a, (jnp.ones((5, 7)), jnp.ones(10))) == {"b": 5, "s": 7}
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"args\[1\] axis 0 is 11.*2\*b"):
        bind_dims(a, (jnp.ones((5, 7)), jnp.ones(11)))


def test_bind_dims_wrong_leaf_count():
    a = analysis(lambda x: x * 2, (jnp.ones(3),), ("b",))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match="expected 1 array leaves, got 2"):
        bind_dims(a, ((jnp.ones(3), jnp.ones(3)),))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 70), min_size=0, max_size=4))
def test_any_shape_binds_or_raises_shape_error(shape):
    """No internal exception (KeyError, IndexError, ...) escapes for any argument shape."""
    a = _ANALYSIS
    x = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    try:
        dims = bind_dims(a, (x, jax.ShapeDtypeStruct((4,), jnp.float32)))
    except jaxmem.ShapeOutOfRangeError as e:
        assert "args[0]" in str(e) or "dimension" in str(e) or "constraint" in str(e)
    else:
        assert dims == {"b": shape[0], "s": shape[1]} and len(shape) == 3 and shape[2] == 4


_ANALYSIS = analysis(lambda x, y: (x * y).sum(), (jnp.ones((2, 3, 4)), jnp.ones(4)),
                     ("b, s, 4", None), ("b <= 64", "s <= 64", "b*s <= 2048"))


def test_local_dims_divides_a_sharded_batch():
    a = analysis(lambda x: x * 2, (jnp.ones((8, 3)),), ("b, 3",))

    class Half:  # a stand-in with jax.sharding.Sharding's shard_shape
        def shard_shape(self, shape):
            return (shape[0] // 2, *shape[1:])

    assert local_dims(a, {"b": 8}, [Half()]) == {"b": 4}
    assert local_dims(a, {"b": 8}, [None]) == {"b": 8}
    assert local_dims(a, {"b": 8}, []) == {"b": 8}


SHARDED = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxmem
    from jaxmem.lower import xla_peak_bytes

    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    D, H = 16, 128
    OPT = optax.sgd(1e-2)

    def loss(p, x):
        with jax.named_scope("layer_0"):
            h = x + jax.nn.silu(x @ p["a"]) @ p["b"]
        return jnp.mean(h ** 2)

    def step(state, x):
        params, opt_state = state
        l, g = jax.value_and_grad(loss)(params, x)
        u, opt_state = OPT.update(g, opt_state, params)
        return (optax.apply_updates(params, u), opt_state), l

    rng = np.random.default_rng(0)
    p = {"a": rng.standard_normal((D, H), np.float32) * 0.1,
         "b": rng.standard_normal((H, D), np.float32) * 0.1}
    state = jax.device_put((p, OPT.init(p)), rep)
    ref = jax.jit(step, in_shardings=(rep, rows), out_shardings=(rep, rep))
    out = {"cases": []}
    for b, budget in ((64, None), (256, None), (256, "tight")):
        x = jax.device_put(rng.standard_normal((b, D), np.float32), rows)
        want = ref(state, x)
        plain = xla_peak_bytes(ref.lower(state, x).compile())
        if budget == "tight":
            budget = plain - 1
        f = jaxmem.jit(step, polymorphic_shapes=(None, "b, 16"), constraints=("b <= 1024",),
                       in_shardings=(rep, rows), out_shardings=(rep, rep), budget_bytes=budget)
        got = f(state, x)
        plan = f.plan_for(state, x)
        close = all(bool(jnp.allclose(g, w, atol=1e-5, rtol=1e-5)) for g, w in
                    zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
        out["cases"].append(dict(
            b=b, budget=budget, close=close, plain=plain, peak=plan.peak_bytes,
            oracle=xla_peak_bytes(plan.compiled), predicted=plan.predicted_peak_bytes,
            level=plan.level, loss_sharding=list(got[1].sharding.spec),
            x_sharding=list(plan.compiled.input_shardings[0][1].spec)))
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                          env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_sharded_results_equal_jax_jit(sharded):
    for case in sharded["cases"]:
        assert case["close"], case
        assert case["x_sharding"] == ["d"], case
        assert case["loss_sharding"] == [], case


def test_sharded_figures_are_per_device(sharded):
    for case in sharded["cases"]:
        print(f"\nper device, b={case['b']}: predicted {case['predicted']} B, "
              f"XLA {case['peak']} B, plain jax.jit {case['plain']} B, level {case['level']}")
        assert case["peak"] == case["oracle"]
        if case["budget"] is None:
            assert abs(case["peak"] - case["plain"]) <= 0.05 * case["plain"]
        # Per-device prediction: the same order as XLA's per-device peak, not 4x it.
        assert 0.5 <= case["predicted"] / case["peak"] <= 2.0


def test_sharded_budget_is_per_device(sharded):
    tight = next(c for c in sharded["cases"] if c["budget"] is not None)
    assert tight["plain"] > tight["budget"] >= tight["peak"] and tight["level"] > 0
