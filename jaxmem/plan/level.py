"""One level of a plan set: what it recomputes or offloads, and its symbolic memory.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory import memory_model
    >>> from jaxmem.symbolic import ShapeDomain
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones(8)))
    >>> level = Level((), (), g, memory_model(g, ShapeDomain.from_constraints((), ())))
    >>> level.peak_fn({}) > 0, level.flops_fn({}) > 0
    (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import sympy

from jaxmem.fastexpr import compile_expr, expanded_sum
from jaxmem.graph import Graph, scan_counts
from jaxmem.memory import MemoryModel
from jaxmem.plan.loops import LoopPlan
from jaxmem.plan.offload import Costs
from jaxmem.plan.residuals import Residual
from jaxmem.plan.segments import SegmentPlan


@dataclasses.dataclass(frozen=True)
class Level:
    """One plan: the residual groups it recomputes and its symbolic memory.

    Attributes:
        recompute: names of the recomputed residual groups (cumulative).
        residuals: the recomputed residuals.
        graph: the rewritten graph.
        memory: its memory model; ``memory.peak_bytes`` is the guard's left side.
        recompute_flops: symbolic extra work.
        offload: names of the residual groups moved to host memory (cumulative).
        offloaded: the offloaded residuals.
        segments: for a segment level, the rule that picks its residuals on any trace
            of the step (:mod:`jaxmem.plan.segments`); None for a level of groups.
        loops: for a loop level, the scan residuals its backward loops rebuild
            (:mod:`jaxmem.plan.loops`), applied before its groups; else None.
    """

    recompute: tuple[str, ...]
    residuals: tuple[Residual, ...]
    graph: Graph = dataclasses.field(repr=False)
    memory: MemoryModel = dataclasses.field(repr=False)
    recompute_flops: sympy.Expr = sympy.Integer(0)
    offload: tuple[str, ...] = ()
    offloaded: tuple[Residual, ...] = ()
    segments: SegmentPlan | None = None
    loops: LoopPlan | None = None

    @property
    def offload_bytes(self) -> sympy.Expr:
        """Symbolic bytes each step moves to the host (and back)."""
        return sympy.Add(*[r.nbytes for r in self.offloaded])

    @functools.cached_property
    def peak_fn(self) -> Callable[..., Any]:
        """The peak as a fast numeric function of the dims (a name -> value mapping)."""
        return _numeric(self.memory.peak_bytes)

    @functools.cached_property
    def offload_bytes_fn(self) -> Callable[..., Any]:
        """:attr:`offload_bytes` as a fast numeric function of the dims."""
        return _numeric(sympy.sympify(self.offload_bytes))

    @functools.cached_property
    def stacked_bytes_fn(self) -> Callable[..., Any]:
        """Bytes the step's ``scan`` loops stack (their per-iteration outputs) as a numeric
        function of the dims: loop plans trade them for re-run FLOPs."""
        return _numeric(expanded_sum(self.graph.values[v].nbytes for n in self.graph.nodes
                                     if n.primitive == "scan" and n.eqn is not None
                                     for v in n.outputs[scan_counts(n.eqn.params)[1]:]))

    def step_s(self, dims: Mapping[str, int], costs: Costs) -> float:
        """Predicted seconds of one step at ``dims``: its FLOPs (recomputation included)
        at ``costs``' rate, the passes over what its loops stack, the first touch of its
        temporary buffer, and the round trips of what it offloads."""
        moved = costs.transfer_s(self.offload_bytes_fn(dims)) if self.offloaded else 0.0
        fresh = 0.0
        if costs.fresh_bytes_per_s < math.inf:
            fresh = costs.first_touch_s(self.peak_fn(dims) - self.fixed_bytes_fn(dims))
        return (costs.recompute_s(self.flops_fn(dims)) + moved + fresh
                + costs.stacking_s(self.stacked_bytes_fn(dims)))

    @functools.cached_property
    def fixed_bytes_fn(self) -> Callable[..., Any]:
        """Arguments plus outputs less aliased bytes: the peak's part that is no
        temporary, as a numeric function of the dims."""
        m = self.memory
        return _numeric(sympy.sympify(m.argument_bytes + m.output_bytes - m.alias_bytes))

    @functools.cached_property
    def flops_fn(self) -> Callable[..., Any]:
        """FLOPs of one step at this level (recomputation included), as a function of the
        dims: what a step's time is predicted from."""
        return _numeric(expanded_sum(n.flops for n in self.graph.nodes))


def _numeric(expr: sympy.Expr) -> Callable[[Mapping[str, int]], int]:
    free = sorted(expr.free_symbols, key=str)
    fn = compile_expr(free, expr)
    names = [str(s) for s in free]
    return lambda dims: int(fn(*[dims[n] for n in names]))
