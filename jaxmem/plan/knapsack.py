"""What to keep inside re-run segments: a 0/1 knapsack over residual roles.

A segment plan re-runs each segment's forward pass before its backward pass.
Keeping some of a segment's values saves their share of the re-run (a matmul
output spares its matmul) and costs their bytes. Which roles (``Residual.group``:
the same value of every layer) to keep is a 0/1 knapsack: for every number of
bytes kept, the set of roles that spares the most re-run FLOPs. Each role's
bytes and FLOPs are summed over its layers at the domain's largest shape; with
a few dozen roles, the exact frontier of all subsets (every set not beaten in
both bytes and FLOPs by another) is small, and a dynamic programme over the
roles builds it exactly — unlike ranking by FLOPs per byte, which misses the sets
that fill a budget better. The planner then picks a few sets spread along it and
scores each with the real memory model (the bytes it frees are not additive:
only what is live at the peak counts).

Example:
    >>> [(b, sorted(s)) for b, _, s in frontier([(2.0, 8.0), (3.0, 3.0), (1.0, 1.0)])]
    [(0.0, []), (1.0, [2]), (2.0, [0]), (3.0, [0, 2]), (5.0, [0, 1]), (6.0, [0, 1, 2])]
"""

from __future__ import annotations

from collections.abc import Sequence

Choice = tuple[float, float, frozenset[int]]  # bytes kept, FLOPs spared, items


def frontier(items: Sequence[tuple[float, float]], tolerance: float = 0.0) -> list[Choice]:
    """The subsets of ``items`` that no other subset beats in both bytes and FLOPs.

    Args:
        items: ``(bytes, flops)`` of each item: what keeping it costs and spares.
        tolerance: a set within this fraction of another's bytes and FLOPs counts
            as equal (the frontier then stays short on many items); 0 is exact.

    Returns:
        ``(bytes, flops, items)`` from fewest bytes to most, FLOPs rising strictly.
    """
    front: list[Choice] = [(0.0, 0.0, frozenset())]
    for k, (nbytes, flops) in enumerate(items):
        if flops <= 0.0:
            continue  # keeping it spares nothing
        grown = [(b + nbytes, f + flops, s | {k}) for b, f, s in front]
        front = _pareto(front + grown, tolerance)
    return front


def _pareto(choices: list[Choice], tolerance: float) -> list[Choice]:
    """The choices with no other of fewer (or as few) bytes and more (or as many) FLOPs."""
    out: list[Choice] = []
    for b, f, s in sorted(choices, key=lambda c: (c[0], -c[1], sorted(c[2]))):
        if out and f <= out[-1][1] * (1.0 + tolerance):
            continue
        if out and tolerance and b <= out[-1][0] * (1.0 + tolerance):
            out[-1] = (b, f, s)  # about as large, and it spares more
            continue
        out.append((b, f, s))
    return out


def spread(front: Sequence[Choice], count: int) -> list[Choice]:
    """``count`` choices from ``front`` at about evenly spaced bytes, ends excluded.

    The ends are "keep nothing" and "keep everything worth keeping", which the
    planner already has as plans of their own.

    Example:
        >>> front = [(float(b), float(b), frozenset({b})) for b in range(11)]
        >>> [b for b, _, _ in spread(front, 3)]
        [2.0, 5.0, 7.0]
    """
    inner = list(front[1:-1])
    if len(inner) <= count:
        return inner
    top = front[-1][0]
    picked: list[Choice] = []
    for j in range(1, count + 1):
        target = top * j / (count + 1)
        best = min(inner, key=lambda c: abs(c[0] - target))
        if best not in picked:
            picked.append(best)
    return sorted(picked, key=lambda c: c[0])
