"""A level applied to the concrete trace of a call: recomputation, offload and op order.

The plan set is derived once on the symbolic trace; a call at concrete dims
traces the function again at those shapes (so XLA compiles exact shapes), finds
the same residual groups by name (a loop level first rewrites the same scan pairs,
:mod:`jaxmem.plan.loops`), rewrites the graph with the level's
recomputation and offload (:func:`jaxmem.plan.remat.apply_remat`, the transform
the planner scored), and, where the scheduler gave one, renumbers the nodes into
its op order. Under ``microbatches > 1`` the trace runs inside
:func:`jaxmem.grad.microbatching`, which splits ``jaxmem.value_and_grad``'s batch.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.plan.analysis import analyze_specs
    >>> step = lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> a = analyze_specs(step, (), (jnp.ones((8, 8)), jnp.ones((4, 8))), (), (None, "b, 8"),
    ...                   ("b <= 64",), None, (), True)
    >>> r = rewrite_level(a, 0, {"b": 4}, (jnp.ones((8, 8)), jnp.ones((4, 8))))
    >>> r.order_enforced, len(r.graph.inputs)
    (False, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxmem.errors import warn
from jaxmem.grad import microbatching
from jaxmem.graph import Graph, build_graph
from jaxmem.plan.analysis import Analysis, as_struct
from jaxmem.plan.bodies import BodyLevel, apply_body_plan, apply_in_chunks
from jaxmem.plan.loops import with_loop_plan
from jaxmem.plan.remat import apply_remat
from jaxmem.plan.residuals import find_residuals
from jaxmem.plan.segment_levels import apply_segment_plan
from jaxmem.plan.segments import batch_inputs
from jaxmem.schedulers import reorder
from jaxmem.unroll import write_out


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """The graph one level runs at one shape.

    Attributes:
        graph: the rewritten concrete graph (flat inputs and outputs).
        out_tree: the pytree structure of the function's outputs.
        order_enforced: whether the scheduler's op order was applied (barriers pin it).
    """

    graph: Graph
    out_tree: Any
    order_enforced: bool


def needs_rewrite(analysis: Analysis, k: int, apply_order: bool = True,
                  microbatches: int = 1) -> bool:
    """False when level ``k`` is the user's own function (nothing to recompute or reorder)."""
    level = analysis.plans.levels[k]
    order = analysis.orders[k] if apply_order else None
    return bool(level.recompute or level.offload or level.loops is not None or microbatches > 1
                or (order is not None and order != list(range(len(order)))))


def rewrite_level(analysis: Analysis, k: int, dims: dict[str, int], dynamic: tuple[Any, ...],
                  apply_order: bool = True, microbatches: int = 1, axis: str = "") -> Rewritten:
    """Level ``k`` of ``analysis`` applied to the trace at the shapes of ``dynamic``.

    Args:
        analysis: the call's analysis.
        k: the level.
        dims: the bound dims (for the microbatch split of dim ``axis``).
        dynamic: the dynamic arguments (arrays or ``jax.ShapeDtypeStruct``).
        apply_order: apply the scheduler's op order, if it gave one.
        microbatches: split dim ``axis`` into this many accumulation steps.
        axis: the batch dim's name.
    """
    level = analysis.plans.levels[k]
    avals = [as_struct(x) for x in jax.tree_util.tree_leaves(dynamic)]
    tree = jax.tree_util.tree_structure(dynamic)

    def fresh(*a: Any) -> Any:  # a new function: JAX's trace cache cannot see the context
        return analysis.flat_fn(*a)

    with microbatching(microbatches, dims.get(axis, 0)):
        closed, out_shape = jax.make_jaxpr(fresh if microbatches > 1 else analysis.flat_fn,
                                           return_shape=True)(
            *jax.tree_util.tree_unflatten(tree, avals))
    graph = build_graph(write_out(closed, avals))
    if microbatches > 1 and not isinstance(level, BodyLevel):
        graph = apply_in_chunks(graph, level, batch_inputs(analysis.graph))
        # what is left at the top is an uneven remainder's pass, if any
        rewritten = _rewrite_top(analysis, k, graph) if find_residuals(graph) else graph
    else:
        rewritten = _rewrite_top(analysis, k, graph)
    order = analysis.orders[k] if apply_order else None
    enforced = False
    if order is not None and order != list(range(len(order))) and microbatches == 1:
        if [n.primitive for n in rewritten.nodes] == [n.primitive for n in level.graph.nodes]:
            rewritten, enforced = reorder(rewritten, order), True
        else:
            warn("jaxmem: the concrete trace differs from the symbolic one; the "
                          "scheduler's order is not applied at this shape")
    return Rewritten(rewritten, jax.tree_util.tree_structure(out_shape), enforced)


def _rewrite_top(analysis: Analysis, k: int, graph: Graph) -> Graph:
    """``graph`` with level ``k``'s plan applied to its own (top-level) forward pass."""
    level = analysis.plans.levels[k]
    if isinstance(level, BodyLevel):
        return apply_body_plan(graph, level.bodies)
    if level.loops is not None:
        return with_loop_plan(graph, level.loops, level.recompute, level.offload)[0]
    residuals = find_residuals(graph)
    if level.segments is not None:
        return apply_segment_plan(graph, level.segments, batch_inputs(analysis.graph),
                                  residuals, "the concrete trace")
    recompute, offload = set(level.recompute), set(level.offload)
    missing = sorted((recompute | offload) - {r.group for r in residuals})
    if missing:
        warn(f"jaxmem: the concrete trace has no residual group {missing} of "
                      f"level {k}; those residuals stay saved at this shape")
    return apply_remat(graph, [r for r in residuals if r.group in recompute],
                       [r for r in residuals if r.group in offload], residuals)
