"""Segments (``jaxmem.plan.segments``): cuts found from the dataflow alone, and plans that
re-run whole layers, against the one-line per-layer ``jax.checkpoint`` a user would write.

The program is plain JAX with a Python loop over layers and no named scopes
(``bench.programs.gpt_program``). XLA's ``argument + output - alias + temp`` is the
oracle for every peak; the hand-written reference is compiled here, never assumed.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmem
from bench.programs import gpt_program
from jaxmem.dims import sym
from jaxmem.graph import build_graph
from jaxmem.lower import compiler_options
from jaxmem.plan.segments import SegmentPlan, Segments, find_segments, segment_candidates

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


def segments(signatures: tuple[str, ...]) -> Segments:
    """Cuts ``0..n-1`` with these signatures, one FLOP before each."""
    n = len(signatures)
    return Segments(tuple(range(n)), tuple(range(n)), (), tuple(map(float, range(n))),
                    float(n), signatures)


def test_kept_cuts_align_across_traces_of_a_differently_traced_tail():
    """A kept cut maps onto the other trace's cuts by signature, a stretch traced
    differently (one gather here, a slice and a squeeze there) onto its last cut."""
    sym_cuts = ("add/3/float32",) * 3 + ("gather/2/float32", "reduce_sum/0/float32")
    concrete = ("add/3/float32",) * 3 + ("slice/3/float32", "squeeze/2/float32",
                                         "reduce_sum/0/float32")
    every = SegmentPlan(len(sym_cuts) + 1).resolved(segments(sym_cuts))
    assert every.kept_on(segments(sym_cuts)) == every.kept
    assert every.kept_on(segments(concrete)) == (0, 1, 2, 4, 5)
    assert every.kept_on(segments(concrete[:3])) == (0, 1, 2)  # the tail's cuts are gone
    assert every.kept_on(segments(("dot_general/2/float32",))) is None  # nothing shared
    assert dataclasses.replace(every, signatures=()).kept_on(segments(concrete)) is None


def test_a_segment_level_applies_where_the_traces_differ_in_the_loss():
    """``x[0, :-1]`` is a gather over a symbolic length and a slice and a squeeze over a
    concrete one: the concrete trace has one cut more. Every segment level must still
    be applied there (before: none was, a warning said so, and XLA's peak stayed level
    0's while the prediction was the segment plan's)."""
    def step(ws, x):
        def loss(ws):
            h = x
            for up, down in ws:
                u = jnp.tanh(h @ up)
                h = h + jnp.tanh(u * jnp.exp(u)) @ down
            return (h[0, :-1] ** 2).sum()
        return jax.grad(loss)(ws)

    rng = np.random.default_rng(0)
    ws = [tuple(jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)
                for s in ((32, 128), (128, 32))) for _ in range(4)]
    x = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.float32)
    f = jaxmem.jit(step, polymorphic_shapes=(None, "b, s, _"),
                   constraints=("b <= 8", "s <= 64", "s >= 2"))
    levels = f.plans(ws, x).levels
    segment = [k for k, lv in enumerate(levels) if lv.segments is not None]
    assert segment, [lv.recompute for lv in levels]
    base = f.compile_level(0, ws, x).peak_bytes
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "jaxmem: .* is not applied", jaxmem.JaxmemWarning)
        for k in segment:
            plan = f.compile_level(k, ws, x)
            assert plan.peak_bytes < base, (k, levels[k].segments, plan.peak_bytes, base)
    want = jax.jit(step)(ws, x)
    for a, b in zip(jax.tree.leaves(plan.run(ws, x)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


@settings(max_examples=200, deadline=None)
@given(sigs=st.lists(st.sampled_from(["add/3/float32", "dot_general/3/float32",
                                      "gather/2/float32", "exp/4/float32"]), min_size=1,
                     max_size=12),
       edits=st.lists(st.tuples(st.integers(0, 11), st.sampled_from(["drop", "split"])),
                      max_size=3),
       count=st.integers(2, 13))
def test_kept_cuts_map_to_valid_cuts_in_forward_order(sigs, edits, count):
    """Whatever the other trace's cuts, the kept ones map to distinct cuts of it, in order;
    an unedited trace keeps exactly the plan's cuts."""
    plan = SegmentPlan(count).resolved(segments(tuple(sigs)))
    assert plan.kept_on(segments(tuple(sigs))) == plan.kept
    other = list(sigs)
    for at, how in edits:
        if at < len(other):
            other[at:at + 1] = [] if how == "drop" else ["slice/3/float32", other[at]]
    kept = plan.kept_on(segments(tuple(other)))
    if kept is not None:
        assert list(kept) == sorted(set(kept)) and all(0 <= k < len(other) for k in kept)
        assert len(kept) <= len(plan.kept)
