"""What XLA materialises: fusion decisions and the buffers XLA adds on its own.

:func:`materialised` decides which values of the graph get a buffer, following
XLA's fusion pass (``InstructionFusion``: cheap elementwise ops are recomputed in
every consumer that can fuse them; expensive ones read twice, and anything an op
needs in memory, are materialised). :func:`transposed_copies` adds the buffers XLA's
CPU backend creates that no jaxpr value names for dot operands it must transpose
(:mod:`jaxmem.memory.epilogues`: those of a dot's fused epilogue).
:mod:`jaxmem.memory.liveness` turns these into live ranges.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> b, = jax.export.symbolic_shape("b")
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.tanh(x * 2).sum())(
    ...     jax.ShapeDtypeStruct((b, 8), jnp.float32)))
    >>> owner = materialised(g)
    >>> [owner[v] for n in g.nodes for v in n.outputs]  # mul and tanh fuse into the sum
    [-1, -1, 3]
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

import sympy

from jaxmem.graph import EXPENSIVE, Graph, Node
from jaxmem.memory.copies import copied_operands, copy_start, dot_copies, head_projection
from jaxmem.memory.fillers import added_updates, sunk_broadcasts
from jaxmem.memory.library import element_count, pooling_fusions
from jaxmem.memory.readers import erfc_shared_exps, low_precision_arithmetic, shared_squares


class Extra(NamedTuple):
    """A buffer XLA adds: ``value`` names the operand it copies (bytes ``nbytes``)."""

    value: int
    nbytes: sympy.Expr
    start: int
    end: int
    note: str


def materialised(graph: Graph) -> dict[int, int]:
    """Maps each value to the value whose buffer holds it; fused values map to -1.

    Follows XLA's fusion pass: an elementwise result is recomputed inside every consumer
    that can fuse it (elementwise ops and reductions) and takes no buffer, unless it is
    an output, feeds an op that needs its operands in memory (dots, gathers, control
    flow, ...), or is read by more than one consumer and is expensive to recompute
    (``EXPENSIVE``, unless its readers meet in one op: :func:`converges`) or a
    reduction reads it (:func:`_reduced_through`). Folded in: a pad
    into the windows reading it (a view), a zeroed slice update into the add reading
    it (:func:`added_updates`), exps into readers the jaxpr does not show (``merged``).
    """
    consumers, nodes, outputs = graph.consumers, graph.nodes, set(graph.outputs)
    owner: dict[int, int] = {v: v for v in graph.inputs}
    sunk, folded = sunk_broadcasts(graph), _folded_pads(graph)
    pooled, pool_operands = pooling_fusions(graph)
    merged, added = erfc_shared_exps(graph) | shared_squares(graph), added_updates(graph)

    def real_consumer_kinds(v: int) -> list[str]:
        kinds = []
        for c in consumers.get(v, ()):
            n = nodes[c]
            if (n.kind == "view" and n.primitive != "optimization_barrier") or c in folded:
                for o in n.outputs:
                    kinds.extend(real_consumer_kinds(o) or (["output"] if o in outputs else []))
            else:
                kinds.append(n.kind)
        return kinds

    for n in nodes:
        if n.kind == "view" or n.index in folded:
            for i, o in enumerate(n.outputs):
                src = n.inputs[i] if i < len(n.inputs) else (n.inputs[0] if n.inputs else None)
                owner[o] = owner.get(src, o) if src is not None else o
                if owner[o] == -1 and (o in outputs or n.primitive == "optimization_barrier"):
                    owner[o] = o
            continue
        for o in n.outputs:
            if o in added or (o in pooled and n.kind == "elementwise"
                              and o not in outputs and o not in pool_operands):
                owner[o] = -1  # (pooled: computed inside a CPU library pooling fusion)
                continue
            if o not in outputs and _folded_into_dots(graph, n, o, owner):
                owner[o] = -1
                continue
            if (n.kind != "elementwise" and not _outer_product(graph, n)
                    or o in outputs or o in pool_operands):
                owner[o] = o  # (a CPU library pooling fusion reads its operands from memory)
                continue
            kinds = real_consumer_kinds(o) + (["elementwise"] if o in merged else [])
            fusible = all(k in ("elementwise", "reduce") for k in kinds)
            if o in sunk and all(k in ("elementwise", "reduce", "control") for k in kinds):
                owner[o] = -1
                continue
            duplicable = len(kinds) <= 1 or _shared_fusible(graph, n, o, kinds, o in merged,
                                                            outputs, owner)
            owner[o] = -1 if (fusible and duplicable) else o
    return owner


def _shared_fusible(graph: Graph, n: Node, o: int, kinds: list[str], merged: bool,
                    outputs: set[int], owner: Mapping[int, int]) -> bool:
    """Whether XLA fuses ``o``, read by several consumers of ``kinds``, into all of them.

    XLA CPU's reduction library reads its operand from memory: a shared value is
    materialised (LayerNorm's x - mean, a bf16 convert; the costly walk last). An
    expensive one is not duplicated, but fused where its readers meet (float32: XLA writes
    each bf16 op of a GELU backward apart; a ``merged`` exp has a reader the jaxpr does
    not show; a ``div`` is left out), unless what it feeds is read in place and again
    through a weight gradient's copy (:func:`_copy_readers`). A cheap one reading several
    buffers is fused where its readers meet only where its result reaches such a copy."""
    if n.primitive in EXPENSIVE:
        return (not merged and n.primitive != "div" and converges(graph, o, outputs)
                and not low_precision_arithmetic(graph, n, o)
                and _copy_readers(graph, o, owner) < 2)
    if "reduce" in kinds or low_precision_arithmetic(graph, n, o) or _reduced_through(graph, o):
        return False
    return _effectively_unary(graph, n) or (converges(graph, o, outputs)
                                            and _copy_readers(graph, o, owner) > 0)


def converges(graph: Graph, v: int, outputs: set[int], steps: int = 24) -> bool:
    """Whether every path from ``v``'s readers meets in one elementwise op through
    elementwise ops only: XLA's loop fusion grown from that op takes ``v`` and all its
    readers in, duplicating nothing (a GELU backward from a rebuilt pre-activation to
    the input gradient, where no weight gradient reads the rebuilt activation).
    ``outputs``: the graph's outputs as a set (the caller's, not rebuilt per value)."""
    nodes, consumers = graph.nodes, graph.consumers
    front = set(consumers.get(v, ()))
    for _ in range(steps):
        first = min(front, default=None)
        if first is None or nodes[first].kind != "elementwise" or len(nodes[first].outputs) != 1:
            return False
        if len(front) == 1:
            return True
        out = nodes[first].outputs[0]
        if out in outputs or not consumers.get(out):
            return False
        front.remove(first)
        front.update(consumers[out])
    return False


def _copy_readers(graph: Graph, v: int, owner: Mapping[int, int], steps: int = 48) -> int:
    """How many dots read a value computed from ``v`` through elementwise ops, where one
    of them reads it through a transposed copy and no reduction reads it (0 otherwise)."""
    nodes, consumers = graph.nodes, graph.consumers
    front, seen = [v], {v}
    while front and steps > 0:
        steps -= 1
        u = front.pop()
        readers = consumers.get(u, ())
        dots = [c for c in readers if nodes[c].primitive == "dot_general"]
        if (any(u in copied_operands(graph, nodes[c], owner) for c in dots)
                and not any(nodes[c].kind == "reduce" for c in readers)):
            return len(dots)
        for c in readers:
            if nodes[c].kind == "elementwise" and len(nodes[c].outputs) == 1:
                o = nodes[c].outputs[0]
                if o not in seen:
                    seen.add(o)
                    front.append(o)
    return 0


def _outer_product(graph: Graph, node: Node) -> bool:
    """A dot whose contracting dims all have size 1: XLA makes it a product of broadcasts."""
    if node.primitive != "dot_general" or len(node.inputs) != 2:
        return False
    (lc, _), _ = dict(node.params)["dimension_numbers"]
    shape = graph.values[node.inputs[0]].shape
    return bool(lc) and all(shape[d] == 1 for d in lc)


def _reduced_through(graph: Graph, v: int, steps: int = 3) -> bool:
    """Whether a reader of ``v`` leads, through elementwise ops each read once, to a
    reduction: XLA fuses that chain into the reduction, which reads ``v`` from memory
    (a BatchNorm's ``x - mean``, read by the normalisation and by the backward's
    ``sum(g * (x - mean))``: one buffer per layer, -26 % at 512 rows without it)."""
    consumers, nodes, dtype = graph.consumers, graph.nodes, graph.values[v].dtype
    if dtype in ("bfloat16", "float16"):  # (measured: bf16 GPTs' deep levels to +12 %)
        return False
    for c in consumers.get(v, ()):
        for _ in range(steps):
            if (nodes[c].kind != "elementwise" or len(nodes[c].outputs) != 1
                    or graph.values[nodes[c].outputs[0]].dtype != dtype):
                break
            nxt = consumers.get(nodes[c].outputs[0], ())
            if len(nxt) != 1:
                break
            c = nxt[0]
            if nodes[c].kind == "reduce":
                return _column_reduction(graph, nodes[c])
    return False


def _column_reduction(graph: Graph, node: Node) -> bool:
    """A reduction that keeps the minor axis (a batch statistic's column sums); the row
    reductions of norms and softmaxes have rules of their own (:mod:`.ynn`)."""
    axes = node.eqn.params.get("axes", ()) if node.eqn is not None else ()
    rank = len(graph.values[node.inputs[0]].shape) if node.inputs else 0
    return bool(axes) and rank - 1 not in axes


def _folded_pads(graph: Graph) -> frozenset[int]:
    """Pads only windows read: XLA folds them into the window (a pool's transpose pads its
    cotangent for a stride-1 window), which reads the unpadded buffer in place."""
    consumers, nodes = graph.consumers, graph.nodes
    return frozenset(n.index for n in nodes if n.primitive == "pad" and n.outputs
                     and consumers.get(n.outputs[0])
                     and all(nodes[c].primitive.startswith("reduce_window")
                             for c in consumers[n.outputs[0]]))


def used_nodes(graph: Graph) -> list[bool]:
    """Per node, whether an output of the graph depends on it (XLA removes the others).

    Dead code is common in a differentiated step: the jvp of a ``max`` nobody
    differentiates, and, once a level recomputes a residual, the forward readers
    the backward pass no longer uses.
    """
    used = [False] * len(graph.nodes)
    needed = set(graph.outputs)
    for i in range(len(graph.nodes) - 1, -1, -1):  # program order is topological
        node = graph.nodes[i]
        if not needed.isdisjoint(node.outputs):
            used[i] = True
            needed.update(node.inputs)
    return used


def _folded_into_dots(graph: Graph, n: Node, o: int, owner: Mapping[int, int]) -> bool:
    """A transpose only dots read (folded into their dimension numbers: TransposeFolding),
    or a broadcast or a split computed inside the transposed copies its dots read."""
    if n.primitive == "transpose":
        return _only_dots(graph, o)
    if n.primitive == "split":  # (where rotary embeddings read q and k, the split stays)
        return all(_computed_into_copies(graph, s, owner) for s in n.outputs)
    return n.primitive == "broadcast_in_dim" and _computed_into_copies(graph, o, owner)


def _computed_into_copies(graph: Graph, v: int, owner: Mapping[int, int]) -> bool:
    """Whether ``v`` (a broadcast repeating heads: ``jnp.repeat`` in grouped-query
    attention; a split of a fused q/k/v projection) is reshaped into heads only dots
    read, each through a transposed copy: XLA computes ``v`` inside those copies."""
    nodes, consumers = graph.nodes, graph.consumers
    reshapes = consumers.get(v, ())
    if not reshapes or any(nodes[r].primitive != "reshape" or head_projection(graph, nodes[r])
                           is None for r in reshapes):
        return False
    for r in reshapes:
        o = nodes[r].outputs[0]
        dots = consumers.get(o, ())
        if not dots or any(nodes[d].primitive != "dot_general"
                           or o not in copied_operands(graph, nodes[d], owner) for d in dots):
            return False
    return True


def _only_dots(graph: Graph, v: int) -> bool:
    users = graph.consumers.get(v, ())
    return bool(users) and all(graph.nodes[u].primitive == "dot_general" for u in users)


def _effectively_unary(graph: Graph, node: Node) -> bool:
    """True when at most one operand has the result's rank and is not a broadcast.

    XLA duplicates such ops into every consumer without reading more memory
    (``InstructionFusion::EffectivelyAtMostUnary``); ops reading several full
    operands are fused into all consumers or none.
    """
    producers = graph.producers
    if not node.outputs:
        return True
    size = element_count(graph, node.outputs[0])
    full = 0
    for v in dict.fromkeys(node.inputs):
        p = producers.get(v)
        if p is not None and graph.nodes[p].primitive in ("broadcast_in_dim", "iota"):
            continue
        # Operands with size-1 dims are broadcast in HLO: they do not count either.
        if element_count(graph, v) == size:
            full += 1
    return full <= 1


def float32_bytes(graph: Graph, v: int) -> sympy.Expr:
    """``v``'s bytes as float32 (a low-precision value XLA's CPU backend widens)."""
    return sympy.expand(element_count(graph, v) * 4)


def transposed_copies(graph: Graph, order: Sequence[int], owner: dict[int, int],
                      size: Callable[[int], sympy.Expr] | None = None,
                      reads: set[tuple[int, int]] | None = None,
                      used: Sequence[bool] | None = None,
                      pairs: Sequence[tuple[int, int]] | None = None,
                      upcast: Collection[int] = ()) -> list[Extra]:
    """Copies of dot operands XLA has to transpose (:func:`dot_copies`).

    In a train step these are transposed activations for the weight-gradient
    dots, which raise XLA's peak at large shapes. One copy per operand, shared
    until the last dot that needs it (XLA's CSE), made when XLA's breadth-first
    CPU scheduler makes it (:func:`copy_start`). ``size``: a value's buffer
    bytes where they differ from the jaxpr's (float32 buffers of low-precision
    values, :mod:`jaxmem.memory.precision`). ``reads``, when given, gets each
    ``(dot node, operand)`` read through a copy (the dot does not read the original).
    ``used``: ``used_nodes(graph)``; ``pairs``: ``dot_copies(graph, owner, used)``,
    when the caller has them. A copy an ``upcast`` dot reads (one the backend runs in
    float32) is float32: the convert fuses into it (a bfloat16 GPT's heads at (4, 64):
    ``f32[4, 2, 64, 32]`` transposed copies).
    """
    reads = set() if reads is None else reads
    size = size or (lambda v: graph.values[v].nbytes)
    pairs = dot_copies(graph, owner, used) if pairs is None else pairs
    spans: dict[int, list[int]] = {}
    pos = {n: p for p, n in enumerate(order)}
    wide: set[int] = set()
    for ni, v in sorted(pairs, key=lambda nv: pos[nv[0]]):
        p = pos[ni]
        reads.add((ni, v))
        span = spans.setdefault(v, [min(copy_start(graph, pos, v, p), p), p])
        span[1] = p
        if ni in upcast:
            wide.add(v)
    out = []
    for v, (a, b) in spans.items():
        # A view's copy has the bytes of the buffer it views (float32 when widened); a
        # fused operand's, its own; an upcast dot's, float32.
        buffer = v if owner.get(v, v) == -1 else owner.get(v, v)
        nbytes = float32_bytes(graph, v) if v in wide else size(buffer)
        out.append(Extra(v, nbytes, a, b, "transposed copy"))
    return out
