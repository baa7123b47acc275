"""Levels applied on concrete traces (``jaxmem.rewrite``): every level the planner derived
on the symbolic trace finds its residual groups and cuts again at concrete shapes."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from bench.programs import gpt_program
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
