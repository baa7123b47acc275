"""Recomputation inside loop bodies: the forward ``scan`` stops stacking what the backward
``scan`` can rebuild.

Differentiating ``lax.scan`` gives two loops in the step's jaxpr: the forward scan
(under ``jvp(...)``) stacks, per iteration, every residual its body makes (its
``ys``), and the backward scan (under ``transpose(...)``, reversed) reads them back
as its ``xs`` (:mod:`jaxmem.plan.scan_pairs` finds such pairs and rewrites their
bodies). A :class:`LoopPlan` says which stacked residuals leave the forward scan:
the backward body re-runs the slice of the forward body that rebuilds them from that
iteration's carry (the layer input, which the forward scan now stacks unless a kept
residual holds it), ``xs`` and the loop's constants, plus the residuals still
stacked and, for a plan that saves them, the body's matmul outputs. That is
per-iteration ``jax.checkpoint`` (``nothing_saveable``, or ``dots_saveable``),
planned on the one trace of the step rather than written into the model. A body
the user already checkpointed stacks little, and what it still stacks is rebuilt
the same way.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> def loss(ws, x):
    ...     body = lambda h, w: (jnp.tanh(h @ w), None)
    ...     return (jax.lax.scan(body, x, ws)[0] ** 2).sum()
    >>> g = build_graph(jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 8, 8)), jnp.ones((2, 8))))
    >>> plans = loop_candidates(g, find_scan_pairs(g), {})
    >>> [p.label for p in plans]
    ['every stacked residual but matmul outputs', 'every stacked residual']
    >>> scan = lambda g: [n for n in g.nodes if n.primitive == "scan"][0]
    >>> len(scan(apply_loop_plan(g, plans[-1])).outputs) < len(scan(g).outputs)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import sympy

from jaxmem.errors import warn
from jaxmem.graph import Builder, Graph, Node, scan_counts
from jaxmem.graph.build import dim_of
from jaxmem.plan.offload import Costs
from jaxmem.plan.remat import apply_remat
from jaxmem.plan.residuals import Residual, find_residuals
from jaxmem.plan.scan_pairs import ScanPair, find_scan_pairs, rewrite_pair

#: Plans that rebuild only the largest stacked residuals: at most this many, one per
#: size class from the largest down, before the plan that rebuilds them all.
MAX_PARTIAL = 3


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """Which stacked residuals of each forward/backward scan pair to rebuild.

    Positions, not values, so that the plan chosen on the symbolic trace applies to
    every concrete trace of the same step (which has the same pairs).

    Attributes:
        drop: per pair of :func:`~jaxmem.plan.scan_pairs.find_scan_pairs`, the forward
            ys positions rebuilt.
        saved_primitive: the primitive whose outputs in each forward body the rebuild
            may read, stacked instead (``"dot_general"``: matmul outputs, as
            ``dots_saveable``); empty: the rebuild starts from the layer input. A name,
            not equation positions: the symbolic trace's bodies hold equations on dims
            that a concrete trace's lack, so positions differ between the traces.
        label: what the plan rebuilds, for people.
        saved_ordinals: per pair, which of the forward body's ``saved_primitive``
            equations are saved, by their order among those equations (the same on every
            trace); None: all of them.
    """

    drop: tuple[tuple[int, ...], ...]
    saved_primitive: str = ""
    label: str = "every stacked residual"
    saved_ordinals: tuple[tuple[int, ...], ...] | None = None

    @property
    def name(self) -> str:
        return f"scan bodies: rebuild {self.label} in the backward loop"

    def fits(self, pairs: Sequence[ScanPair]) -> bool:
        """Whether this plan's positions exist in ``pairs`` (another trace's pairs)."""
        return len(pairs) == len(self.drop) and all(
            set(d) <= set(p.droppable) for p, d in zip(pairs, self.drop, strict=True))


def loop_candidates(graph: Graph, pairs: Sequence[ScanPair], corner: Mapping[Any, int],
                    costs: Costs | None = None) -> tuple[LoopPlan, ...]:
    """The loop plans worth scoring: the largest stacked residuals first, then all.

    Residuals are taken by size class at the domain's ``corner`` (the attention
    probabilities before the layer-norm statistics), each plan rebuilding every
    class from the largest down to one more than the plan before; with ``costs``,
    every residual from the matmul outputs that take longer to re-run than to stack
    (the attention scores' matmul, whose few FLOPs per output byte a loop re-runs
    faster than it stacks them, is re-run: the flash-attention choice); every
    residual but from all the matmul outputs, stacked instead (per-iteration
    ``dots_saveable``); the last one rebuilds every residual the bodies can
    (``nothing_saveable``).
    """
    def size(p: ScanPair, j: int) -> float:
        v = graph.nodes[p.forward].outputs[scan_counts(graph.nodes[p.forward].eqn.params)[1] + j]
        return float(graph.values[v].nbytes.subs(corner))

    sizes = sorted({size(p, j) for p in pairs for j in p.droppable}, reverse=True)
    every = LoopPlan(tuple(p.droppable for p in pairs))
    plans = [LoopPlan(tuple(tuple(j for j in p.droppable if size(p, j) >= t) for p in pairs),
                      label=f"the {k + 1} largest kind(s) of stacked residual")
             for k, t in enumerate(sizes[:MAX_PARTIAL])]
    dots = [_made_by(graph, p, "dot_general")[1] for p in pairs]
    saving = LoopPlan(tuple(tuple(j for j in p.droppable if j not in made)
                            for p, made in zip(pairs, dots, strict=True)),
                      "dot_general", "every stacked residual but matmul outputs")
    if costs is not None:
        dear = [_dear_dots(graph, p, corner, costs) for p in pairs]
        made = [_made_by(graph, p, "dot_general", kept)[1]
                for p, kept in zip(pairs, dear, strict=True)]
        plans.append(LoopPlan(tuple(tuple(j for j in p.droppable if j not in m)
                                    for p, m in zip(pairs, made, strict=True)),
                              "dot_general", "every stacked residual but the matmul outputs "
                              "dearer to re-run than to stack", tuple(dear)))
    # Saving every matmul (or none) rewrites as `saving` (or `every`) does: one candidate.
    seen = {_rewrite(saving), _rewrite(every)}
    partial = []
    for p in plans:
        if any(p.drop) and _rewrite(p) not in seen and not _saves_all_or_none(graph, pairs, p):
            seen.add(_rewrite(p))
            partial.append(p)
    return (*partial, saving, every)


def _rewrite(plan: LoopPlan) -> tuple[Any, ...]:
    """What a plan does to the graph, whatever its label."""
    return plan.drop, plan.saved_primitive, plan.saved_ordinals


def _saves_all_or_none(graph: Graph, pairs: Sequence[ScanPair], plan: LoopPlan) -> bool:
    """Whether ``plan`` names its saved matmuls but they are all, or none, of every body's."""
    if plan.saved_ordinals is None:
        return False
    counts = [len(_made_by(graph, p, plan.saved_primitive)[0]) for p in pairs]
    return all(len(k) in (0, n) for k, n in zip(plan.saved_ordinals, counts, strict=True))


