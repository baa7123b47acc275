"""Segments (``jaxmem.plan.segments``): cuts found from the dataflow alone, and plans that
re-run whole layers, against the one-line per-layer ``jax.checkpoint`` a user would write.

The program is plain JAX with a Python loop over layers and no named scopes
(``bench.programs.gpt_program``). XLA's ``argument + output - alias + temp`` is the
oracle for every peak; the hand-written reference is compiled here, never assumed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from bench.programs import gpt_program
from jaxmem.dims import sym
from jaxmem.graph import build_graph
from jaxmem.lower import compiler_options
from jaxmem.plan.segments import SegmentPlan, find_segments, segment_candidates

LAYERS, B, S = 3, 2, 64
CONFIG = dict(layers=LAYERS, d=64, heads=2, vocab=64, max_b=B, max_s=S)


@pytest.fixture(scope="module")
def program():
    return gpt_program(**CONFIG)


@pytest.fixture(scope="module")
def args(program):
    rng = np.random.default_rng(0)
    state = jax.tree_util.tree_map(
        lambda t: jnp.asarray(rng.standard_normal(t.shape).astype(t.dtype) * 0.02), program.state)
    tokens = jnp.asarray(rng.integers(0, CONFIG["vocab"], (B, S)), jnp.int32)
    return state, tokens


@pytest.fixture(scope="module")
def checkpointed_peak(args) -> int:
    """XLA's peak of the same step with per-layer ``jax.checkpoint(nothing_saveable)``."""
    hand = gpt_program(**CONFIG, remat_policy=jax.checkpoint_policies.nothing_saveable)
    compiled = jax.jit(hand.step).lower(*args).compile(compiler_options=compiler_options())
    return jaxmem.xla_peak_bytes(compiled)


def test_cuts_are_found_without_names_one_residual_stream_per_layer(program):
    graph = build_graph(jax.make_jaxpr(program.step)(*program.symbolic_args()))
    segs = find_segments(graph, {sym("b"): B, sym("s"): S})
    streams = [v for v in segs.cuts if str(graph.values[v].shape) == f"(b, s, {CONFIG['d']})"
               and graph.nodes[graph.producers[v]].primitive == "add"]
    assert len(streams) >= LAYERS, segs
    assert SegmentPlan(len(segs.cuts) + 1).resolved(segs).kept == tuple(range(len(segs.cuts)))
    assert len(SegmentPlan(2).resolved(segs).kept) == 1 and SegmentPlan(1).resolved(segs).kept == ()


def test_segment_candidates_run_from_finest_to_sqrt_n():
    plans = segment_candidates(24)
    counts = [p.count for p in plans if not p.save]
    assert counts == sorted(counts, reverse=True) and counts[0] == 25 and min(counts) == 5
    assert any(p.save == frozenset({"dot_general"}) for p in plans)


def test_lowest_level_matches_per_layer_checkpoint_and_computes_the_same(program, args,
                                                                        checkpointed_peak):
    f = jaxmem.jit(program.step, polymorphic_shapes=(None, "b, s"),
                   constraints=program.constraints)
    plans = f.plans(*args)
    assert any(level.segments is not None for level in plans.levels)
    k = len(plans.levels) - 1
    plan = f.compile_level(k, *args)
    print(f"\nlowest level {k} ({plans.levels[k].segments}): XLA {plan.peak_bytes} B, "
          f"predicted {plan.predicted_peak_bytes} B; per-layer checkpoint {checkpointed_peak} B")
    assert plan.peak_bytes <= checkpointed_peak  # at least as small as the hand policy
    want = jax.jit(program.step)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(plan.run(*args)), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_a_budget_the_hand_policy_meets_is_met(program, args, checkpointed_peak):
    budget = int(1.1 * checkpointed_peak)
    f = jaxmem.jit(program.step, polymorphic_shapes=(None, "b, s"),
                   constraints=program.constraints, budget_bytes=budget)
    plan = f.plan_for(*args)
    print(f"\nbudget {budget} B: level {plan.level}, XLA {plan.peak_bytes} B; {plan.guard}")
    assert plan.peak_bytes <= budget
