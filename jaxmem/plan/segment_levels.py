"""Segment levels: the segment plans of :mod:`jaxmem.plan.segments` made into levels.

Two kinds: plans that re-run everything but the kept cuts (one per cut, or
fewer, longer segments) and, at one segment per cut, plans that also keep the
roles a knapsack over re-run FLOPs and bytes picks (:mod:`jaxmem.plan.knapsack`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.plan.residuals import find_residuals
    >>> from jaxmem.symbolic import ShapeDomain, sym
    >>> def loss(ws, x):
    ...     for w in ws:
    ...         x = x + jnp.tanh(x @ w)
    ...     return (x ** 2).sum()
    >>> b, = jax.export.symbolic_shape("b", constraints=("b <= 64",))
    >>> g = build_graph(jax.make_jaxpr(jax.grad(loss))(
    ...     [jnp.ones((8, 8))] * 4, jax.ShapeDtypeStruct((b, 8), jnp.float32)))
    >>> dom = ShapeDomain.from_constraints(("b",), ("b <= 64",))
    >>> levels, _ = segment_levels(g, dom, find_residuals(g), {sym("b"): 64})
    >>> levels[0].segments.name
    'segments/6'
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import sympy

from jaxmem.errors import warn
from jaxmem.fastexpr import sum_at
from jaxmem.graph import Graph
from jaxmem.memory import memory_model
from jaxmem.plan.knapsack import frontier, spread
from jaxmem.plan.level import Level
from jaxmem.plan.remat import apply_remat, recompute_chains
from jaxmem.plan.residuals import Residual
from jaxmem.plan.segments import (
    SegmentPlan,
    Segments,
    find_segments,
    segment_candidates,
    segment_residuals,
)
from jaxmem.symbolic import ShapeDomain

#: How many sets of kept roles along the knapsack's frontier get a memory model each.
ROLE_PLANS = 3
#: Sets within this fraction of another's bytes and FLOPs count as one.
ROLE_TOLERANCE = 0.01


def segment_levels(graph: Graph, dom: ShapeDomain, residuals: Sequence[Residual],
                   corner: Mapping[Any, int], donated: tuple[int, ...] = (),
                   symbolic: bool = True) -> tuple[list[Level], list[Level]]:
    """The segment levels of ``graph``: those that re-run everything, and those keeping roles.

    Args:
        graph: a differentiated graph.
        dom: its shape domain.
        residuals: :func:`~jaxmem.plan.residuals.find_residuals` of ``graph``.
        corner: where FLOPs and bytes are weighed (sympy symbol -> value).
        donated: donated input indices (for the memory model's aliasing).
        symbolic: False for the fallback-only ablation.

    Returns:
        ``(plain, keeping)``: levels re-running whole segments, and the one-segment-per-cut
        levels that also keep roles picked along the knapsack's frontier.
    """
    segs = find_segments(graph, corner)
    if len(segs.cuts) < 2:
        return [], []
    plans = [p.resolved(segs) for p in segment_candidates(len(segs.cuts))]
    finest = SegmentPlan(len(segs.cuts) + 1).resolved(segs)
    keeping = [dataclasses.replace(finest, save=save)
               for save in role_sets(graph, segs, finest, residuals, corner)]
    made = [_level(graph, dom, segs, p, residuals, donated, symbolic) for p in plans + keeping]
    return ([lv for lv in made[:len(plans)] if lv is not None],
            [lv for lv in made[len(plans):] if lv is not None])


def role_sets(graph: Graph, segs: Segments, plan: SegmentPlan, residuals: Sequence[Residual],
              corner: Mapping[Any, int], count: int = ROLE_PLANS) -> list[frozenset[str]]:
    """Up to ``count`` sets of roles worth keeping inside ``plan``'s segments.

    A role's bytes are its residuals' at ``corner``; the re-run FLOPs it spares are
    those of the operations no other re-run value needs once it is kept (a matmul
    output spares its matmul, unless the matmul feeds another recomputed value).
    """
    chosen, keep = segment_residuals(graph, segs, plan, residuals)
    roles: dict[str, list[Residual]] = collections.defaultdict(list)
    for r in chosen:
        roles[r.group].append(r)
    names = sorted(roles)
    # Every layer repeats the same FLOP expressions: each is evaluated once.
    at: dict[sympy.Expr, float] = {}
    flops = {}
    for n in graph.nodes:
        if not n.is_backward and n.flops != 0:
            if n.flops not in at:
                at[n.flops] = float(sum_at([n.flops], corner))
            flops[n.index] = at[n.flops]
    stays = set(keep) | set(graph.inputs) | {r.value for r in residuals} - {
        r.value for r in chosen}

    def rerun_flops(kept: list[Residual]) -> float:
        values = {r.value for r in kept}
        targets = [v for r in chosen if r.value not in values for v in (r.value, *r.aliases)]
        return sum(flops.get(i, 0.0) for i in _upstream(graph, targets, stays | values))

    everything = rerun_flops([])
    items = [(float(sum_at([r.nbytes for r in roles[n]], corner)),
              everything - rerun_flops(roles[n])) for n in names]
    front = frontier(items, ROLE_TOLERANCE)
    return [frozenset(names[k] for k in s) for _, _, s in spread(front, count)]


def _upstream(graph: Graph, targets: Sequence[int], leaves: set[int]) -> set[int]:
    """The nodes that make ``targets`` from ``leaves``: one walk back for all of them."""
    producers, nodes = graph.producers, graph.nodes
    need: set[int] = set()
    wanted, stack = set(targets), list(targets)
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = producers.get(v)
        if p is None or (v in leaves and v not in wanted) or nodes[p].is_backward:
            continue
        need.add(p)
        stack.extend(nodes[p].inputs)
    return need


def _level(graph: Graph, dom: ShapeDomain, segs: Segments, plan: SegmentPlan,
           residuals: Sequence[Residual], donated: tuple[int, ...], symbolic: bool
           ) -> Level | None:
    """``plan`` as a level, with its memory model; None when it recomputes nothing."""
    chosen, keep = segment_residuals(graph, segs, plan, residuals)
    chains = recompute_chains(graph, chosen, residuals, keep, True)
    if not chains:
        return None
    g2 = apply_remat(graph, chosen, (), residuals, keep, True, chains)
    # With output reuse, as XLA places temporaries (:mod:`jaxmem.memory.assign`): on the
    # plain-JAX GPT and linen 4x256 at (4, 256) the segment levels come within +2..+8 %
    # of XLA (+17 % for one keeping three roles), where without it they were +10..+34 %.
    m = memory_model(g2, dom, donated=donated, symbolic=symbolic)
    nodes = {i for _, c in chains for i in c}
    flops = sympy.Add(*[graph.nodes[i].flops for i in nodes])
    names = tuple(dict.fromkeys(r.group for r, _ in chains))
    return Level(names, tuple(r for r, _ in chains), g2, m, flops, segments=plan)


def apply_segment_plan(graph: Graph, plan: SegmentPlan, batch: Sequence[int],
                       residuals: Sequence[Residual], where: str) -> Graph:
    """``graph`` (another trace of the planned step, or of a scan body) with segment plan
    ``plan`` applied: its kept cuts found again from ``batch`` (:meth:`SegmentPlan.kept_on`);
    unchanged, with a warning that names ``where``, when the two traces share no cut."""
    segs = find_segments(graph, batch=batch)
    kept = plan.kept_on(segs)
    if kept is None:
        warn(f"jaxmem: {where} has {len(segs.cuts)} forward cuts where the symbolic "
                      f"one has {plan.n_cuts}, and none of them align; {plan.name} "
                      "is not applied at this shape")
        return graph
    chosen, keep = segment_residuals(graph, segs, dataclasses.replace(plan, kept=kept),
                                     residuals)
    return apply_remat(graph, chosen, (), tuple(residuals), keep, long_chains=True)
