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


#: Reductions that start a library fusion (``IsReduceOpSupportedByYnn``: add, max, min).
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
#: A reduction over fewer input elements stays in XLA's own code (measured, jax 0.10.2:
#: ``tanh(x @ w).sum()`` over 2048 elements is a dot fusion and a loop fusion, over 4096
#: one library fusion, whatever the axes).
LIBRARY_MIN_REDUCED = 4096
#: Views a reduction's library fusion grows through (bitcasts in HLO; ``stop_gradient`` is
#: the identity).
_FUSED_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "stop_gradient"})


def reduction_fusions(graph: Graph, used: Sequence[bool]) -> list[frozenset[int]]:
    """The nodes of each float32 reduction's library fusion that holds a dot.

    XLA's CPU ``LibraryRewriter`` starts a fusion at each reduction over at least
    :data:`LIBRARY_MIN_REDUCED` elements and grows it through the ops it supports (the
    library's elementwise ops, and dots) whose readers it all holds
    (:func:`_reduction_region`). In a forward-only step (an eval loss:
    ``mean((tanh(x @ w1) @ w2 - y) ** 2)``, a log-softmax's row max over the logits and
    the layers before them) one fusion computes a chain of matmuls with no intermediate
    buffer (:func:`reduction_fused`), reading the scalar constants other ops share as
    full-size buffers (:func:`reduction_constants`). A train step keeps its activations
    for the backward pass, so its fusions stop at the first value read twice; fusions
    without a dot change nothing the elementwise rules do not already give.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxmem.graph import build_graph
        >>> g = build_graph(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w).sum())(
        ...     jnp.ones((64, 64)), jnp.ones((64, 64))))
        >>> regions = reduction_fusions(g, [True] * len(g.nodes))
        >>> sorted(g.nodes[g.producers[v]].primitive for v in reduction_fused(g, regions))
        ['dot_general', 'tanh']
    """
    out: list[frozenset[int]] = []
    seen: set[int] = set()
    for node in reversed(graph.nodes):  # XLA starts from the program's end
        if (node.primitive in _REDUCTIONS and used[node.index] and node.index not in seen
                and node.inputs and graph.values[node.inputs[0]].dtype == "float32"
                and not _fewer(element_count(graph, node.inputs[0]), LIBRARY_MIN_REDUCED)):
            region = _reduction_region(graph, node)
            seen |= region
            if any(graph.nodes[n].primitive == "dot_general" for n in region):
                out.append(frozenset(region))
    return out


def reduction_fused(graph: Graph, regions: Sequence[frozenset[int]]) -> frozenset[int]:
    """Values computed inside :func:`reduction_fusions`' fusions: no buffer of their own
    (the fusion's result is the reduction's, or the last op of the chain after it)."""
    outputs = set(graph.outputs)
    return frozenset(o for r in regions for n in r for o in graph.nodes[n].outputs
                     if o not in outputs
                     and all(c in r for c in graph.consumers.get(o, ())))


def _reduction_region(graph: Graph, seed: Node) -> set[int]:
    """The reduction and the ops its library fusion takes in: down the chain of single
    readers after it (``logits - max``), then up through every producer whose readers it
    all holds, again until nothing joins (the logits' dot, once both its readers are in)."""
    consumers, producers, nodes = graph.consumers, graph.producers, graph.nodes
    region = {seed.index}
    out = seed.outputs[0]
    while len(consumers.get(out, ())) == 1:
        c = nodes[consumers[out][0]]
        if c.primitive == "dot_general" or not (
                _library_op(graph, c) or c.primitive == "broadcast_in_dim"):
            break
        region.add(c.index)
        out = c.outputs[0]
    grown = True
    while grown:
        grown = False
        for v in {i for ni in region for i in nodes[ni].inputs}:
            p = producers.get(v)
            if (p is not None and p not in region and _library_op(graph, nodes[p])
                    and all(c in region for c in consumers.get(v, ()))):
                region.add(p)
                grown = True
    return region


def _library_op(graph: Graph, node: Node) -> bool:
    """An op a reduction's library fusion takes in: float32 results of the library's
    elementwise ops, views, and dots of float32 operands read as laid out."""
    if len(node.outputs) != 1 or graph.values[node.outputs[0]].dtype != "float32":
        return False
    if node.primitive in LIBRARY_ELEMENTWISE or node.primitive in _FUSED_VIEWS:
        return True
    if node.primitive != "dot_general" or len(node.inputs) != 2:
        return False
    (lc, rc), (lb, rb) = dict(node.params).get("dimension_numbers", ((None, None), (None, None)))
    if lc is None:
        return False
    ranks = [len(graph.values[v].shape) for v in node.inputs]
    nb = len(lb)
    return (all(graph.values[v].dtype == "float32" for v in node.inputs)
            and tuple(lb) == tuple(rb) == tuple(range(nb))
            and tuple(lc) == tuple(range(ranks[0] - len(lc), ranks[0]))
            and tuple(rc) == tuple(range(nb, nb + len(rc))))


def element_count(graph: Graph, v: int) -> sympy.Expr:
    """Elements of value ``v`` (1 for a scalar)."""
    return sympy.Mul(*graph.values[v].shape) if graph.values[v].shape else sympy.Integer(1)


def _fewer(count: sympy.Expr, bound: int) -> bool:
    """Whether ``count`` is below ``bound`` for certain (a symbolic count is taken as
    large: below the bound every buffer involved is under 16 KiB)."""
    count = sympy.sympify(count)
    return bool(count.is_number and count < bound)


def constant_operands(graph: Graph, node: Node, fold: bool = True) -> list[tuple]:
    """``(constant, shape, itemsize)`` of each scalar constant elementwise ``node`` reads at
    its own shape: a literal operand, or an operand broadcast from one."""
    if (not node.outputs or node.kind != "elementwise"
            or node.primitive in ("broadcast_in_dim", "pad", "concatenate")):
        return []
    out = graph.values[node.outputs[0]]
    if not out.shape:
        return []
    itemsize = out.nbytes / sympy.Mul(*out.shape)
    atoms = list(node.eqn.invars) if node.eqn is not None else []
    for v in node.inputs:
        p = graph.producers.get(v)
        b = graph.nodes[p] if p is not None else None
        if b is not None and b.primitive == "broadcast_in_dim" and not b.inputs and b.eqn:
            atoms.append(b.eqn.invars[0])
    if fold and node.primitive in ("mul", "div") and any(_scaled(graph, v) for v in node.inputs):
        return []  # XLA's simplifier folds c1 * (c2 * x) into one constant
    keys = []
    for atom in atoms:
        val = getattr(atom, "val", None)
        if val is not None and getattr(val, "shape", ()) == ():
            keys.append((float(val), out.shape, itemsize))
    return keys


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
