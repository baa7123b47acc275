"""Which pooling windows XLA's CPU backend hands to its library (YNN), and what fuses with them.

XLA's CPU ``LibraryRewriter`` runs a ``reduce-window`` that tiles its input (every
window dim of size > 1 strides by its size, no dilation: ``avg_pool``, ``max_pool``;
``ynn_support.cc``: ``IsReduceLikeOpSupportedByYnn``) as one library fusion. The fusion
grows up through elementwise producers all of whose readers it already holds, and down
through a chain of single readers. Inside it nothing is materialised; what it reads
from outside is (a producer shared with another reader, such as the pre-ReLU value
the ReLU's gradient reads again, gets its own buffer). :func:`pooling_fusions` gives
:func:`jaxmem.memory.fusion.materialised` both sets;
:func:`jaxmem.memory.windows.window_broadcasts` the constant operands such a fusion reads.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> pool = lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1),
    ...                                         (1, 2, 2, 1), "VALID")
    >>> g = build_graph(jax.make_jaxpr(lambda x: pool(jnp.tanh(x)) + x.sum())(
    ...     jnp.ones((2, 8, 8, 4))))
    >>> fused, kept = pooling_fusions(g)
    >>> [g.nodes[g.producers[v]].primitive for v in fused], sorted(kept)
    (['tanh'], [])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import sympy

from jaxmem.graph import Graph, Node

# Elementwise primitives the CPU library fuses (``ynn_support.cc``: its unary and binary
# operator tables); a fusion grows through no other.
LIBRARY_ELEMENTWISE = frozenset("""
abs ceil convert_element_type cos erf exp expm1 floor log log1p logistic neg round rsqrt
sign sin sqrt tanh tan add div max min mul pow sub integer_pow square
""".split())
_WINDOWS = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min"})
_LIBRARY_DTYPES = frozenset({"float32", "float64"})


def library_window(graph: Graph, node: Node) -> bool:
    """Whether XLA's CPU library runs this window (``IsReduceLikeOpSupportedByYnn``)."""
    if node.primitive not in _WINDOWS:  # before dict(params): most nodes are no window
        return False
    params = dict(node.params)
    if "window_dimensions" not in params or not node.inputs:
        return False
    if graph.values[node.inputs[0]].dtype not in _LIBRARY_DTYPES:
        return False
    dims, strides = params["window_dimensions"], params["window_strides"]
    tiled = [(d, s) for d, s in zip(dims, strides, strict=True) if d > 1 or s > 1]
    return (bool(tiled) and all(d == 1 or d == s for d, s in tiled)
            and all(x == 1 for x in (*params["base_dilation"], *params["window_dilation"])))


def pooling_region(graph: Graph, window: Node) -> set[int]:
    """The window and the elementwise ops XLA's library fuses with it: producers whose
    every reader is in the fusion, then the chain of single readers after it."""
    consumers, producers, nodes = graph.consumers, graph.producers, graph.nodes
    region = {window.index}
    frontier = [window.inputs[0]]
    while frontier:
        v = frontier.pop()
        p = producers.get(v)
        if (p is None or nodes[p].primitive not in LIBRARY_ELEMENTWISE
                or not all(c in region for c in consumers.get(v, ()))):
            continue
        region.add(p)
        frontier.extend(nodes[p].inputs)
    out = window.outputs[0]
    while len(consumers.get(out, ())) == 1:
        c = nodes[consumers[out][0]]
        if c.primitive not in LIBRARY_ELEMENTWISE or not c.outputs:
            break
        region.add(c.index)
        out = c.outputs[0]
    return region


def pooling_fusions(graph: Graph) -> tuple[frozenset[int], frozenset[int]]:
    """``(fused, kept)``: values computed inside a library pooling fusion before its window
    (no buffer), and elementwise values such a fusion reads from outside (a buffer of
    their own, even where XLA would otherwise recompute them in each reader). Broadcast
    constants are not kept here (see :func:`jaxmem.memory.windows.window_broadcasts`)."""
    nodes, producers, outputs = graph.nodes, graph.producers, set(graph.outputs)
    fused: set[int] = set()
    kept: set[int] = set()
    for w in nodes:
        if not library_window(graph, w):
            continue
        region = pooling_region(graph, w)
        for ni in region:
            n = nodes[ni]
            if ni < w.index:
                fused.update(o for o in n.outputs if o not in outputs)
            for v in n.inputs:
                p = producers.get(v)
                if (p is not None and p not in region and nodes[p].kind == "elementwise"
                        and nodes[p].primitive not in ("broadcast_in_dim", "iota")):
                    kept.add(v)
    return frozenset(fused), frozenset(kept - fused)


