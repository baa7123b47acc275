"""Levels applied on concrete traces (``jaxmem.rewrite``): every level the planner derived
on the symbolic trace finds its residual groups and cuts again at concrete shapes."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest

import jaxmem
from bench.programs import concrete, gpt_program, gpt_scan_program
from jaxmem.graph import JaxmemWarning
from jaxmem.plan.analysis import analyze_specs
from jaxmem.rewrite import needs_rewrite, rewrite_level


def test_every_level_of_an_unnamed_gpt_applies_at_a_concrete_shape():
    # Plain JAX indexes ``qkv[:, :, 0]`` by a gather on the symbolic trace and by a slice
    # on the concrete one: the groups must still be found, with no warning.
    program = gpt_program(layers=2, d=32, heads=2, vocab=32, max_b=4, max_s=16)
    analysis = analyze_specs(program.step, (), program.concrete_args({"b": 4, "s": 16}), (),
                             (None, "b, s"), program.constraints, None, (0,), True)
    levels = analysis.plans.levels
    assert len(levels) >= 3 and any(lv.recompute for lv in levels), levels
    args = program.concrete_args({"b": 2, "s": 8})
    for k in range(len(levels)):
        if not needs_rewrite(analysis, k):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", JaxmemWarning)
            graph = rewrite_level(analysis, k, {"b": 2, "s": 8}, args).graph
        assert len(graph.nodes) > 0


def test_a_group_missing_on_the_concrete_trace_warns():
    program = gpt_program(layers=1, d=32, heads=2, vocab=32, max_b=4, max_s=16)
    analysis = analyze_specs(program.step, (), program.concrete_args({"b": 4, "s": 16}), (),
                             (None, "b, s"), program.constraints, None, (0,), True)
    k = next(k for k, lv in enumerate(analysis.plans.levels)
             if lv.recompute and lv.segments is None and lv.loops is None)
    level = analysis.plans.levels[k]
    bogus = dataclasses.replace(level, recompute=(*level.recompute, "nowhere:op"))
    levels = (*analysis.plans.levels[:k], bogus, *analysis.plans.levels[k + 1:])
    broken = dataclasses.replace(analysis, plans=dataclasses.replace(analysis.plans,
                                                                    levels=levels))
    with pytest.warns(JaxmemWarning, match="nowhere:op"):
        rewrite_level(broken, k, {"b": 2, "s": 8}, program.concrete_args({"b": 2, "s": 8}))


@pytest.mark.parametrize("b, k, kind", [(8, 2, "segments"), (7, 3, "segments"),
                                        (7, 3, "groups"), (7, 3, "loops")])  # 7: a remainder
def test_microbatches_run_the_level_inside_each_chunk(b, k, kind):
    sizes = {"layers": 2, "d": 32, "heads": 2, "vocab": 32, "max_b": 8, "max_s": 64}
    make = gpt_scan_program if kind == "loops" else gpt_program
    program = make(**sizes, value_and_grad=jaxmem.value_and_grad)
    f = jaxmem.jit(program.step, polymorphic_shapes=(None, "b, s"),
                   constraints=program.constraints)
    state = concrete(program.state, 0)
    tokens = jax.random.randint(jax.random.key(1), (b, 64), 0, 32)
    levels = f.plans(state, tokens).levels
    kinds = {"segments": lambda lv: lv.segments is not None and lv.loops is None,
             "groups": lambda lv: lv.segments is None and lv.loops is None,
             "loops": lambda lv: lv.loops is not None}
    of_kind = [i for i, lv in enumerate(levels) if lv.recompute and kinds[kind](lv)]
    lowest = min(of_kind, key=lambda i: levels[i].peak_fn({"b": b, "s": 64}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxmemWarning)  # every group and cut found in the chunks
        whole = f.compile_level(lowest, state, tokens)
        split = f.compile_level(lowest, state, tokens, microbatches=k)
        plain_split = f.compile_level(0, state, tokens, microbatches=k)
    # Each chunk recomputes as the level does: splitting lowers the level's own peak, and
    # the split level stays below the split step that saves everything.
    assert split.peak_bytes < whole.peak_bytes, (split.peak_bytes, whole.peak_bytes)
    assert split.peak_bytes < plain_split.peak_bytes, (split.peak_bytes, plain_split.peak_bytes)
    # The split trace's own model predicts the split, not the level's whole-batch figure.
    assert (abs(split.predicted_peak_bytes - split.peak_bytes)
            < abs(whole.predicted_peak_bytes - split.peak_bytes))
    got, want = split.compiled(state, tokens), jax.jit(make(**sizes).step)(state, tokens)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(y).all()  # a NaN step would compare equal to any other
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
