"""Recomputation inside a loop body that runs a whole forward and backward pass.

Gradient accumulation is a ``lax.scan`` over microbatches whose body computes
``jax.value_and_grad(loss)(params, microbatch)`` and adds the gradients to its carry.
Every residual of the loss then lives inside that body: the step's own graph has
none, and no forward scan stacks them for a backward one (:mod:`jaxmem.plan.loops`).
So the body's graph is planned as a train step of its own
(:func:`~jaxmem.plan.levels.plan_levels`: greedy groups, segment plans) and each of
its levels becomes a level of the step whose scan runs the rewritten body, traced
anew with ``jax.make_jaxpr``. The step's memory model prices a scan by its body's
model, so the step's peak follows the body's.

A :class:`BodyPlan` names what each body recomputes by rule (residual group names, a
segment plan and the body's batch inputs, or, for a body that scans over layers, the
loop plan of its own scan pairs), never by value id, so that the plan derived on the
symbolic trace applies to every concrete trace of the step.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> def step(w, xs):
    ...     loss = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w).sum()
    ...     body = lambda g, x: (g + jax.grad(loss)(w, x), None)
    ...     return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((8, 8)), jnp.ones((4, 2, 8))))
    >>> len(body_scans(g))
    1
    >>> plan = BodyPlan((BodyRule(("<top>:tanh",)),))
    >>> scan = lambda g: [n for n in g.nodes if n.primitive == "scan"][0]
    >>> len(scan(apply_body_plan(g, plan)).subgraphs[0].nodes) > len(scan(g).subgraphs[0].nodes)
    True
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import sympy

from jaxmem.errors import warn
from jaxmem.graph import Graph, Node, bind_eqn, build_graph, replaced
from jaxmem.graph.build import dim_of
from jaxmem.graph.types import RERUN_SCOPE, reruns
from jaxmem.memory import memory_model
from jaxmem.plan.level import Level
from jaxmem.plan.levels import PlanSet, plan_levels
from jaxmem.plan.loops import LoopPlan, with_loop_plan
from jaxmem.plan.offload import Costs
from jaxmem.plan.pareto import on_frontier
from jaxmem.plan.remat import apply_remat
from jaxmem.plan.residuals import clean_scope, find_residuals, is_forward
from jaxmem.plan.segment_levels import apply_segment_plan
from jaxmem.plan.segments import SegmentPlan, batch_inputs, decode_segment_plan, encode_segment_plan
from jaxmem.symbolic import ShapeDomain, sym

#: A body level must lower the step's peak by this share somewhere to be kept.
BODY_MARGIN = 0.01


@dataclasses.dataclass(frozen=True)
class BodyRule:
    """What one body recomputes, as its own plan set's level said, by rule.

    Attributes:
        recompute: the body's residual groups recomputed (for a segment plan: for people).
        segments: the body's segment plan, or None.
        batch: with ``segments``, the body inputs that are its batch on the symbolic trace.
        loops: the body's loop plan (scans over layers inside the body), applied before
            ``recompute``; or None.
    """

    recompute: tuple[str, ...]
    segments: SegmentPlan | None = None
    batch: tuple[int, ...] = ()
    loops: LoopPlan | None = None

    @property
    def name(self) -> str:
        if self.segments is not None:
            return f"re-run {self.segments.name}"
        groups = f"{len(self.recompute)} residual group(s)" if self.recompute else ""
        return ", ".join(p for p in (groups, self.loops and self.loops.name) if p)


@dataclasses.dataclass(frozen=True)
class BodyPlan:
    """What the body of each scan of :func:`body_scans` recomputes.

    Attributes:
        rules: per scan of :func:`body_scans` (by position), its rule or None (the body
            runs as it is).
    """

    rules: tuple[BodyRule | None, ...]

    @property
    def name(self) -> str:
        parts = [f"inside scan body {k}: {rule.name}"
                 for k, rule in enumerate(self.rules) if rule is not None]
        return "; ".join(parts) or "scan bodies as they are"


@dataclasses.dataclass(frozen=True)
class BodyLevel(Level):
    """A level whose scans run rewritten bodies (:class:`BodyPlan`); nothing else changes."""

    bodies: BodyPlan | None = None


def body_scans(graph: Graph) -> tuple[int, ...]:
    """Node indices of the scans whose bodies hold residuals of their own (a forward and
    backward pass in one body), outside any differentiated forward pass of ``graph``: an
    accumulation scan's, or a checkpointed scan's backward loop (:func:`planned_body`)."""
    return tuple(n.index for n in graph.nodes
                 if n.primitive == "scan" and n.eqn is not None and not is_forward(n.scope)
                 and (not n.is_backward or reruns(n.subgraphs[0]))
                 and find_residuals(planned_body(n)))


def planned_body(node: Node) -> Graph:
    """The body of scan ``node`` as a step of its own.

    In the backward loop of a scan whose body the user checkpointed, every operation is
    of the backward pass, the checkpoint's re-run of the layer included. Marking that
    re-run as the body's forward pass (scopes are how residuals and the rewrite tell the
    passes apart) makes the values it hands to the layer's backward pass residuals, which
    the body's own levels can recompute later still: planning on top of the user's
    checkpoint.
    """
    body = node.subgraphs[0]
    if not (node.is_backward and reruns(body)):
        return body
    return dataclasses.replace(body, nodes=tuple(
        replaced(n, scope=f"jvp({n.scope})" if RERUN_SCOPE in n.scope
                 else f"transpose(jvp({n.scope}))") for n in body.nodes))


def rewrite_body(body: Graph, rule: BodyRule) -> Graph:
    """``body`` with ``rule``'s recomputation applied, as the step-level rewrite does."""
    if rule.loops is not None:
        return with_loop_plan(body, rule.loops, rule.recompute)[0]
    residuals = find_residuals(body)
    groups, segments = rule.recompute, rule.segments
    if segments is None:
        missing = sorted(set(groups) - {r.group for r in residuals})
        if missing:
            warn(f"jaxmem: this trace's scan body has no residual group {missing}; "
                          "those residuals stay saved at this shape")
        return apply_remat(body, [r for r in residuals if r.group in set(groups)], (),
                           residuals)
    return apply_segment_plan(body, segments, rule.batch, residuals,
                              "this trace's scan body")


