"""The time–memory frontier of a plan set: only levels some budget somewhere would pick.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory import memory_model
    >>> from jaxmem.plan.offload import costs_for
    >>> from jaxmem.symbolic import ShapeDomain
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.tanh(x))(jnp.ones(8)))
    >>> level = Level((), (), g, memory_model(g, ShapeDomain.from_constraints((), ())))
    >>> len(on_frontier([level, level], [{}], costs_for("cpu")))
    1
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from jaxmem.plan.level import Level
from jaxmem.plan.offload import Costs


def on_frontier(levels: Sequence[Level], points: Sequence[Mapping[str, int]], costs: Costs,
                tally: collections.Counter[str] | None = None) -> tuple[Level, ...]:
    """The levels that are the fastest fitting plan for some budget at some point.

    A level is dropped when at every point another level is no larger and no slower
    (and better in one): no budget anywhere would pick it. Level 0 always stays.

    Args:
        levels: candidate levels, level 0 (save everything) first.
        points: the shapes to look at (the domain's sample points).
        costs: device rates for the levels' predicted step seconds.
        tally: decision counts; each level looked at is one decision by sampling.

    Returns:
        The kept levels, in their order.
    """
    figures = [[(lv.peak_fn(p), lv.step_s(p, costs)) for lv in levels] for p in points]

    def useful(k: int) -> bool:
        return any(not any(m != k and a <= at[k][0] and t <= at[k][1]
                           and (a, t, m) < (at[k][0], at[k][1], k)
                           for m, (a, t) in enumerate(at))
                   for at in figures)

    if tally is not None:
        tally["fallback"] += len(levels) - 1
    return tuple(lv for k, lv in enumerate(levels) if k == 0 or useful(k))
