"""Unrolled scans written out as JAX lowers them (``jaxmem.unroll``).

The written-out jaxpr must compute what the scan computes (a hypothesis property over
lengths, unroll factors, directions and a call around the scan), keep no unrolled
scan, and give the memory model the program XLA compiles: a decoder whose layers run
under ``lax.scan(..., unroll=u)`` is predicted within the model's bound of XLA's peak
(computed here), and its loop levels take effect (the rewrite re-traces the same way).
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.extend import core as jcore

import jaxmem
from jaxmem.unroll import has_unrolled, write_out_unrolled


def _scan_fn(length: int, unroll: int | bool, reverse: bool, jitted: bool):
    def f(c0, xs, w):
        def body(c, x):
            h = jnp.tanh(c * x + w)
            return h, (h * 2.0, x.sum())
        return jax.lax.scan(body, c0, xs, length=length, unroll=unroll, reverse=reverse)
    return jax.jit(f) if jitted else f


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.one_of(st.integers(0, 7), st.booleans()), st.booleans(),
       st.booleans())
def test_written_out_scan_computes_what_the_scan_computes(length, unroll, reverse, jitted):
    f = _scan_fn(length, unroll, reverse, jitted)
    rng = np.random.default_rng(length)
    args = (jnp.asarray(rng.normal(size=3), jnp.float32),
            jnp.asarray(rng.normal(size=(length, 3)), jnp.float32), jnp.float32(0.5))
    closed = jax.make_jaxpr(f)(*args)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    out = write_out_unrolled(closed, specs)
    assert not has_unrolled(out.jaxpr)
    want = jax.tree.leaves(f(*args))
    got = jcore.jaxpr_as_fun(out)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def test_a_rolled_scan_is_left_as_traced():
    f = _scan_fn(4, 1, False, False)
    args = (jnp.ones(3), jnp.ones((4, 3)), jnp.float32(0.5))
    closed = jax.make_jaxpr(f)(*args)
    assert write_out_unrolled(closed, args) is closed


D, V, LAYERS = 32, 64, 4


def _block(x, p):
    q, k, v = jnp.split(x @ p["wqkv"], 3, -1)
    o = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 8.0, -1) @ v
    x = x + o @ p["wo"]
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def _decoder_step(unroll: int | bool):
    def loss(p, t):
        x = p["emb"][t]
        x, _ = jax.lax.scan(lambda c, lp: (_block(c, lp), None), x, p["layers"],
                            unroll=unroll)
        logp = jax.nn.log_softmax(x @ p["emb"].T)
        return -jnp.take_along_axis(logp, t[:, :, None], -1).mean()

    def step(p, t):
        value, g = jax.value_and_grad(loss)(p, t)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), value

    shapes = {"wqkv": (D, 3 * D), "wo": (D, D), "w1": (D, 4 * D), "w2": (4 * D, D)}
    keys = iter(jax.random.split(jax.random.key(0), 8))
    layers = {n: 0.1 * jax.random.normal(next(keys), (LAYERS, *s)) for n, s in shapes.items()}
    params = {"emb": 0.1 * jax.random.normal(next(keys), (V, D)), "layers": layers}
    tokens = jax.random.randint(next(keys), (8, 64), 0, V)
    return step, params, tokens


@pytest.mark.parametrize("unroll", [2, True])
def test_unrolled_decoder_is_predicted_as_xla_compiles_it_and_its_levels_match_jit(unroll):
    step, params, tokens = _decoder_step(unroll)
    f = jaxmem.jit(step, polymorphic_shapes=(None, "b, s"), constraints=("b <= 8", "s <= 64"))
    want = jax.jit(step)(params, tokens)
    plans = f.plans(params, tokens)
    peaks = []
    for k in range(len(plans.levels)):
        level = f.compile_level(k, params, tokens)
        peaks.append(level.peak_bytes)
        if k == 0:  # level 0 is the user's own function: the model must follow XLA there
            assert abs(level.predicted_peak_bytes / level.peak_bytes - 1) < 0.05
        got = level.compiled(params, tokens)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
    if unroll == 2:  # the loop levels rebuild stacked residuals, so XLA sees them lower
        assert len(peaks) > 1 and min(peaks[1:]) < 0.8 * peaks[0]
