"""XLA CPU's YNN library fusions that grow from a row reduction.

XLA's CPU backend (``LibraryRewriter``) hands a reduction over the last dim with at
least :data:`YNN_MIN_ROWS` outputs to its YNN library and grows that fusion up
through producers whose every reader it already holds. In attention's backward
pass this takes in the ``dP = dO @ V^T`` matmul: softmax's VJP reads ``dP`` only
in element-wise ops that end in the row sum ``sum(dP * P)``, so ``dP`` is computed
inside the fusion and never gets a buffer (measured, jax 0.10.2: the plain GPT's
attention backward at (4, 256) and (8, 512), four heads, but not at (4, 128), whose
row sums have 2048 outputs). A size threshold in the dims makes the buffer a
``Piecewise`` step: full size below it, none from it on (:func:`row_fused_dots`).

The same fusions read a vector they multiply by (a norm's scale) as a full-size
broadcast, which XLA's CSE shares between the forward and backward passes: a buffer
from the threshold on. A fusion that holds a dot also takes in the element-wise ops
before it whose every reader it holds (the last layer's gelu before the final norm),
and reads their shared scalar constants as full-size buffers (both in
:mod:`jaxmem.memory.ynn_operands`). Readers are counted as XLA's CSE leaves
them: two that compute the same op on the same inputs are one.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory.fusion import materialised
    >>> def softmax_vjp(dout, v, p):  # dP = dout @ v^T, then sum(dP * P) per row
    ...     dp = dout @ v.T
    ...     return (dp - (dp * p).sum(-1, keepdims=True)) * p
    >>> args = [jax.ShapeDtypeStruct((8192, 64), jnp.float32)] * 2 + [
    ...     jax.ShapeDtypeStruct((8192, 8192), jnp.float32)]
    >>> g = build_graph(jax.make_jaxpr(softmax_vjp)(*args))
    >>> list(row_fused_dots(g, materialised(g)).values())
    [0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.fusion import used_nodes
from jaxmem.memory.library import LIBRARY_ELEMENTWISE, below_rows

#: A row sum's fusion: (reduction node, fused nodes, dot results, prologue nodes).
RowFusion = tuple[int, set[int], list[int], set[int]]

def _summed_axes(graph: Graph, node_index: int) -> tuple[int, ...] | None:
    node = graph.nodes[node_index]
    if node.primitive != "reduce_sum" or not node.inputs:
        return None
    return tuple(dict(node.params).get("axes", ()))


def is_row_sum(graph: Graph, node_index: int) -> bool:
    axes = _summed_axes(graph, node_index)
    if axes is None:
        return False
    x = graph.values[graph.nodes[node_index].inputs[0]]
    return (x.dtype == "float32" and axes == (len(x.shape) - 1,)
            and x.shape[-1] != 1)


def _is_view_sum(graph: Graph, node_index: int) -> bool:
    """A sum over dims of size 1: XLA's simplifier makes it a reshape."""
    axes = _summed_axes(graph, node_index)
    shape = graph.values[graph.nodes[node_index].inputs[0]].shape if axes else ()
    return bool(axes) and all(shape[a] == 1 for a in axes)


#: Ops a row sum's YNN fusion grows through: the library's element-wise table, and the
#: jaxpr ops XLA sees as an add or a view. A ``select_n`` (a mask) ends it. A convert
#: is taken too, and a dot reached through one is inside (measured, session 21: the bf16
#: GPT's softmax backward ``dP``, bf16 then converted, has no buffer at (4, 256) or
#: (8, 512), levels 0, 8 and 10; its last layer's MLP joins ``ln_f``'s fusion).
YNN_ELEMENTWISE = (LIBRARY_ELEMENTWISE - {"convert_element_type"}) | {
    "add_any", "broadcast_in_dim", "reshape"}