def _dear_dots(graph: Graph, pair: ScanPair, corner: Mapping[Any, int],
               costs: Costs) -> tuple[int, ...]:
    """Ordinals of the forward body's matmuls whose outputs take longer to re-run (their
    FLOPs at ``costs``' rate) than to stack past the cache (``Costs.stacked_byte_s``),
    at ``corner``."""
    body = graph.nodes[pair.forward].eqn.params["jaxpr"].jaxpr
    dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
    dear = []
    for k, e in enumerate(dots):
        (contracted, _), _ = e.params["dimension_numbers"]
        lhs, out = e.invars[0].aval, e.outvars[0].aval
        size = float(sympy.Mul(*[dim_of(d) for d in out.shape]).subs(corner))
        depth = float(sympy.Mul(*[dim_of(lhs.shape[i]) for i in contracted]).subs(corner))
        if costs.recompute_s(2 * size * depth) >= costs.stacked_byte_s * size * out.dtype.itemsize:
            dear.append(k)
    return tuple(dear)


def _made_by(graph: Graph, pair: ScanPair, primitive: str,
             ordinals: Sequence[int] | None = None) -> tuple[tuple[int, ...], frozenset[int]]:
    """The forward body's equations of ``primitive`` (positions; only the ``ordinals``-th
    of them if given), and the droppable ys positions they make."""
    eqn = graph.nodes[pair.forward].eqn
    body = eqn.params["jaxpr"].jaxpr
    at = tuple(i for i, e in enumerate(body.eqns) if e.primitive.name == primitive)
    if ordinals is not None:
        at = tuple(at[k] for k in ordinals if k < len(at))
    outs = {v for i in at for v in body.eqns[i].outvars}
    _, ncar = scan_counts(eqn.params)
    return at, frozenset(j for j in pair.droppable if body.outvars[ncar + j] in outs)


