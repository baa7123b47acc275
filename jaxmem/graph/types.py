"""The graph's data types: :class:`Value`, :class:`Node`, :class:`Graph`.

Example:
    >>> import sympy
    >>> x = Value(0, (sympy.Integer(4),), "float32", sympy.Integer(16))
    >>> y = Value(1, (sympy.Integer(4),), "float32", sympy.Integer(16))
    >>> g = Graph((x, y), (Node(0, "tanh", "elementwise", (0,), (1,)),), (0,), (1,))
    >>> g.producers, g.consumers
    ({1: 0}, {0: (0,)})
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import sympy

from jaxmem.errors import JaxmemWarning  # noqa: F401 (re-exported by jaxmem.graph)


@dataclasses.dataclass(frozen=True)
class Value:
    """One array in the program.

    Attributes:
        id: index into ``Graph.values``.
        shape: dims as sympy expressions.
        dtype: numpy dtype name.
        nbytes: symbolic size in bytes of device memory (0 for a value in host memory).
        host: whether the value lives in host memory (``jax.memory.Space.Host``).
    """

    id: int
    shape: tuple[sympy.Expr, ...]
    dtype: str
    nbytes: sympy.Expr
    host: bool = False


@dataclasses.dataclass(frozen=True)
class Node:
    """One traced operation.

    Attributes:
        index: position in program order.
        primitive: the JAX primitive's name.
        kind: ``elementwise``, ``view``, ``reduce``, ``inplace``, ``opaque`` or ``control``.
        inputs: ids of input values (literals are dropped).
        outputs: ids of output values.
        scope: JAX's name stack at the equation (``jvp(layer_0/attn)``, ``transpose(...)``).
        subgraphs: bodies of control flow (scan/while/cond), else empty.
        flops: a symbolic estimate of the arithmetic the node performs.
        params: a few primitive parameters kept for rules downstream.
    """

    index: int
    primitive: str
    kind: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    scope: str = ""
    subgraphs: tuple[Graph, ...] = ()
    flops: sympy.Expr = sympy.Integer(0)
    params: tuple[tuple[str, Any], ...] = ()
    # For execution by the rewrite stage: the equation, and per operand either a
    # value id or None where the equation reads a literal.
    eqn: Any = dataclasses.field(default=None, compare=False, repr=False)
    operands: tuple[int | None, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def is_backward(self) -> bool:
        """True for operations JAX made by transposing (the backward pass), but for a
        ``jax.checkpoint``'s re-run of its forward operations there (:func:`is_rerun`),
        whose values the planner may recompute later still."""
        return "transpose(" in self.scope and RERUN_SCOPE not in self.scope


#: The name ``jax.checkpoint`` (``nn.remat``, ``nnx.remat``) gives the forward operations
#: it re-runs inside the backward pass.
RERUN_SCOPE = "rematted_computation"


def is_rerun(scope: str) -> bool:
    """True for a ``jax.checkpoint``'s re-run of forward operations in the backward pass:
    a forward pass the user placed there, which segment cuts and loop pairs leave alone."""
    return "transpose(" in scope and RERUN_SCOPE in scope


def reruns(graph: Graph) -> bool:
    """Whether ``graph`` (not its sub-graphs) holds a ``jax.checkpoint``'s re-run of
    forward operations: recomputation the user wrote, which every plan keeps."""
    return any(RERUN_SCOPE in n.scope for n in graph.nodes)


ValueOrNode = TypeVar("ValueOrNode", "Value", "Node")


def replaced(item: ValueOrNode, **changes: Any) -> ValueOrNode:
    """``dataclasses.replace(item, **changes)`` for a :class:`Value` or :class:`Node`,
    without the frozen ``__init__`` (a field at a time through ``object.__setattr__``):
    a rewrite copies thousands of nodes and values, and their construction was a third
    of its time. Neither class has a ``__post_init__`` or cached attributes.

    Example:
        >>> n = Node(0, "tanh", "elementwise", (0,), (1,))
        >>> replaced(n, index=3) == dataclasses.replace(n, index=3)
        True
    """
    new = object.__new__(type(item))
    fields = new.__dict__
    fields.update(item.__dict__)
    fields.update(changes)
    return new


@dataclasses.dataclass(frozen=True)
class Graph:
    """A flat dataflow graph in program order.

    Attributes:
        values: all values; ``values[i].id == i``.
        nodes: operations in program order.
        inputs: value ids of the flat arguments.
        outputs: value ids of the flat results (may repeat or be inputs).
    """

    values: tuple[Value, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    # (value id, array) for constants and literals the rewrite stage must feed in.
    consts: tuple[tuple[int, Any], ...] = dataclasses.field(default=(), compare=False, repr=False)

    @functools.cached_property
    def producers(self) -> dict[int, int]:
        """Value id -> index of the node that makes it (absent for inputs)."""
        return {v: n.index for n in self.nodes for v in n.outputs}

    @functools.cached_property
    def consumers(self) -> dict[int, tuple[int, ...]]:
        """Value id -> indices of the nodes that read it, in program order."""
        out: dict[int, list[int]] = {}
        get = out.get
        for n in self.nodes:
            index = n.index
            for v in n.inputs:
                readers = get(v)
                if readers is None:
                    out[v] = [index]
                elif readers[-1] != index:  # a value read twice by one node counts once
                    readers.append(index)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def constant(self) -> frozenset[int]:
        """Values computed from constants, literals and dims alone, outside control flow:
        no argument is read. XLA folds them into their consumers, and a concrete trace of
        the same step may hold them as literals where a symbolic one computes them."""
        inputs, producers = set(self.inputs), self.producers
        out: set[int] = set()
        for n in self.nodes:  # program order is topological: one pass
            # Constants and literals enter the set where they are first read (only their
            # own id decides), so the set holds every operand that is constant by then.
            for v in n.inputs:
                if v not in producers and v not in inputs:
                    out.add(v)
            if n.kind != "control" and not n.subgraphs and out.issuperset(n.inputs):
                out.update(n.outputs)
        return frozenset(out)

    def __repr__(self) -> str:
        return (f"Graph({len(self.nodes)} nodes, {len(self.values)} values, "
                f"{len(self.inputs)} inputs, {len(self.outputs)} outputs)")
