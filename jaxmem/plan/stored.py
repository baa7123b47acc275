"""A plan set as JSON data, and back onto the graph of a fresh trace: the disk store's payload.

Deriving the levels (memory models, the greedy search, segment plans) is the
expensive part of an analysis; tracing and building the graph are cheap and are
redone on load anyway. So an entry holds the *decisions* and the *results* of the
search, never a graph: which residuals each level recomputes or offloads
(identified by value id in the graph, which is deterministic for a given trace),
its segment plan, its memory model (expressions in an
:class:`~jaxmem.exprjson.ExprTable`), the scheduler's orders and the comparison
counts. :func:`decode_plans` rebuilds each level's graph with the planner's own
rewrite (:func:`~jaxmem.plan.remat.apply_remat`) and checks the entry against the
fresh graph; anything that does not fit raises :class:`StaleEntryError`.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.plan.analysis import analyze_specs
    >>> step = lambda w, x: jax.grad(lambda w: jnp.tanh(jnp.tanh(x @ w) @ w).sum())(w)
    >>> a = analyze_specs(step, (), (jnp.ones((8, 8)), jnp.ones((4, 8))), (), (None, "b, 8"),
    ...                   ("b <= 64",), None, (), True)
    >>> data = encode_plans(a.plans, a.orders, a.graph)
    >>> decode_plans(data, a.graph, a.domain) == (a.plans, a.orders)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import sympy

from jaxmem.errors import ScheduleError
from jaxmem.exprjson import ExprTable, UnencodableError, decode_table
from jaxmem.graph import Graph
from jaxmem.memory import Buffer, MemoryModel
from jaxmem.plan.analysis import Orders
from jaxmem.plan.bodies import (
    BodyLevel,
    apply_body_plan,
    body_scans,
    decode_body_plan,
    encode_body_plan,
)
from jaxmem.plan.levels import Level, PlanSet
from jaxmem.plan.loops import LoopPlan, with_loop_plan
from jaxmem.plan.offload import Costs
from jaxmem.plan.remat import apply_remat
from jaxmem.plan.residuals import Residual, find_residuals
from jaxmem.plan.scan_pairs import find_scan_pairs
from jaxmem.plan.segments import (
    decode_segment_plan,
    encode_segment_plan,
    find_segments,
    segment_residuals,
)
from jaxmem.schedulers import validate_order
from jaxmem.symbolic import ShapeDomain


class StaleEntryError(ValueError):
    """A stored plan set does not fit the graph it is loaded onto (or is malformed)."""


def encode_plans(plans: PlanSet, orders: Orders, graph: Graph) -> dict[str, Any]:
    """``plans`` and ``orders`` (derived from ``graph``) as JSON-ready data.

    Raises:
        UnencodableError: an expression the table cannot store faithfully.
    """
    table = ExprTable()
    data = {"graph": _size(graph),
            "groups": [[name, [r.value for r in rs]] for name, rs in plans.groups],
            "levels": [_encode_level(level, table) for level in plans.levels],
            "comparisons": [[k, v] for k, v in plans.comparisons],
            "costs": list(dataclasses.astuple(plans.costs)),
            "orders": [None if o is None else list(o) for o in orders],
            "exprs": table.rows}
    try:
        decode_table(table.rows)  # an entry that would not load is not worth writing
    except ValueError as e:
        raise UnencodableError(str(e)) from e
    return data


def _size(graph: Graph) -> list[int]:
    return [len(graph.nodes), len(graph.values)]


def _encode_level(level: Level, t: ExprTable) -> dict[str, Any]:
    seg = level.segments
    m = level.memory
    return {
        "recompute": list(level.recompute), "offload": list(level.offload),
        "residuals": [[r.value, r.first_use] for r in level.residuals],
        "offloaded": [[r.value, r.first_use] for r in level.offloaded],
        "flops": t.add(level.recompute_flops), "graph": _size(level.graph),
        "segments": None if seg is None else encode_segment_plan(seg),
        "loops": None if level.loops is None else [
            [list(d) for d in level.loops.drop], level.loops.saved_primitive,
            level.loops.label, None if level.loops.saved_ordinals is None
            else [list(o) for o in level.loops.saved_ordinals]],
        "bodies": encode_body_plan(level.bodies) if isinstance(level, BodyLevel) else None,
        "memory": {
            "buffers": [[b.value, t.add(b.nbytes), b.start, b.end, b.kind, b.note]
                        for b in m.buffers],
            "terms": [t.add(e) for e in (m.argument_bytes, m.output_bytes, m.alias_bytes,
                                         m.temp_bytes, m.peak_bytes)],
            "points": [[[t.add(mono), t.add(c)] for mono, c in p] for p in m.points],
            "candidates": list(m.candidates),
            "comparisons": [[k, v] for k, v in m.comparisons],
            "upper": None if m.temp_bytes_without_reuse is None
            else t.add(m.temp_bytes_without_reuse),
            "reuse": bool(m.reuse_outputs)}}


def decode_plans(data: dict[str, Any], graph: Graph, domain: ShapeDomain
                 ) -> tuple[PlanSet, Orders]:
    """The plan set and orders of :func:`encode_plans`' ``data`` on ``graph`` (a fresh trace's).

    Raises:
        StaleEntryError: the data is malformed or does not fit ``graph``.
    """
    try:
        return _decode(data, graph, domain)
    except StaleEntryError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, ScheduleError) as e:
        raise StaleEntryError(f"malformed plan entry: {type(e).__name__}: {e}") from e


def _decode(data: dict[str, Any], graph: Graph, domain: ShapeDomain) -> tuple[PlanSet, Orders]:
    if data["graph"] != _size(graph):
        raise StaleEntryError(f"entry is for a graph of {data['graph']} nodes/values, this "
                              f"trace's has {_size(graph)}")
    exprs = decode_table(data["exprs"])
    residuals = find_residuals(graph)
    by_value = {r.value: r for r in residuals}

    def pick(pairs: Sequence[Sequence[int]]) -> tuple[Residual, ...]:
        out = []
        for value, first_use in pairs:
            if value not in by_value:
                raise StaleEntryError(f"value {value} is not a residual of this trace")
            r = by_value[value]
            out.append(r if r.first_use == first_use else
                       dataclasses.replace(r, first_use=int(first_use)))
        return tuple(out)

    groups = tuple((str(name), pick([[v, by_value[v].first_use if v in by_value else -1]
                                     for v in values]))
                   for name, values in data["groups"])
    levels = tuple(_decode_level(d, graph, residuals, pick, exprs) for d in data["levels"])
    orders = tuple(validate_order(level.graph, order)
                   for level, order in zip(levels, data["orders"], strict=True))
    comparisons = tuple((str(k), int(v)) for k, v in data["comparisons"])
    costs = Costs(*(float(x) for x in data["costs"]))
    return PlanSet(domain, groups, levels, comparisons, costs), orders


def _decode_level(d: dict[str, Any], graph: Graph, residuals: tuple[Residual, ...],
                  pick: Callable[[Sequence[Sequence[int]]], tuple[Residual, ...]],
                  exprs: list[sympy.Basic]) -> Level:
    if d.get("loops") is not None:  # residual ids are the loop-rewritten graph's
        return _decode_loop_level(d, graph, exprs)
    if d.get("bodies") is not None:
        return _decode_body_level(d, graph, exprs)
    chosen, moved = pick(d["residuals"]), pick(d["offloaded"])
    seg = d["segments"]
    segments = None if seg is None else decode_segment_plan(seg)
    if segments is None:
        g2 = apply_remat(graph, chosen, moved, residuals)
    else:
        # As the planner did: the plan's cuts on this graph, the residuals it re-runs.
        rebuilt, keep = segment_residuals(graph, find_segments(graph), segments, residuals)
        g2 = apply_remat(graph, rebuilt, (), residuals, keep, True)
    if _size(g2) != d["graph"]:
        raise StaleEntryError(f"level graph rebuilt with {_size(g2)} nodes/values, the entry "
                              f"says {d['graph']}")
    return Level(tuple(d["recompute"]), chosen, g2, _decode_memory(d["memory"], exprs),
                 exprs[d["flops"]], tuple(d["offload"]), moved, segments)


def _decode_loop_level(d: dict[str, Any], graph: Graph, exprs: list[sympy.Basic]) -> Level:
    drop, save, label, ordinals = d["loops"]
    plan = LoopPlan(tuple(tuple(int(i) for i in x) for x in drop), str(save), str(label),
                    None if ordinals is None else tuple(tuple(int(i) for i in o)
                                                        for o in ordinals))
    if not plan.fits(find_scan_pairs(graph)):
        raise StaleEntryError("entry's loop plan does not fit this trace's scan loops")
    recompute = tuple(d["recompute"])
    g2, chosen, moved = with_loop_plan(graph, plan, recompute[:-1], tuple(d["offload"]))
    if _size(g2) != d["graph"]:
        raise StaleEntryError(f"loop level rebuilt with {_size(g2)} nodes/values, the entry "
                              f"says {d['graph']}")
    return Level(recompute, chosen, g2, _decode_memory(d["memory"], exprs), exprs[d["flops"]],
                 tuple(d["offload"]), moved, loops=plan)


def _decode_body_level(d: dict[str, Any], graph: Graph, exprs: list[sympy.Basic]) -> Level:
    plan = decode_body_plan(d["bodies"])
    if len(body_scans(graph)) != len(plan.rules):
        raise StaleEntryError("entry's scan-body plan does not fit this trace's scans")
    g2 = apply_body_plan(graph, plan)
    if _size(g2) != d["graph"]:
        raise StaleEntryError(f"body level rebuilt with {_size(g2)} nodes/values, the entry "
                              f"says {d['graph']}")
    return BodyLevel(tuple(d["recompute"]), (), g2, _decode_memory(d["memory"], exprs),
                     exprs[d["flops"]], bodies=plan)


def _decode_memory(d: dict[str, Any], exprs: list[sympy.Basic]) -> MemoryModel:
    buffers = tuple(Buffer(int(v), exprs[e], int(s), int(end), str(kind), str(note))
                    for v, e, s, end, kind, note in d["buffers"])
    args, outs, alias, temp, peak = (exprs[i] for i in d["terms"])
    points = tuple(tuple((exprs[m], exprs[c]) for m, c in p) for p in d["points"])
    upper = None if d["upper"] is None else exprs[d["upper"]]
    return MemoryModel(buffers, args, outs, alias, temp, peak, points,
                       tuple(int(c) for c in d["candidates"]),
                       tuple((str(k), int(v)) for k, v in d["comparisons"]), upper,
                       bool(d["reuse"]))
