"""Scan-body levels (``jaxmem.plan.bodies``): gradient accumulation under ``lax.scan``, whose
body runs the whole forward and backward pass, gets levels that recompute inside the body.

XLA's ``argument + output - alias + temp`` is the oracle for every peak and
``jax.jit`` for every output.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from programs import deepest_level_lowers_and_matches

import jaxmem
from bench.unseen_programs import accumulation_step
from jaxmem.graph import JaxmemWarning, build_graph
from jaxmem.plan.bodies import BodyLevel, BodyPlan, apply_body_plan, body_scans
from jaxmem.plan.stored import decode_plans, encode_plans

LAYERS, D, HEADS, VOCAB, B, S, MICRO = 2, 32, 2, 64, 4, 32, 4
CONSTRAINTS = (f"b <= {B}", f"s <= {S}")
POLY = (None, f"{MICRO}, b, s")
#: Predicted peaks of the body levels against XLA's. At these small shapes the memory
#: model misses by as much on the step without the scan (the same loss planned as a plain
#: step at (4, 32): -15 % to +22 % over its levels); the body levels measured -6 %..+15 %
#: (session 11: heads split off a projection die at their copies; +25 % before).
TOLERANCE = 0.25
OPT = optax.sgd(0.1)


def _norm(x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def _attention(x: jax.Array, p: dict) -> jax.Array:
    b, s, _ = x.shape
    q, k, v = ((x @ p[n]).reshape(b, s, HEADS, D // HEADS) for n in "qkv")
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v).reshape(b, s, D) @ p["o"]


def _loss(p: dict, tokens: jax.Array) -> jax.Array:
    """A pre-norm decoder (plain JAX, Python loop over layers) and its next-token loss."""
    x = p["emb"][tokens]
    for lp in p["layers"]:
        x = x + _attention(_norm(x), lp)
        x = x + jax.nn.gelu(_norm(x) @ lp["w1"]) @ lp["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ p["emb"].T, jnp.roll(tokens, -1, 1)).mean()


#: Gradient accumulation: a scan over microbatches whose body runs the whole forward and
#: backward pass.
_step = accumulation_step(_loss, OPT)


def _args(b: int = B, s: int = S) -> tuple:
    rng = np.random.default_rng(0)

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32)

    p = {"emb": w(VOCAB, D), "layers": [
        {"q": w(D, D), "k": w(D, D), "v": w(D, D), "o": w(D, D), "w1": w(D, 4 * D),
         "w2": w(4 * D, D)} for _ in range(LAYERS)]}
    tokens = jnp.asarray(rng.integers(0, VOCAB, (MICRO, b, s)), jnp.int32)
    return (p, OPT.init(p)), tokens


@pytest.fixture(scope="module")
def planned():
    return jaxmem.jit(_step, polymorphic_shapes=POLY, constraints=CONSTRAINTS)


def _check_levels(planned, pick) -> None:
    """The body levels ``pick`` chooses run as jax.jit does, below level 0's XLA peak,
    predicted within TOLERANCE."""
    args = _args()
    plans = planned.plans(*args)
    body = [k for k, lv in enumerate(plans.levels) if isinstance(lv, BodyLevel)]
    assert body, plans.describe()  # the planner without body levels has one level
    want = jax.jit(_step)(*args)
    base = planned.compile_level(0, *args)
    for k in pick(body):
        lv = planned.compile_level(k, *args)
        got = lv.compiled(*args)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
        assert lv.peak_bytes < base.peak_bytes, (k, lv.peak_bytes, base.peak_bytes)
        assert abs(lv.predicted_peak_bytes / lv.peak_bytes - 1) <= TOLERANCE, (
            k, lv.predicted_peak_bytes, lv.peak_bytes)


def test_body_levels_recompute_inside_the_scan(planned):
    """The body level of the largest peak and that of the smallest (each compile takes
    seconds: every level is the slow test's)."""
    _check_levels(planned, lambda body: (body[0], body[-1]))


@pytest.mark.slow
def test_every_body_level(planned):
    _check_levels(planned, lambda body: body)


@pytest.mark.slow
def test_a_lower_budget_fits(planned):
    """A budget below level 0's XLA peak picks a body level, which fits it."""
    args = _args()
    levels = planned.plans(*args).levels
    level0 = planned.compile_level(0, *args).peak_bytes
    budget = (level0 + planned.compile_level(len(levels) - 1, *args).peak_bytes) // 2
    plan = planned.with_budget(budget).plan_for(*args)
    assert plan.peak_bytes <= budget < level0
    assert isinstance(levels[plan.level], BodyLevel)


@pytest.mark.slow
def test_body_levels_apply_at_another_shape(planned):
    """The plan made on the symbolic trace applies by rule on a smaller concrete trace."""
    args = _args(2, 16)
    want = jax.jit(_step)(*args)
    k = len(planned.plans(*args).levels) - 1
    assert isinstance(planned.plans(*args).levels[k], BodyLevel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxmemWarning)  # the rules apply: nothing to warn
        got = planned.compile_level(k, *args).compiled(*args)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_stored_round_trip(planned):
    a = planned.analysis(*_args())
    data = json.loads(json.dumps(encode_plans(a.plans, a.orders, a.graph)))
    assert decode_plans(data, a.graph, a.domain) == (a.plans, a.orders)


def test_a_plan_for_other_scans_warns_and_leaves_the_graph():
    g = build_graph(jax.make_jaxpr(_step)(*_args(2, 4)))
    assert len(body_scans(g)) == 1
    with pytest.warns(JaxmemWarning, match="scan bodies"):
        assert apply_body_plan(g, BodyPlan((None, None))) is g


def _scanned_loss(p: dict, x: jax.Array) -> jax.Array:
    """A residual MLP whose layers run under ``lax.scan`` over stacked weights."""
    def layer(h: jax.Array, w: tuple) -> tuple[jax.Array, None]:
        n = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
        return h + jnp.tanh(n @ w[0]) @ w[1], None

    return (jax.lax.scan(layer, x, (p["w1"], p["w2"]))[0] ** 2).mean()


_scanned_step = accumulation_step(_scanned_loss, OPT)


def test_loop_plans_inside_the_body():
    """A body that scans over layers gets the loop plans of its own scan pair
    (:mod:`jaxmem.plan.loops`) inside the accumulation scan: each runs as jax.jit does,
    below level 0's XLA peak, and survives the disk store. Predictions are not checked:
    the model misses a scan inside a scan by about the same bytes at every level
    (a 64-wide twin at (16, 64): level 0 -26 %, the body levels -41..-58 %)."""
    rng = np.random.default_rng(0)
    p = {"w1": jnp.asarray(rng.standard_normal((3, D, 4 * D)) * 0.1, jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((3, 4 * D, D)) * 0.1, jnp.float32)}
    args = ((p, OPT.init(p)), jnp.asarray(rng.standard_normal((MICRO, 8, 32, D)), jnp.float32))
    planned = jaxmem.jit(_scanned_step, polymorphic_shapes=(None, f"{MICRO}, b, s, {D}"),
                         constraints=("b <= 8", "s <= 32"))
    a = planned.analysis(*args)
    loops = [k for k, lv in enumerate(a.plans.levels) if isinstance(lv, BodyLevel)
             and any(r is not None and r.loops is not None for r in lv.bodies.rules)]
    assert loops, a.plans.describe()
    data = json.loads(json.dumps(encode_plans(a.plans, a.orders, a.graph)))
    assert decode_plans(data, a.graph, a.domain) == (a.plans, a.orders)
    want = jax.jit(_scanned_step)(*args)
    base = planned.compile_level(0, *args).peak_bytes
    for k in loops:
        lv = planned.compile_level(k, *args)
        for x, y in zip(jax.tree.leaves(lv.compiled(*args)), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
        assert lv.peak_bytes < base, (k, lv.peak_bytes, base)


def _checkpointed_scan(policy: object) -> tuple[jaxmem.Jitted, tuple[object, ...]]:
    """A 2-layer scanned GPT whose body runs under ``jax.checkpoint(policy=policy)``
    (None: no checkpoint) under ``jaxmem.jit``, and its arguments at (4, 64)."""
    from bench.programs import concrete, gpt_scan_program

    p = gpt_scan_program(2, 32, 2, VOCAB, 4, 64, remat_policy=policy)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 64)), jnp.int32)
    f = jaxmem.jit(p.step, polymorphic_shapes=(None, "b, s"), constraints=p.constraints)
    return f, (concrete(p.state, 0), tokens)


def test_levels_plan_inside_a_checkpointed_scans_backward_loop():
    """The user's ``jax.checkpoint`` on a scanned layer: the backward loop re-runs the layer
    and hands its values to the layer's backward pass, so they are that body's residuals.
    The deepest level recomputes them later still: below the user's own peak (XLA's
    figures), computing ``jax.jit``'s step."""
    f, args = _checkpointed_scan(jax.checkpoint_policies.nothing_saveable)
    graph = f.analysis(*args).graph
    (scan,) = body_scans(graph)
    assert graph.nodes[scan].is_backward
    assert any(isinstance(lv, BodyLevel) for lv in f.plans(*args).levels)
    deepest_level_lowers_and_matches(f, args, f.fun)


def test_a_backward_loop_without_a_checkpoint_is_no_body_of_its_own():
    f, args = _checkpointed_scan(None)
    assert body_scans(f.analysis(*args).graph) == ()
