"""The bitset form of XLA's greedy placement (jaxmem/memory/placement.py)."""

from __future__ import annotations

import bisect

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.memory.placement import Occupancy, first_free, unwritten_sets

interval_st = st.tuples(st.integers(0, 40), st.integers(0, 40)).map(sorted)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(interval_st, st.integers(0, 9)), max_size=25),
       st.lists(interval_st, min_size=1, max_size=10), st.integers(1, 41))
def test_overlapping_is_every_allocation_with_an_occupant_meeting_the_interval(
        occupants, queries, n) -> None:
    occ = Occupancy(n)
    placed = [((lo % n, max(lo % n, hi % n)), a) for (lo, hi), a in occupants]
    for (lo, hi), a in placed:
        occ.add(lo, hi, 1 << a)
    for lo, hi in queries:
        lo, hi = lo % n, max(lo % n, hi % n)
        brute = 0
        for (s, t), a in placed:
            if s <= hi and lo <= t:
                brute |= 1 << a
        assert occ.overlapping(lo, hi) == brute


def test_first_free_takes_the_lowest_unwritten_unoccupied_bit_at_or_above_the_smallest() -> None:
    assert first_free(0b1111, 0b0101, 0) == 1
    assert first_free(0b1111, 0b0101, 2) == 3
    assert first_free(0b0101, 0b0101, 0) == -1


def test_unwritten_sets_hold_the_allocations_written_after_each_position() -> None:
    writes = [5, 2, 9, 2]
    thresholds, sets = unwritten_sets(writes)
    for t in range(-1, 11):
        expect = sum(1 << k for k, w in enumerate(writes) if w > t)
        assert sets[bisect.bisect_right(thresholds, t)] == expect