def apply_body_plan(graph: Graph, plan: BodyPlan) -> Graph:
    """``graph`` whose scans of :func:`body_scans` run their bodies rewritten by ``plan``.

    Values keep their ids: only the scan nodes change. A plan for more or fewer
    scans than this trace has leaves the graph as it is, with a warning.
    """
    scans = body_scans(graph)
    if len(scans) != len(plan.rules):
        warn(f"jaxmem: this trace has {len(scans)} scan bodies with residuals where "
                      f"{plan.name!r} was planned on {len(plan.rules)}; it is not applied at "
                      "this shape")
        return graph
    nodes = list(graph.nodes)
    for index, rule in zip(scans, plan.rules, strict=True):
        if rule is not None:
            node = graph.nodes[index]
            nodes[index] = _with_body(node, rewrite_body(planned_body(node), rule))
    return dataclasses.replace(graph, nodes=tuple(nodes))


def apply_in_chunks(graph: Graph, level: Level, batch: Sequence[int]) -> Graph:
    """``graph``, a trace under :func:`jaxmem.grad.microbatching`, whose accumulation
    scans run the chunk's forward and backward pass with ``level``'s recomputation.

    ``level`` was planned on the whole step, whose forward pass each chunk's body now
    runs; ``batch`` are the step's batch inputs (:func:`~jaxmem.plan.segments.batch_inputs`
    of the symbolic trace), and a segment plan finds its cuts again from the body inputs
    they feed. An offload level runs its chunks as they are.
    """
    rules = []
    for index in body_scans(graph):
        rule = _rule(level, planned_body(graph.nodes[index]))
        if rule is not None:
            scope = clean_scope(graph.nodes[index].scope)
            segments = rule.segments and dataclasses.replace(
                rule.segments, save=frozenset(_relative(g, scope) for g in rule.segments.save))
            rule = dataclasses.replace(
                rule, recompute=tuple(_relative(g, scope) for g in rule.recompute),
                segments=segments, batch=_fed_by(graph, index, batch))
        rules.append(rule)
    return apply_body_plan(graph, BodyPlan(tuple(rules))) if rules else graph


