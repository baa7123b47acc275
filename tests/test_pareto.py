"""The frontier keeps every level some budget somewhere would pick, and only those."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.plan.offload import costs_for
from jaxmem.plan.pareto import on_frontier

COSTS = costs_for("cpu")


@dataclasses.dataclass(frozen=True)
class FakeLevel:
    """Peak and FLOPs per point, given as tables."""

    peaks: tuple[int, ...]
    flops: tuple[int, ...]

    def peak_fn(self, p: dict[str, int]) -> int:
        return self.peaks[p["i"]]

    def step_s(self, p: dict[str, int], costs) -> float:
        return costs.recompute_s(self.flops[p["i"]])


def fastest_fitting(levels, p, budget):
    fits = [lv for lv in levels if lv.peak_fn(p) <= budget]
    return min((lv.step_s(p, COSTS) for lv in fits), default=None)


levels_and_points = st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.tuples(*[st.integers(1, 9)] * n),
                                   st.tuples(*[st.integers(1, 9)] * n)), min_size=1, max_size=7)))


@settings(max_examples=300, deadline=None)
@given(levels_and_points)
def test_every_budget_at_every_point_finds_a_plan_as_fast(case) -> None:
    n, rows = case
    levels = [FakeLevel(*r) for r in rows]
    points = [{"i": i} for i in range(n)]
    kept = on_frontier(levels, points, COSTS)
    assert kept[0] is levels[0] and all(lv in levels for lv in kept)
    for p in points:
        for budget in range(1, 11):
            assert fastest_fitting(kept, p, budget) == fastest_fitting(levels, p, budget)


def test_a_level_worse_everywhere_is_dropped() -> None:
    fast, small, worse = FakeLevel((9, 9), (1, 1)), FakeLevel((3, 5), (4, 4)), FakeLevel((4, 5),
                                                                                         (5, 4))
    points = [{"i": 0}, {"i": 1}]
    assert on_frontier([fast, small, worse], points, COSTS) == (fast, small)
    # better at one point is enough to stay
    assert on_frontier([fast, small, FakeLevel((2, 6), (5, 5))], points, COSTS)[-1].peaks == (2, 6)
