"""XLA CPU's YNN library fusion of a row reduction with the dot and chain it reads.

XLA's CPU ``LibraryRewriter`` starts a YNN fusion (``kind=kCustom``, ``__ynn_fusion``)
at a reduction and grows it: down through single-user elementwise consumers, up
through producers whose every user is already in the fusion, dots included. A
scalar constant that such a fused op reads is a ``broadcast(constant)`` in HLO; when
XLA's CSE has merged it with the same broadcast elsewhere (every layer's gelu reads
0.5, 1, 0.044715 and sqrt(2/pi)), it has a user outside and is not fused in: it is
materialised full-size (a ``wrapped_broadcast``) and lives, from the start of the
step (it reads no argument; XLA's CPU order is breadth-first), until the fusion runs.
:func:`ynn_constant_broadcasts` adds those buffers.

Measured (jax 0.10.2, CPU), ``y = r + gelu(x) @ w + b; y - y.mean(-1)``: the fusion
grows iff the reduction has at least 4096 outputs (``1 x 4096`` rows grow, ``1 x 4095``
do not, whatever the widths; ``kMinElements`` in XLA's ``ynn_support.cc``); with a
second gelu elsewhere at (8, 512, 1024), four 16 MiB broadcasts appear, none without.
:func:`ynn_fused_sizes` drops the buffers of values the fusion computes inside (the
dot's operand and result). Not modelled: reductions over leading dims (they grew at
every size measured, but read no shared constant in the programs here); operands
XLA's CSE shares with a recomputation in the backward pass (the gelu input and its
square in the plain GPT at (8, 512), 32 MiB there).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> def f(x, w, z):
    ...     y = jax.nn.gelu(x) @ w
    ...     return y - y.mean(-1, keepdims=True), jax.nn.gelu(z)
    >>> x = jnp.ones((4096, 64))
    >>> g = build_graph(jax.make_jaxpr(f)(x, jnp.ones((64, 16)), x))
    >>> sorted({str(e.nbytes) for e in ynn_constant_broadcasts(g, range(len(g.nodes)))})
    ['1048576']
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

from jaxmem.graph import Graph, Node
from jaxmem.memory.fusion import Extra

YNN_MIN_ROWS = 4096  # outputs a reduction needs before its YNN fusion grows (measured)
_REDUCES = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# Elementwise primitives YNN fuses (its unary and binary operator tables).
_YNN_ELEMENTWISE = frozenset({
    "abs", "ceil", "convert_element_type", "cos", "erf", "exp", "expm1", "floor", "log",
    "log1p", "logistic", "neg", "round", "rsqrt", "sign", "sin", "sqrt", "tanh", "tan",
    "add", "div", "max", "min", "mul", "pow", "sub", "integer_pow", "square"})
_YNN_VIEWS = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})


def _fusible(node: Node) -> bool:
    return (node.primitive in _YNN_ELEMENTWISE or node.primitive in _YNN_VIEWS
            or node.primitive == "dot_general")


def _rows(graph: Graph, node: Node) -> sympy.Expr:
    shape = graph.values[node.outputs[0]].shape
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def _grow(graph: Graph, start: int, used: Sequence[bool]) -> set[int]:
    """Node indices of the fusion grown from reduction ``start`` (XLA's BFS, to a fixpoint)."""
    nodes, consumers, producers = graph.nodes, graph.consumers, graph.producers
    outputs = set(graph.outputs)
    region = {start}
    changed = True
    while changed:
        changed = False
        for ni in list(region):
            n = nodes[ni]
            users = [u for o in n.outputs for u in consumers.get(o, ()) if used[u]]
            if (len(users) == 1 and users[0] not in region and not outputs & set(n.outputs)
                    and _fusible(nodes[users[0]])):
                region.add(users[0])
                changed = True
            for v in n.inputs:
                p = producers.get(v)
                if p is None or p in region or not _fusible(nodes[p]) or v in outputs:
                    continue
                if all(u in region for u in consumers.get(v, ()) if used[u]):
                    region.add(p)
                    changed = True
    return region


def _literals(node: Node) -> list[tuple[object, str]]:
    """The scalar literals ``node`` reads, as (value, dtype) keys."""
    if node.eqn is None:
        return []
    out = []
    for op, atom in zip(node.operands, node.eqn.invars, strict=False):
        if op is None and hasattr(atom, "val"):
            out.append((repr(atom.val), str(atom.aval.dtype)))
    return out


def _fusions(graph: Graph, used: Sequence[bool]) -> list[tuple[Node, set[int], sympy.Expr]]:
    """(reduction, region, condition that it grows) per grown fusion that holds a dot."""
    out = []
    for r in graph.nodes:
        if r.primitive not in _REDUCES or not used[r.index] or not r.outputs:
            continue
        region = _grow(graph, r.index, used)
        if any(graph.nodes[i].primitive == "dot_general" for i in region):
            out.append((r, region, sympy.Ge(_rows(graph, r), YNN_MIN_ROWS)))
    return out


def ynn_fused_sizes(graph: Graph, owner: dict[int, int],
                    used: Sequence[bool] | None = None) -> dict[int, sympy.Expr]:
    """Buffer bytes of materialised values that a grown YNN fusion computes inside.

    A value made and read only inside the fusion (the dot's operand and result) needs
    no buffer once it grows: ``Piecewise`` zero from :data:`YNN_MIN_ROWS` reduction
    outputs, its own bytes below.
    """
    used = [True] * len(graph.nodes) if used is None else used
    outputs, consumers = set(graph.outputs), graph.consumers
    out: dict[int, sympy.Expr] = {}
    for _, region, grows in _fusions(graph, used):
        for i in region:
            for v in graph.nodes[i].outputs:
                if (owner.get(v, v) == v and v not in outputs and consumers.get(v)
                        and all(u in region for u in consumers[v] if used[u])):
                    out[v] = sympy.Piecewise((0, grows), (graph.values[v].nbytes, True))
    return out


def ynn_constant_broadcasts(graph: Graph, order: Sequence[int],
                            used: Sequence[bool] | None = None) -> list[Extra]:
    """Full-size broadcasts of shared scalar constants read by a grown YNN fusion.

    One buffer per (constant, shape) inside a fusion that also contains a dot, when
    some op outside the fusion reads the same constant at the same shape (XLA's CSE
    then shares the broadcast); from position 0 to the fusion's reduction, of
    ``Piecewise`` size: zero below :data:`YNN_MIN_ROWS` reduction outputs.
    """
    nodes = graph.nodes
    used = [True] * len(nodes) if used is None else used
    pos = {n: p for p, n in enumerate(order)}
    reads: dict[tuple, set[int]] = {}
    for n in nodes:
        if used[n.index] and n.outputs and n.primitive in _YNN_ELEMENTWISE:
            shape = graph.values[n.outputs[0]].shape
            for key in _literals(n):
                reads.setdefault((*key, shape), set()).add(n.index)
    out: list[Extra] = []
    for r, region, grows in _fusions(graph, used):
        if r.index not in pos:
            continue
        seen = set()
        for i in sorted(region):
            n = nodes[i]
            if n.primitive not in _YNN_ELEMENTWISE or not n.outputs:
                continue
            val = graph.values[n.outputs[0]]
            for key in _literals(n):
                k = (*key, val.shape)
                if k in seen or reads[k] <= region:
                    continue
                seen.add(k)
                out.append(Extra(n.outputs[0], sympy.Piecewise((val.nbytes, grows), (0, True)),
                                 0, pos[r.index], "shared constant of a YNN fusion"))
    return out