def _relative(group: str, scope: str) -> str:
    """Residual group ``group`` of the whole step as the body of a scan in ``scope`` names
    it: a body's scopes start at its scan's (``jaxmem.value_and_grad``'s scope)."""
    head, colon, rest = group.partition(":")
    if not colon or scope == "<top>":
        return group
    if head == scope:
        return f"<top>:{rest}"
    return f"{head.removeprefix(scope + '/')}:{rest}"


def _fed_by(graph: Graph, index: int, batch: Sequence[int]) -> tuple[int, ...]:
    """Positions among node ``index``'s operands (its body's inputs) of the values made
    from the graph inputs at positions ``batch``."""
    active = {graph.inputs[i] for i in batch}
    for node in graph.nodes[:index]:
        if any(v in active for v in node.inputs):
            active.update(node.outputs)
    return tuple(p for p, v in enumerate(graph.nodes[index].operands) if v in active)


def _with_body(node: Node, body: Graph) -> Node:
    """Scan ``node`` running ``body`` (traced into a new jaxpr), its FLOPs re-counted."""
    old = node.eqn.params["jaxpr"]
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                  weak_type=getattr(v.aval, "weak_type", False))
             for v in old.jaxpr.invars]
    eqn = node.eqn.replace(params=dict(node.eqn.params,
                                       jaxpr=jax.make_jaxpr(_runner(body))(*specs)))
    sub = build_graph(eqn.params["jaxpr"])
    flops = sympy.expand(dim_of(eqn.params["length"]) * sympy.Add(*[n.flops for n in sub.nodes]))
    return dataclasses.replace(node, eqn=eqn, subgraphs=(sub,), flops=flops)


def _runner(graph: Graph) -> Any:
    """A function of ``graph``'s inputs returning its outputs, binding its nodes in order
    (the planner's barriers as ``optimization_barrier``): a body to trace."""
    def run(*flat: Any) -> list[Any]:
        env: dict[int, Any] = dict(graph.consts)
        env.update(zip(graph.inputs, flat, strict=True))
        for node in graph.nodes:
            if node.eqn is None:
                outs = jax.lax.optimization_barrier(tuple(env[v] for v in node.inputs))
            else:
                outs = bind_eqn(node.eqn, [env[o] if o is not None else atom.val for o, atom
                                           in zip(node.operands, node.eqn.invars, strict=True)])
            env.update(zip(node.outputs, outs, strict=True))
        return [env[v] for v in graph.outputs]

    return run


def _rule(level: Level, body: Graph) -> BodyRule | None:
    """A body level as a rule (None for one this module cannot apply by rule)."""
    if level.offload or not level.recompute:
        return None
    if level.loops is not None:  # its last name is the loop plan's
        return BodyRule(level.recompute[:-1], loops=level.loops)
    if level.segments is None:
        return BodyRule(level.recompute)
    return BodyRule(level.recompute, level.segments, batch_inputs(body))


