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

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxmem._errors import ScheduleError
from jaxmem.graph import Graph, Node, Value
from jaxmem.symbolic import Comparison, ShapeDomain, compare


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
    """

    def order(self, graph: ScheduleGraph) -> list[int] | None:
        """The op order to run, or None to leave it to XLA."""
        del graph
        return None

    def microbatches(self, dims: dict[str, int], fits: Any) -> int:
        """Number of microbatches at ``dims``; ``fits(k)`` says if k would fit the budget."""
        del dims, fits
        return 1

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class XlaDefault(Scheduler):
    """Leave op order to XLA's own scheduler (recomputation is still planned)."""


class MemoryAware(Scheduler):
    """The default: program order, with recomputation placed at first use.

    The remat rewrite already puts each recomputation just before its first
    backward use behind a barrier; beyond that XLA's memory-minimising list
    scheduler is left in charge.
    """


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
        n = dims.get(self.axis, 1)
        for k in range(1, min(n, self.max_microbatches) + 1):
            if n % k == 0 or k == n:
                if fits(k):
                    return k
        return min(n, self.max_microbatches)


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
