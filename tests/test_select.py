"""Level selection (``jaxmem.plan.select``) as a pure function, with a scripted "XLA".

Levels are faked by their predicted peaks; ``compile`` returns scripted XLA peaks and
counts its calls, so each property is checked against the rule it states, not
against a second copy of the search.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from hypothesis import given, settings

import jaxmem
from jaxmem.plan.select import HOPELESS_FACTOR, select_level


@dataclasses.dataclass(frozen=True)
class FakeLevel:
    peak: int

    def peak_fn(self, dims: dict[str, int]) -> int:
        return self.peak * dims.get("b", 1)


@dataclasses.dataclass(frozen=True)
class FakePlans:
    levels: tuple[FakeLevel, ...]

    def order_at(self, dims: dict[str, int]) -> list[int]:
        return list(range(len(self.levels)))


def scripted(real: list[int]) -> tuple[list[tuple[int, int]], object]:
    calls: list[tuple[int, int]] = []

    def compile(k: int, microbatches: int) -> int:
        calls.append((k, microbatches))
        return real[k] // microbatches

    return calls, compile


peaks = st.lists(st.integers(1, 1000), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(peaks, st.data())
def test_chosen_level_fits_by_xla_and_is_compiled_once(predicted, data):
    real = data.draw(st.lists(st.integers(1, 1000), min_size=len(predicted),
                              max_size=len(predicted)))
    budget = data.draw(st.integers(1, 1000))
    calls, compile = scripted(real)
    s = select_level(FakePlans(tuple(map(FakeLevel, predicted))), {}, budget, compile)
    assert len(calls) == len(set(calls))
    if s.level is not None:
        assert real[s.level] <= budget and calls[-1] == (s.level, 1)
        assert s.why and f"level {s.level}" in s.why
    else:
        assert all(real[k] > budget for k, _ in calls)
        assert "no level fits" in s.why
    compiled = [a for a in s.attempts if a.peak_bytes is not None]
    assert [(a.level, 1) for a in compiled] == calls
    for i, a in enumerate(compiled[1:], 1):  # compiled only while within reach
        reach = max(budget, min(c.peak_bytes for c in compiled[:i])) * HOPELESS_FACTOR
        assert a.predicted_peak_bytes <= reach
    smallest = min(real[k] for k, _ in calls) if calls else 0
    if s.level is None and calls:  # the error names the smallest plan within reach
        assert s.smallest.peak_bytes == smallest
        assert all(p > smallest * HOPELESS_FACTOR for k, p in enumerate(predicted)
                   if (k, 1) not in calls)


@settings(max_examples=200, deadline=None)
@given(peaks, st.integers(1, 1000))
def test_exact_predictions_pick_the_fastest_fitting_level_with_one_compile(predicted, budget):
    calls, compile = scripted(predicted)
    s = select_level(FakePlans(tuple(map(FakeLevel, predicted))), {}, budget, compile)
    fitting = [k for k, p in enumerate(predicted) if p <= budget]
    assert s.level == (fitting[0] if fitting else None)
    if fitting:
        assert calls == [(fitting[0], 1)]


@settings(max_examples=200, deadline=None)
@given(peaks, st.integers(1, 1000), st.integers(1, 4))
def test_predictions_only_agrees_with_choose_and_never_compiles(predicted, budget, b):
    plans = FakePlans(tuple(map(FakeLevel, predicted)))
    s = select_level(plans, {"b": b}, budget)
    fitting = [k for k, p in enumerate(predicted) if p * b <= budget]
    assert s.level == (fitting[0] if fitting else None)
    assert all(a.peak_bytes is None for a in s.attempts)


def test_guard_passes_over_a_level_xla_fits_and_the_search_comes_back_down():
    calls, compile = scripted([900, 400, 800, 700])
    s = select_level(FakePlans(tuple(map(FakeLevel, [900, 600, 450, 450]))), {}, 500, compile)
    assert s.level == 1 and calls == [(2, 1), (3, 1), (1, 1)]
    assert "the guard had passed over" in s.why


def test_xla_over_the_prediction_moves_the_search_up():
    calls, compile = scripted([900, 600, 450])
    s = select_level(FakePlans(tuple(map(FakeLevel, [900, 480, 450]))), {}, 500, compile)
    assert s.level == 2 and calls == [(1, 1), (2, 1)]
    assert "XLA measured it over the budget" in s.why


def test_after_a_miss_levels_predicted_to_fit_are_compiled_before_those_predicted_over():
    calls, compile = scripted([520, 540, 560, 420])
    s = select_level(FakePlans(tuple(map(FakeLevel, [480, 560, 590, 400]))), {}, 500, compile)
    assert s.level == 3 and calls == [(0, 1), (3, 1)]  # 1 and 2 are predicted over 500


def test_the_slack_xla_showed_makes_a_level_predicted_a_little_over_likely():
    # 0 and 4 miss; 1 (within reach) is over-predicted by 7 %, so 3 (530, 6 % over)
    # is likelier than 2 (620) and is compiled next.
    calls, compile = scripted([510, 560, 600, 495, 505])
    s = select_level(FakePlans(tuple(map(FakeLevel, [480, 600, 620, 530, 450]))), {}, 500,
                     compile)
    assert s.level == 3 and calls == [(0, 1), (4, 1), (1, 1), (3, 1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(300, 700), min_size=2, max_size=8), st.data())
def test_under_predictions_compile_every_level_predicted_to_fit_before_any_other(predicted,
                                                                                 data):
    """Where XLA never comes in under a prediction there is no slack: once a level was
    compiled, a level predicted over the budget is compiled only after every level
    predicted to fit."""
    real = [p + data.draw(st.integers(0, 200)) for p in predicted]
    budget = 500
    calls, compile = scripted(real)
    select_level(FakePlans(tuple(map(FakeLevel, predicted))), {}, budget, compile)
    over = [i for i, (k, _) in enumerate(calls) if predicted[k] > budget]
    if over and over[0] > 0:
        assert all((k, 1) in calls[:over[0]] for k, p in enumerate(predicted) if p <= budget)


def test_hopeless_levels_are_not_compiled_once_one_was():
    calls, compile = scripted([900, 900])
    s = select_level(FakePlans((FakeLevel(400), FakeLevel(int(500 * HOPELESS_FACTOR) + 1))),
                     {}, 500, compile)
    assert s.level is None and calls == [(0, 1), (1, 1)]  # 626 is within reach of 900
    calls, compile = scripted([500 * 2, 900])
    s = select_level(FakePlans((FakeLevel(400), FakeLevel(2000))), {}, 500, compile)
    assert s.level is None and calls == [(0, 1)]
    assert s.attempts[-1].outcome == "skipped: predicted far above the budget"


def test_skip_excludes_a_level_and_no_budget_runs_level_zero():
    calls, compile = scripted([100, 100])
    s = select_level(FakePlans((FakeLevel(100), FakeLevel(90))), {}, 500, compile,
                     skip=frozenset({0}))
    assert s.level == 1 and (0, 1) not in calls
    assert select_level(FakePlans((FakeLevel(10**9),)), {}, None).level == 0


def test_microbatch_hook_splits_the_smallest_plan_when_nothing_fits():
    calls, compile = scripted([1000, 800])
    s = select_level(FakePlans((FakeLevel(1000), FakeLevel(800))), {}, 300, compile,
                     microbatches=lambda fits: next(k for k in (1, 2, 4, 8) if fits(k)))
    assert (s.level, s.microbatches) == (1, 4) and calls[-1] == (1, 4)
    assert "4 microbatches" in s.why


def test_a_real_plan_records_the_selection_that_chose_it():
    f = jaxmem.jit(lambda x: jax.grad(lambda x: jnp.tanh(jnp.tanh(x)).sum())(x),
                   polymorphic_shapes=("b, 8",), constraints=("b <= 64",),
                   budget_bytes=1 << 20)
    plan = f.plan_for(jnp.ones((4, 8)))
    assert plan.selection is not None and plan.selection.level == plan.level
    assert plan.guard == plan.selection.why and plan.guard in plan.describe()


@dataclasses.dataclass(frozen=True)
class RankedPlans:
    levels: tuple[FakeLevel, ...]
    rank: tuple[int, ...]

    def order_at(self, dims: dict[str, int]) -> list[int]:
        return list(self.rank)


@settings(max_examples=200, deadline=None)
@given(peaks, st.data())
def test_exact_predictions_choose_the_fastest_fitting_level(predicted, data):
    """With the levels ranked fastest first at the shape, and predictions XLA agrees with,
    the choice is the first fitting level of the ranking, compiled once and alone."""
    rank = tuple(data.draw(st.permutations(range(len(predicted)))))
    budget = data.draw(st.integers(1, 1000))
    calls, compile = scripted(predicted)
    s = select_level(RankedPlans(tuple(map(FakeLevel, predicted)), rank), {}, budget, compile)
    fitting = [k for k in rank if predicted[k] <= budget]
    if fitting:
        assert s.level == fitting[0] and calls == [(fitting[0], 1)]
    else:
        assert s.level is None