def body_levels(graph: Graph, dom: ShapeDomain, *, symbolic: bool = True,
                donated: tuple[int, ...] = (), costs: Costs | None = None) -> list[BodyLevel]:
    """A step level per level of each scan body's own plan set (that body rewritten, the
    others as they are), with the step's memory model."""
    scans = body_scans(graph)
    flops = sympy.Add(*[n.flops for n in graph.nodes])
    out = []
    for k, index in enumerate(scans):
        body = planned_body(graph.nodes[index])
        for level in plan_levels(body, dom, symbolic=symbolic, costs=costs).levels[1:]:
            rule = _rule(level, body)
            if rule is None:
                continue
            plan = BodyPlan(tuple(rule if j == k else None for j in range(len(scans))))
            g2 = apply_body_plan(graph, plan)
            m = memory_model(g2, dom, donated=donated, symbolic=symbolic)
            extra = sympy.expand(sympy.Add(*[n.flops for n in g2.nodes]) - flops)
            out.append(BodyLevel((plan.name,), (), g2, m, extra, bodies=plan))
    return out


def add_body_levels(plans: PlanSet, graph: Graph, *, symbolic: bool = True,
                    donated: tuple[int, ...] = ()) -> PlanSet:
    """``plans`` with the body levels (:func:`body_levels`) whose peak is below every
    other level's at some sampled shape by :data:`BODY_MARGIN`, then the time–memory
    frontier again, largest first as :func:`~jaxmem.plan.levels.plan_levels` orders them.
    ``plans`` itself where ``graph`` has no such scan."""
    if not body_scans(graph):
        return plans
    dom = plans.domain
    points = dom.sample_points()
    levels = list(plans.levels)
    candidates = body_levels(graph, dom, symbolic=symbolic, donated=donated,
                             costs=plans.costs)
    corner = {sym(k): v for k, v in dom.corner().items()}
    for level in sorted(candidates, key=lambda lv: float(lv.recompute_flops.subs(corner))):
        if any(level.peak_fn(p) < (1 - BODY_MARGIN) * min(lv.peak_fn(p) for lv in levels)
               for p in points):
            levels.append(level)
    if len(levels) == len(plans.levels):
        return plans
    tally = collections.Counter(dict(plans.comparisons))
    tally["fallback"] += len(candidates)  # each candidate was kept or not by sampling
    kept = on_frontier(levels, points, plans.costs, tally)
    anchor = dom.extreme_points()[0]
    kept = (kept[0], *sorted(kept[1:], key=lambda lv: -lv.peak_fn(anchor)))
    return dataclasses.replace(plans, levels=kept, comparisons=tuple(sorted(tally.items())))


def encode_body_plan(plan: BodyPlan) -> list[Any]:
    """``plan`` as JSON-ready data (:func:`decode_body_plan` reads it back)."""
    def rule(r: BodyRule) -> list[Any]:
        seg, loops = r.segments, r.loops
        return [list(r.recompute),
                None if seg is None else encode_segment_plan(seg),
                list(r.batch),
                None if loops is None else [
                    [list(d) for d in loops.drop], loops.saved_primitive, loops.label,
                    None if loops.saved_ordinals is None
                    else [list(o) for o in loops.saved_ordinals]]]

    return [None if r is None else rule(r) for r in plan.rules]


def decode_body_plan(data: Sequence[Any]) -> BodyPlan:
    """The :class:`BodyPlan` of :func:`encode_body_plan`'s ``data``."""
    def ints(xs: Sequence[Any]) -> tuple[int, ...]:
        return tuple(int(i) for i in xs)

    def rule(groups: Sequence[Any], seg: Any, batch: Sequence[Any], loops: Any) -> BodyRule:
        segments = None if seg is None else decode_segment_plan(seg)
        loop = None if loops is None else LoopPlan(
            tuple(ints(d) for d in loops[0]), str(loops[1]), str(loops[2]),
            None if loops[3] is None else tuple(ints(o) for o in loops[3]))
        return BodyRule(tuple(str(g) for g in groups), segments, ints(batch), loop)

    return BodyPlan(tuple(None if r is None else rule(*r) for r in data))
