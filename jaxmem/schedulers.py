"""Programmable scheduling: the :class:`Scheduler` interface and the built-in strategies.

A scheduler decides how a traced step runs, never what it computes (DynaFlow's
split between the logical model and its physical schedule). ``order(graph)``
returns a permutation of ``range(len(graph.nodes))``; jaxmem checks it keeps
every data dependency (:class:`~jaxmem.ScheduleError` otherwise) and, when it is
not program order, makes XLA honour it by chaining the materialising
operations through optimization barriers.

Example (a custom scheduler that runs ops in program order, reversed where legal):
    >>> import jaxmem
    >>> class ProgramOrder(jaxmem.Scheduler):
    ...     def order(self, graph):
    ...         return list(range(len(graph.nodes)))
    >>> ProgramOrder()
    ProgramOrder()
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import sympy

from jaxmem.errors import ScheduleError
from jaxmem.graph import Graph, Node, Value
from jaxmem.memory import materialised, memory_model
from jaxmem.plan.compiles import CompilePlan, CompileProblem
from jaxmem.symbolic import Cmp, Comparison, ShapeDomain, compare, lowers_somewhere


@dataclasses.dataclass(frozen=True)
class ScheduleGraph:
    """What a scheduler sees: the traced operations and a symbolic comparison oracle.

    Attributes:
        graph: the flat dataflow graph (``nodes`` in program order; each node has
            ``primitive``, ``inputs``, ``outputs``; ``values[i].nbytes`` is symbolic).
        domain: the shape domain.
    """

    graph: Graph
    domain: ShapeDomain

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.graph.nodes

    @property
    def values(self) -> tuple[Value, ...]:
        return self.graph.values

    def compare(self, a: Any, b: Any) -> Comparison:
        """Compares two symbolic byte expressions over the whole domain."""
        return compare(a, b, self.domain)


class Scheduler:
    """Base class of scheduling strategies. Override the hooks you need.

    ``order`` returns None (leave the order to XLA) or a permutation of node
    indices. ``microbatches`` returns how many accumulation steps to split the
    batch into at concrete dims (1 = no split).

    Attributes:
        verify_with_xla: when True, jaxmem also compiles each plan without the
            order and keeps the order only if XLA's peak is lower with it (for
            heuristic orders; a user's order is always honoured).
    """

    verify_with_xla: bool = False

    def order(self, graph: ScheduleGraph) -> list[int] | None:
        """The op order to run, or None to leave it to XLA."""
        del graph
        return None

    def microbatches(self, dims: dict[str, int], fits: Any) -> int:
        """Number of microbatches at ``dims``; ``fits(k)`` says if k would fit the budget."""
        del dims, fits
        return 1

    def compile_plan(self, problem: CompileProblem) -> CompilePlan | None:
        """Which shapes to compile for announced calls (``Jitted.plan_compiles``); None
        leaves it to jaxmem's optimiser, :func:`jaxmem.plan.compiles.plan_compiles`."""
        del problem
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class XlaDefault(Scheduler):
    """Leave op order to XLA's own scheduler (recomputation is still planned)."""


class MemoryAware(Scheduler):
    """The default: recomputation at first use, and (opt-in) a memory-aware op order.

    The remat rewrite puts each recomputation just before its first backward use,
    behind a barrier. With ``reorder=True`` the op order is chosen too, by
    ready-set list scheduling on symbolic memory impact: among the operations
    whose inputs are ready, run the one that adds the fewest bytes (bytes it
    materialises minus bytes whose last reader it is), comparing byte counts
    over the whole shape domain; where that depends on the shape, keep program
    order (the topology fallback). The order is returned only when its symbolic
    peak is lower than program order's somewhere, and jaxmem keeps it only when
    XLA's own peak is lower with it (``verify_with_xla``): barriers that pin an
    order also stop some fusions, so XLA has the last word.

    ``reorder`` is off by default: on the tiny Llama train step every level
    gets an order, each costing two extra memory models (about 10 s) and a
    second compile per shape, while XLA's memory-minimising scheduler already
    reaches the same peaks on the programs measured so far.

    Args:
        reorder: compute and propose a memory-aware op order.

    Attributes:
        decided: how the impact comparisons were decided
            (``coefficients``, ``symbolic``, ``fallback``).
    """

    verify_with_xla = True

    def __init__(self, reorder: bool = False) -> None:
        self.reorder = reorder
        self.decided: dict[str, int] = {}

    def order(self, graph: ScheduleGraph) -> list[int] | None:
        if not self.reorder:
            return None
        candidate = memory_order(graph.graph, graph.domain, self.decided)
        if candidate == list(range(len(candidate))):
            return None
        tally: collections.Counter[str] = collections.Counter()
        base = memory_model(graph.graph, graph.domain).peak_bytes
        new = memory_model(graph.graph, graph.domain, order=candidate).peak_bytes
        return candidate if lowers_somewhere(new, base, graph.domain, True, tally) else None

    def __repr__(self) -> str:
        return f"MemoryAware(reorder={self.reorder})"


def _impacts(graph: Graph) -> tuple[dict[int, sympy.Expr], dict[int, tuple[int, ...]]]:
    """Per node: bytes its materialised outputs take; per node: the buffers it reads."""
    owner = materialised(graph)
    made = {n.index: sympy.Add(*[graph.values[o].nbytes for o in n.outputs
                                 if owner.get(o, o) == o and n.kind != "view"])
            for n in graph.nodes}
    reads = {n.index: tuple(dict.fromkeys(owner.get(v, v) for v in n.inputs
                                          if owner.get(v, v) not in (-1,)))
             for n in graph.nodes}
    return made, reads