def element_count(graph: Graph, v: int) -> sympy.Expr:
    """Elements of value ``v`` (1 for a scalar)."""
    return sympy.Mul(*graph.values[v].shape) if graph.values[v].shape else sympy.Integer(1)


def itemsize(graph: Graph, v: int) -> sympy.Expr:
    """Bytes per element of value ``v`` (0 in host memory). A size over a shape such as
    ``(b, s - 1)`` is held expanded (``4*b*s - 4*b``), which sympy does not divide by the
    unexpanded element count on its own."""
    q = graph.values[v].nbytes / element_count(graph, v)
    return q if q.is_Number else sympy.cancel(q)


def constant_operands(graph: Graph, node: Node, fold: bool = True) -> list[tuple]:
    """``(constant, shape, itemsize)`` of each scalar constant elementwise ``node`` reads at
    its own shape: a literal operand, or an operand broadcast from one."""
    if (not node.outputs or node.kind != "elementwise"
            or node.primitive in ("broadcast_in_dim", "pad", "concatenate")):
        return []
    out = graph.values[node.outputs[0]]
    if not out.shape:
        return []
    atoms = list(node.eqn.invars) if node.eqn is not None else []
    for v in node.inputs:
        p = graph.producers.get(v)
        b = graph.nodes[p] if p is not None else None
        if b is not None and b.primitive == "broadcast_in_dim" and not b.inputs and b.eqn:
            atoms.append(b.eqn.invars[0])
    vals = [_scalar(val) for atom in atoms
            if (val := getattr(atom, "val", None)) is not None and getattr(val, "shape", ()) == ()]
    if not vals:  # most ops: nothing below is worth its sympy division
        return []
    if fold and node.primitive in ("mul", "div") and any(_scaled(graph, v) for v in node.inputs):
        return []  # XLA's simplifier folds c1 * (c2 * x) into one constant
    return [(val, out.shape, itemsize(graph, out.id)) for val in vals]


def _scalar(val: object) -> float | complex:
    """A literal as a hashable Python number: complex only where it has an imaginary part
    (a complex rotary's ``1j``), so that ``2.0`` and ``2+0j`` share one key."""
    z = complex(val)
    return z.real if z.imag == 0 else z


def constant_readers(graph: Graph, used: Sequence[bool]) -> dict[tuple, list[int]]:
    """The used nodes reading each :func:`constant_operands` key: where XLA's CSE would
    share one broadcast of that constant at that shape."""
    readers: dict[tuple, list[int]] = {}
    for n in graph.nodes:
        if used[n.index]:
            for key in constant_operands(graph, n):
                readers.setdefault(key, []).append(n.index)
    return readers


def _scaled(graph: Graph, v: int, hops: int = 4) -> bool:
    """Whether ``v`` is a product (or quotient) by a scalar constant, seen through
    broadcasts and reshapes (which XLA's simplifier moves the constant across)."""
    for _ in range(hops):
        p = graph.producers.get(v)
        if p is None:
            return False
        n = graph.nodes[p]
        if n.primitive in ("mul", "div"):
            return bool(constant_operands(graph, n, fold=False))
        if n.primitive not in ("broadcast_in_dim", "reshape") or not n.inputs:
            return False
        v = n.inputs[0]
    return False


#: YNN's ``kMinElements``: a row reduction with fewer outputs stays in XLA's own code.
YNN_MIN_ROWS = 4096


@functools.cache  # a Piecewise takes sympy ~0.4 ms to build; a model asks for few distinct
def _step(rows: sympy.Expr, below: int) -> sympy.Expr:
    """``below`` where a reduction with ``rows`` outputs stays out of YNN, ``1 - below``
    where YNN takes it."""
    rows = sympy.sympify(rows)
    if rows.is_number:
        return sympy.Integer(below if rows < YNN_MIN_ROWS else 1 - below)
    return sympy.Piecewise((below, sympy.Lt(rows, YNN_MIN_ROWS)), (1 - below, True))


def below_rows(rows: sympy.Expr) -> sympy.Expr:
    """1 where a reduction with ``rows`` outputs stays out of YNN, 0 where YNN takes it."""
    return _step(rows, 1)


def from_rows(rows: sympy.Expr) -> sympy.Expr:
    """1 where YNN takes a reduction with ``rows`` outputs, 0 where it does not."""
    return _step(rows, 0)