def with_loop_plan(graph: Graph, plan: LoopPlan, recompute: Sequence[str] = (),
                   offload: Sequence[str] = ()
                   ) -> tuple[Graph, tuple[Residual, ...], tuple[Residual, ...]]:
    """``plan`` applied to ``graph``, then the residual groups named in ``recompute`` and
    ``offload`` (:func:`~jaxmem.plan.remat.apply_remat`); the graph, and the residuals
    recomputed and offloaded. The planner scores, and the rewrite runs, exactly this."""
    return with_groups(apply_loop_plan(graph, plan), recompute, offload)


def with_groups(graph: Graph, recompute: Sequence[str] = (), offload: Sequence[str] = ()
                ) -> tuple[Graph, tuple[Residual, ...], tuple[Residual, ...]]:
    """The residual groups named in ``recompute`` and ``offload`` of ``graph`` (a loop
    plan's graph, applied once for every set of groups the planner tries on it)
    recomputed and offloaded; the graph, and those residuals."""
    residuals = find_residuals(graph)
    chosen = tuple(r for r in residuals if r.group in set(recompute))
    moved = tuple(r for r in residuals if r.group in set(offload))
    return apply_remat(graph, chosen, moved, residuals), chosen, moved


def apply_loop_plan(graph: Graph, plan: LoopPlan) -> Graph:
    """``graph`` with every scan pair rewritten by ``plan`` (``graph`` itself if none is).

    Original values keep their ids (a dropped residual is simply made by no node);
    the carries the forward scan now stacks are new values appended after them. A
    plan whose positions this graph's pairs lack (a trace unlike the one it was
    planned on) leaves the graph as it is, with a warning.
    """
    pairs = find_scan_pairs(graph)
    if not plan.fits(pairs):
        warn(f"jaxmem: this trace's scan loops differ from those {plan.name!r} was "
                      "planned on; it is not applied at this shape")
        return graph
    builder = Builder()
    builder.values = list(graph.values)
    replaced: dict[int, Node] = {}
    ordinals = plan.saved_ordinals or [None] * len(pairs)
    for pair, drop, kept in zip(pairs, plan.drop, ordinals, strict=True):
        if drop:
            save = _made_by(graph, pair, plan.saved_primitive, kept)[0]
            replaced.update(rewrite_pair(graph, pair, drop, save, builder))
    if not replaced:
        return graph
    nodes = [dataclasses.replace(replaced.get(n.index, n), index=n.index) for n in graph.nodes]
    return Graph(tuple(builder.values), tuple(nodes), graph.inputs, graph.outputs, graph.consts)