def row_fused_dots(graph: Graph, owner: Mapping[int, int], used: Sequence[bool] | None = None,
                   fusions: list[RowFusion] | None = None) -> dict[int, sympy.Expr]:
    """Dot results a row reduction's YNN fusion computes: value id -> the factor of its
    buffer's bytes (:func:`below_rows` of the reduction's outputs).

    Each row sum's fusion grows down from its result through single-reader ops YNN
    fuses (softmax's VJP: the sum's negation, broadcast and ``add_any`` back into the
    row), then up through producers of the reduced shape whose every reader it holds,
    within ``hops`` steps each way. A LayerNorm's input cotangent also feeds the
    scale's and bias's column sums, so its dot keeps its buffer (XLA's dumps agree).
    The element-wise prologue of a fused dot (:func:`_prologue`) is computed inside
    the fusion too.
    """
    out: dict[int, sympy.Expr] = {}
    fusions = row_fusions(graph, used) if fusions is None else fusions
    for reduction, _, dots, chain in fusions:
        rows = sympy.Mul(*graph.values[graph.nodes[reduction].outputs[0]].shape)
        computed = [*dots, *(graph.nodes[ni].outputs[0] for ni in chain)]
        for v in computed:
            if owner.get(v, v) == v and v not in graph.outputs:
                out[v] = below_rows(rows)
    return out


def row_fused_sizes(graph: Graph, owner: Mapping[int, int], widened: Mapping[int, sympy.Expr],
                    backend: str, fusions: list[RowFusion]) -> dict[int, sympy.Expr]:
    """Buffer bytes of the dots :func:`row_fused_dots` finds on ``backend`` (only XLA's CPU
    backend has YNN) in ``fusions`` (:func:`row_fusions`); ``widened``: sizes other rules
    already changed."""
    if backend != "cpu":
        return {}
    return {v: sympy.expand(widened.get(v, graph.values[v].nbytes) * factor)
            for v, factor in row_fused_dots(graph, owner, fusions=fusions).items()}


def centred_values(graph: Graph, owner: Mapping[int, int], used: Sequence[bool],
                   fusions: list[RowFusion]) -> dict[int, int]:
    """A mean's ``x - mean`` that its row sum's fusion ends in: value -> the buffer holding it.

    The fusion grows down from the mean through the ``sub``, whose readers (the
    variance, the normalised output, the backward pass) are elsewhere, so XLA writes it
    to a buffer, where :func:`~jaxmem.memory.fusion.materialised` recomputes it in each
    reader from ``x`` (measured, jax 0.10.2: a LayerNorm's ``ynn_fusion`` of ``f32[16,
    1000, 64]``, and the dot before it when one is fused in; at 1000 rows too, as a loop
    fusion). The jaxpr's second ``x - mean`` (for the output) is the same op to XLA's
    CSE, so it reads the same buffer.
    """
    out: dict[int, int] = {}
    for reduction, fused, _, _ in fusions:
        shape = graph.values[graph.nodes[reduction].inputs[0]].shape
        for ni in fused:
            node = graph.nodes[ni]
            v = node.outputs[0]
            if (node.primitive != "sub" or owner.get(v, v) != -1 or graph.values[v].shape != shape
                    or all(u in fused for u in graph.consumers.get(v, ()) if used[u])):
                continue
            out[v] = v
            twins = {u for x in node.inputs for u in graph.consumers.get(x, ())
                     if u != ni and used[u] and _same_op(graph, u, ni)}
            out.update({graph.nodes[u].outputs[0]: v for u in twins})
    return out


def centring_chains(graph: Graph, owner: Mapping[int, int], fusions: list[RowFusion]
                    ) -> set[int]:
    """The nodes a row fusion runs on its way to the centred value it writes
    (:func:`centred_values`): the mean's reduction and the ops from it to ``x - mean``.

    The fusion is one instruction of XLA's schedule (measured, jax 0.10.2: a LayerNorm's
    ``ynn_fusion`` reduces, scales and subtracts), so :func:`~jaxmem.memory.schedule.
    xla_order` runs these with the centred value, not each on a turn of its own (a
    scanned bf16 GPT's backward body rebuilt its norms two turns late, -7.6 % at (8, 512)
    on its level 2 before)."""
    out: set[int] = set()
    for reduction, fused, _, _ in fusions:
        below, frontier = {reduction}, [reduction]  # the fusion's chain down from its sum
        while frontier:
            for v in graph.nodes[frontier.pop()].outputs:
                for c in graph.consumers.get(v, ()):
                    if c in fused and c not in below:
                        below.add(c)
                        frontier.append(c)
        centred = {ni for ni in below if graph.nodes[ni].primitive == "sub"  # and CSE twins
                   and owner.get(graph.nodes[ni].outputs[0], -1) != -1}
        if centred:
            out |= below - centred
    return out