def memory_order(graph: Graph, dom: ShapeDomain,
                 tally: dict[str, int] | None = None) -> list[int]:
    """A topological order that greedily runs the ready op with the least memory impact.

    Args:
        graph: the graph.
        dom: its shape domain (impacts are compared over all of it).
        tally: counts how each comparison was decided, updated in place.

    Returns:
        A permutation of node indices that keeps every data dependency.
    """
    tally = {} if tally is None else tally
    made, reads = _impacts(graph)
    producers = graph.producers
    protected = set(graph.inputs) | set(graph.outputs)
    readers_left = collections.Counter(v for ids in reads.values() for v in ids)
    deps = {n.index: {producers[v] for v in n.inputs if v in producers} for n in graph.nodes}
    users: dict[int, list[int]] = {}
    for n, ds in deps.items():
        for d in ds:
            users.setdefault(d, []).append(n)
    ready = sorted(n for n, ds in deps.items() if not ds)
    cache: dict[tuple[sympy.Expr, sympy.Expr], int] = {}
    order: list[int] = []
    while ready:
        def impact(n: int) -> sympy.Expr:
            freed = [graph.values[v].nbytes for v in reads[n]
                     if readers_left[v] == 1 and v not in protected]
            return sympy.expand(made[n] - sympy.Add(*freed))

        best = ready[0]
        best_cost = impact(best)
        for n in ready[1:]:
            cost = impact(n)
            if _less(cost, best_cost, dom, cache, tally):
                best, best_cost = n, cost
        ready.remove(best)
        order.append(best)
        for v in reads[best]:
            readers_left[v] -= 1
        for u in users.get(best, ()):
            deps[u].discard(best)
            if not deps[u]:
                bisect.insort(ready, u)
    return order


def _less(a: sympy.Expr, b: sympy.Expr, dom: ShapeDomain,
          cache: dict[tuple[sympy.Expr, sympy.Expr], int], tally: dict[str, int]) -> bool:
    """True when ``a < b`` over the whole domain; shape-dependent cases say False."""
    key = (a, b)
    if key not in cache:
        diff = sympy.expand(a - b)
        if diff.is_number:
            cache[key], how = (-1 if diff < 0 else 1 if diff > 0 else 0), "coefficients"
        else:
            coeffs = [t.as_coeff_Mul()[0] for t in sympy.Add.make_args(diff)]
            if all(c <= 0 for c in coeffs):  # every monomial of positive dims is >= 0
                cache[key], how = -1, "coefficients"
            elif all(c >= 0 for c in coeffs):
                cache[key], how = 1, "coefficients"
            else:
                c = compare(a, b, dom)
                how = c.decided_by
                cache[key] = -1 if c.result == Cmp.LT else 0
        tally[how] = tally.get(how, 0) + 1
    return cache[key] < 0


class Microbatch(Scheduler):
    """Split the batch axis into k accumulation steps when nothing else fits.

    Args:
        axis: the dimension variable that is the batch (``"b"``).
        max_microbatches: the largest k tried.
    """

    def __init__(self, axis: str = "b", max_microbatches: int = 64):
        self.axis = axis
        self.max_microbatches = max_microbatches

    def microbatches(self, dims: dict[str, int], fits: Any) -> int:
        """The smallest k in 1, 2, 4, ... (then ``min(n, max)``) that fits.

        Chunks have ``ceil(n / k)`` rows; an uneven last chunk is weighted by its rows.
        """
        n = dims.get(self.axis, 1)
        top = min(n, self.max_microbatches)
        ks = [k for k in (2 ** i for i in range(top.bit_length())) if k <= top]
        for k in dict.fromkeys([*ks, top]):
            if fits(k):
                return k
        return top


def validate_order(graph: Graph, order: Sequence[int] | None) -> list[int] | None:
    """Checks that ``order`` is a permutation that respects every data dependency.

    Raises:
        ScheduleError: not a permutation, or a node runs before a producer of its input.
    """
    if order is None:
        return None
    try:
        order = [int(i) for i in order]
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"order() must return a list of ints, got {order!r:.80}") from e
    n = len(graph.nodes)
    if sorted(order) != list(range(n)):
        raise ScheduleError(f"order() must return a permutation of range({n}); got {len(order)} "
                            f"entries with {len(set(order))} distinct values")
    pos = {node: p for p, node in enumerate(order)}
    producers = graph.producers
    for node in graph.nodes:
        for v in node.inputs:
            p = producers.get(v)
            if p is not None and pos[p] > pos[node.index]:
                raise ScheduleError(
                    f"order() breaks a data dependency: node {node.index} ({node.primitive}) "
                    f"at position {pos[node.index]} reads value {v}, which node {p} "
                    f"({graph.nodes[p].primitive}) makes later, at position {pos[p]}")
    return order


def reorder(graph: Graph, order: Sequence[int]) -> Graph:
    """The same graph with its nodes renumbered into ``order``."""
    nodes = tuple(dataclasses.replace(graph.nodes[i], index=p) for p, i in enumerate(order))
    return dataclasses.replace(graph, nodes=nodes)
