"""Which dot operands XLA's CPU backend copies into another layout, and when.

XLA canonicalises every dot to row-major ``[batch, M, K] x [batch, K, N]``; an operand
laid out otherwise is copied first (:func:`copied_operands`: a weight gradient's
``x.T @ dy`` copies ``x``), as soon as the operand is written (:func:`copy_start`).
Attention heads split off a projection are copied from the projection itself
(:func:`head_projection`). :func:`jaxmem.memory.fusion.transposed_copies` turns these
into buffers, and :func:`copied_early` tells which operands die once copied.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(jax.make_jaxpr(lambda x, w: jnp.einsum("bsd,bsf->df", x, w))(
    ...     jnp.ones((2, 4, 8)), jnp.ones((2, 4, 16))))
    >>> dot, = (n for n in g.nodes if n.primitive == "dot_general")
    >>> copied_operands(g, dot, {}) == [dot.inputs[0]]  # x.T @ dy: x is copied
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxmem.graph import Graph, Node


def _canonical_dot_operands(dims: tuple, ranks: tuple[int, int]) -> tuple[bool, bool]:
    """Whether XLA's CPU dot can read each operand as laid out (row-major).

    XLA canonicalises every dot to ``[batch, M, K] x [batch, K, N]`` with
    row-major operands (``DotDecomposer``, CPU layout assignment); the CPU
    library also takes the right operand as ``[batch, N, K]`` when N is one dim. An
    operand whose batch dims are not leading, or whose contracting dims are elsewhere,
    is first copied into that order (measured: ``x @ x.T`` needs no copy, the weight
    gradient ``x.T @ dy`` copies ``x``).
    """
    (lc, rc), (lb, rb) = dims
    nb = len(lb)
    lhs_ok = (tuple(lb) == tuple(range(nb))
              and tuple(lc) == tuple(range(ranks[0] - len(lc), ranks[0])))
    # The right operand may also come as [batch, N, K] (the library takes it transposed),
    # but only with one free dim N: GQA's probabilities [b, k, g, q, s], read contracting
    # s, are copied to [batch, K, N] first (measured, jax 0.10.2).
    nk = (tuple(range(ranks[1] - len(rc), ranks[1])),) if ranks[1] - nb - len(rc) == 1 else ()
    rhs_ok = (tuple(rb) == tuple(range(nb))
              and tuple(rc) in (tuple(range(nb, nb + len(rc))), *nk))
    return lhs_ok, rhs_ok


def dot_copies(graph: Graph, owner: dict[int, int], used: Sequence[bool] | None = None
               ) -> list[tuple[int, int]]:
    """The ``(dot node, operand)`` pairs XLA reads through a transposed copy
    (:func:`copied_operands`), dots in program order; a dead dot (``used``: XLA removes
    it) reads none."""
    return [(ni, v) for ni, node in enumerate(graph.nodes)
            if node.primitive == "dot_general" and (used is None or used[ni])
            for v in copied_operands(graph, node, owner)]


def copied_operands(graph: Graph, node: Node, owner: Mapping[int, int]) -> list[int]:
    """The operands of dot ``node`` XLA copies into the layout it reads (see
    ``_canonical_dot_operands``), each seen through a transpose folded into the dot.
    A matrix (two dims once the size-1 ones go) is read transposed in place: an MLP's
    ``[b, d]`` weight-gradient operands get no copy (measured, jax 0.10.2), where a
    ``[b, s, d]`` one, whose two contracting dims XLA merges first, does."""
    params = dict(node.params)
    if "dimension_numbers" not in params or len(node.inputs) != 2:
        return []
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, lc, lb = _through_transpose(graph, owner, node.inputs[0], lc, lb)
    rhs, rc, rb = _through_transpose(graph, owner, node.inputs[1], rc, rb)
    vals = [graph.values[lhs], graph.values[rhs]]
    (lc, lb, lr), (rc, rb, rr) = (_without_unit_dims(vals[0].shape, lc, lb),
                                  _without_unit_dims(vals[1].shape, rc, rb))
    ok = _canonical_dot_operands(((lc, rc), (lb, rb)), (lr, rr))
    return [v.id for v, fine, rank in zip(vals, ok, (lr, rr), strict=True)
            if not fine and rank >= 3 and not _laid_out_for(graph, owner, v.id, node)]


def _laid_out_for(graph: Graph, owner: Mapping[int, int], v: int, dot: Node) -> bool:
    """Whether ``v`` is a transpose's own buffer that ``dot`` is its only dot reader: XLA's
    layout assignment has the transpose write the layout the dot reads (per-example
    weight gradients under ``vmap``, transposed batch-first, summed and averaged by an
    einsum: one ``copy`` of each, not a transpose and a copy of it)."""
    p = graph.producers.get(v)
    if p is None or graph.nodes[p].primitive != "transpose" or owner.get(v, v) != v:
        return False
    dots = [c for c in graph.consumers.get(v, ()) if graph.nodes[c].primitive == "dot_general"]
    return dots == [dot.index]


def _without_unit_dims(shape: tuple, contracting: tuple, batch: tuple
                       ) -> tuple[tuple, tuple, int]:
    """A dot operand's dims with its size-1 dims dropped (XLA bitcasts them away):
    Flax NNX's scanned attention has probabilities ``[1, b, h, s, s]``, whose batch
    dims are canonical once the leading 1 goes (XLA copies none of them for ``dV``)."""
    keep = {d: k for k, d in enumerate(i for i, n in enumerate(shape) if n != 1)}
    return (tuple(keep[d] for d in contracting if d in keep),
            tuple(keep[d] for d in batch if d in keep), len(keep))


def merged_operands(graph: Graph, node: Node) -> tuple[bool, bool]:
    """Per operand of dot ``node``, whether XLA merges its dims to read it as a matrix
    (more than one free or contracting dim once the size-1 dims go)."""
    (lc, rc), (lb, rb) = dict(node.params)["dimension_numbers"]
    out = []
    for v, c, b in ((node.inputs[0], lc, lb), (node.inputs[1], rc, rb)):
        c, b, rank = _without_unit_dims(graph.values[v].shape, c, b)
        out.append(len(c) > 1 or rank - len(b) - len(c) > 1)
    return out[0], out[1]


def copy_start(graph: Graph, pos: dict[int, int], v: int, first_dot: int) -> int:
    """Where XLA makes the transposed copy of dot operand ``v`` (first read at ``first_dot``).

    XLA's breadth-first CPU scheduler runs the copy as soon as its operand is
    written, not at the dot, which waits in the queue behind it: the cotangent
    copies of a Llama's MLP weight gradients live through its backward MLP (llama
    2x256 at (4, 128), level 0: -5.2 % against XLA with the copy at the dot, -3.3 %
    from its operand). A slice (or a gather at constant indices) XLA fuses into the
    copy, made from the sliced source at the dot; a view (an optimization barrier's
    output) keeps the copy at the dot as before.
    """
    prod = graph.producers.get(v)
    if prod is None:
        return 0
    if prod not in pos:
        return first_dot
    node = graph.nodes[prod]
    if node.primitive == "reshape":
        head = head_projection(graph, node)
        src = graph.producers.get(head) if head is not None else None
        return first_dot if src not in pos else max(pos[src], pos[prod]) + 1
    if node.kind not in ("elementwise", "opaque") or node.primitive in ("gather", "slice"):
        return first_dot
    return pos[prod] + 1


def is_head_split(graph: Graph, node: Node) -> bool:
    """Whether ``node`` reshapes a dot's output (attention heads split off a projection):
    XLA copies the projection into each layout its dots read as soon as it is written
    (bench.unseen's gradient accumulation: the q/k/v projections then die; level 2 +15.0
    -> +3.5 %). Heads made by an elementwise op (a Llama's rotary ``add``) are not."""
    return head_projection(graph, node) is not None


def head_projection(graph: Graph, node: Node) -> int | None:
    """The dot output reshape ``node`` splits into heads (:func:`is_head_split`), through
    further reshapes, a ``split`` of a fused q/k/v projection and, where ``jnp.repeat``
    shares key/value heads among query heads (grouped-query attention), the broadcast;
    XLA fuses the split and the broadcast into the copies. Else None."""
    if node.primitive != "reshape" or not node.inputs:
        return None
    v = node.inputs[0]
    for _ in range(4):
        src = graph.producers.get(v)
        if src is None:
            return None
        prim = graph.nodes[src].primitive
        if prim == "dot_general":
            return v
        if prim not in ("reshape", "broadcast_in_dim", "split") or not graph.nodes[src].inputs:
            return None  # (a broadcast of a literal has no operand)
        v = graph.nodes[src].inputs[0]
    return None


def _through_transpose(graph: Graph, owner: Mapping[int, int], v: int, contracting: tuple,
                       batch: tuple) -> tuple[int, tuple, tuple]:
    """A dot operand and its dims, seen through a transpose folded into the dot."""
    p = graph.producers.get(v)
    if p is None or owner.get(v, v) != -1 or graph.nodes[p].primitive != "transpose":
        return v, tuple(contracting), tuple(batch)
    perm = dict(graph.nodes[p].params).get("permutation")
    if perm is None or not graph.nodes[p].inputs:
        return v, tuple(contracting), tuple(batch)
    return (graph.nodes[p].inputs[0], tuple(perm[i] for i in contracting),
            tuple(perm[i] for i in batch))


def copied_early(graph: Graph, order: Sequence[int], owner: dict[int, int],
                 used: list[bool], copies: Sequence[Any], copied: set[tuple[int, int]],
                 upcast: frozenset[int]) -> tuple[dict[int, int], set[tuple[int, int]]]:
    """For the transposed copies made as soon as their operand is written, or read by an
    ``upcast`` dot (run in float32: the convert is the copy, and a bf16 decoder's heads die
    once it is made): the buffer each copy reads (heads split off a projection: the
    projection's), and the ``(dot, operand)`` reads of operands only they read."""
    pos = {n: p for p, n in enumerate(order)}
    prods = graph.producers
    early = {x.value for x in copies
             if x.value in prods and x.start == pos[prods[x.value]] + 1
             and graph.nodes[prods[x.value]].primitive != "concatenate"}
    heads = {v: head_projection(graph, graph.nodes[prods[v]]) for v in early}
    base = {v: h for v, h in heads.items() if h is not None}
    return base, _only_copied(graph, owner, used, {(ni, base.get(v, v)) for ni, v in copied
                                                   if v in early or ni in upcast})


def _only_copied(graph: Graph, owner: dict[int, int], used: Sequence[bool],
                 copied: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The copied reads of operands no op reads in place: XLA frees such an operand once
    its copies are made (an MoE's expert activations, copied for the forward and the
    weight-gradient dot alike). Only copies made as soon as their operand is written
    (``copied``) count. An operand also read in place keeps its own life, and so does a
    sliced one (its copy is made at the dot, from the slice's source), and a concatenate
    (rotary q and k): freeing those early under-predicts the GPTs (level 0 at (4, 128):
    +1.6 -> -4.8 %, the q/k/v heads) and bench.unseen's dropout step (deepest -17.5 %)."""
    targets = {v for _, v in copied}  # only their readers matter (most graphs: none)
    readers = {s: _readers(graph, owner, used, s) for s in targets}
    return {(ni, v) for ni, v in copied if all((r, v) in copied for r in readers[v])}


def _readers(graph: Graph, owner: dict[int, int], used: Sequence[bool], s: int) -> set[int]:
    """The live ops that read buffer ``s``: through its views and the values fused from it
    (a walk forward from ``s``: the pass over every node's inputs it replaces was a sixth
    of a 22-layer model's liveness). A split computed inside head copies reads nothing."""
    nodes, consumers = graph.nodes, graph.consumers
    found: set[int] = set()
    seen, frontier = {s}, [s]
    while frontier:
        for c in consumers.get(frontier.pop(), ()):
            n = nodes[c]
            inside = n.primitive == "split" and all(owner.get(o, o) == -1 for o in n.outputs)
            if used[c] and not is_head_split(graph, n) and not inside:  # (heads: read the dot's)
                found.add(c)
            for o in n.outputs:  # a view of ``s``, or a value computed from it in place
                if o not in seen and owner.get(o, o) in (s, -1):
                    seen.add(o)
                    frontier.append(o)
    return found