def _same_op(graph: Graph, a: int, b: int) -> bool:
    """Whether nodes ``a`` and ``b`` compute the same value, which XLA's CSE makes one op
    (a LayerNorm's ``x - mean`` is written twice, for the variance and the output)."""
    na, nb = graph.nodes[a], graph.nodes[b]
    if na.primitive != nb.primitive or na.inputs != nb.inputs or na.params != nb.params:
        return False
    lits = lambda n: [repr(getattr(x, "val", None)) for x in n.eqn.invars] if n.eqn else []  # noqa: E731
    return lits(na) == lits(nb)


def _all_fused(graph: Graph, v: int, fused: set[int], used: Sequence[bool]) -> bool:
    """Whether every used reader of ``v`` is in ``fused``, or the same op as one that is."""
    readers = [u for u in graph.consumers.get(v, ()) if used[u]]
    inside = [u for u in readers if u in fused]
    return bool(inside) and all(u in fused or any(_same_op(graph, u, f) for f in inside)
                                for u in readers)


def _row_fusion(graph: Graph, reduction: int, hops: int, used: Sequence[bool]
                ) -> tuple[set[int], list[int]]:
    """The nodes of the YNN fusion grown from row sum ``reduction`` and the dot results
    inside it (whose own operands are the fusion's parameters)."""
    consumers, producers, nodes = graph.consumers, graph.producers, graph.nodes
    fuses = lambda ni: (nodes[ni].primitive in YNN_ELEMENTWISE  # noqa: E731
                        or _is_view_sum(graph, ni))
    fused = {reduction}
    outs = [nodes[reduction].outputs[0]]
    for _ in range(hops):  # down through one reader (or copies of one op, XLA's CSE)
        users = [u for v in outs for u in consumers.get(v, ()) if used[u]]
        if not users or not fuses(users[0]) or not all(
                _same_op(graph, u, users[0]) for u in users[1:]):
            break
        fused.update(users)
        outs = [nodes[u].outputs[0] for u in users]
    shape = graph.values[nodes[reduction].inputs[0]].shape
    dots: dict[int, None] = {}
    for _ in range(hops):  # to a fixpoint: a producer joins once all its readers have
        grown = False
        for ni in list(fused):
            for x in nodes[ni].inputs:
                p = producers.get(x)
                if (p is None or p in fused or graph.values[x].shape != shape
                        or len(nodes[p].outputs) != 1 or not _all_fused(graph, x, fused, used)):
                    continue
                if nodes[p].primitive == "dot_general":
                    dots[x] = None
                    continue
                if not fuses(p) and nodes[p].primitive != "convert_element_type":
                    continue
                fused.add(p)
                grown = True
        if not grown:
            break
    return fused, list(dots)


def _prologue(graph: Graph, dot: int, fused: set[int], used: Sequence[bool], hops: int = 16
              ) -> set[int]:
    """The element-wise ops before a fused dot that join its YNN fusion: producers of its
    operands whose every reader is in the fusion (gelu's chain before the MLP's second
    matmul, where the backward pass recomputes it)."""
    nodes, producers = graph.nodes, graph.producers
    members = fused | {dot}
    chain: set[int] = set()
    for _ in range(hops):  # to a fixpoint, as the fusion itself grows
        grown = False
        for ni in [dot, *chain]:
            for x in nodes[ni].inputs:
                p = producers.get(x)
                if (p is None or p in chain or nodes[p].primitive not in LIBRARY_ELEMENTWISE
                        or len(nodes[p].outputs) != 1
                        or graph.values[x].dtype not in ("float32", "bfloat16")
                        or not _all_fused(graph, x, members | chain, used)):
                    continue
                chain.add(p)
                grown = True
        if not grown:
            break
    return chain


def row_fusions(graph: Graph, used: Sequence[bool] | None, backend: str = "cpu", hops: int = 8
                ) -> list[RowFusion]:
    """Each used row sum's YNN fusion on ``backend`` (none off XLA's CPU): ``(reduction,
    fused nodes, dot results, prologue nodes)``; one list serves :func:`row_fused_sizes`
    and :func:`row_fusion_extras`."""
    if backend != "cpu":
        return []
    used = used_nodes(graph) if used is None else used
    out = []
    for node in graph.nodes:
        if node.primitive == "reduce_sum" and used[node.index] and is_row_sum(graph, node.index):
            fused, found = _row_fusion(graph, node.index, hops, used)
            chain: set[int] = set()
            for d in found:
                chain |= _prologue(graph, graph.producers[d], fused, used)
            out.append((node.index, fused, found, chain))
    return out
