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

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import sympy

from jaxmem.graph import EXPENSIVE, Graph, Node
from jaxmem.memory.fillers import added_updates, sunk_broadcasts
from jaxmem.memory.library import element_count, pooling_fusions
from jaxmem.memory.readers import erfc_shared_exps, low_precision_arithmetic


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
    (``EXPENSIVE``, unless its readers meet in one op: :func:`_converges`) or a
    reduction reads it (:func:`_reduced_through`). Folded in: a pad
    into the windows reading it (a view), a zeroed slice update into the add reading
    it (:func:`added_updates`), exps into readers the jaxpr does not show (``merged``).
    """
    consumers, nodes, outputs = graph.consumers, graph.nodes, set(graph.outputs)
    owner: dict[int, int] = {v: v for v in graph.inputs}
    sunk, folded = sunk_broadcasts(graph), _folded_pads(graph)
    pooled, pool_operands = pooling_fusions(graph)
    merged, added = erfc_shared_exps(graph), added_updates(graph)

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
            if n.kind != "elementwise" or o in outputs or o in pool_operands:
                owner[o] = o  # (a CPU library pooling fusion reads its operands from memory)
                continue
            if n.primitive == "transpose" and _only_dots(graph, o):
                owner[o] = -1  # folded into the dots' dimension numbers (TransposeFolding)
                continue
            kinds = real_consumer_kinds(o) + (["elementwise"] if o in merged else [])
            fusible = all(k in ("elementwise", "reduce") for k in kinds)
            if o in sunk and all(k in ("elementwise", "reduce", "control") for k in kinds):
                owner[o] = -1
                continue
            duplicable = len(kinds) <= 1 or _shared_fusible(graph, n, o, kinds, o in merged,
                                                            outputs)
            owner[o] = -1 if (fusible and duplicable) else o
    return owner


def _shared_fusible(graph: Graph, n: Node, o: int, kinds: list[str], merged: bool,
                    outputs: set[int]) -> bool:
    """Whether XLA fuses ``o``, read by several consumers of ``kinds``, into all of them.

    XLA CPU's reduction library reads its operand from memory: a shared value is
    materialised (LayerNorm's x - mean, a bf16 convert; the costly walk last). An
    expensive one is not duplicated, but fused where its readers meet (float32: XLA writes
    each bf16 op of a GELU backward apart; a ``merged`` exp has a reader the jaxpr does
    not show; a ``div`` is left out, measured: a bf16 Llama loss backward's float32
    ``(b, s)`` quotient read by two selects moved level 0 from +1.1 to +3.2 %)."""
    if n.primitive in EXPENSIVE:
        return (not merged and n.primitive != "div" and _converges(graph, o, outputs)
                and not low_precision_arithmetic(graph, n, o))
    return ("reduce" not in kinds and not low_precision_arithmetic(graph, n, o)
            and _effectively_unary(graph, n) and not _reduced_through(graph, o))


def _converges(graph: Graph, v: int, outputs: set[int], steps: int = 24) -> bool:
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
            if not fine and rank >= 3]


def transposed_copies(graph: Graph, order: Sequence[int], owner: dict[int, int],
                      size: Callable[[int], sympy.Expr] | None = None,
                      reads: set[tuple[int, int]] | None = None,
                      used: Sequence[bool] | None = None,
                      pairs: Sequence[tuple[int, int]] | None = None) -> list[Extra]:
    """Copies of dot operands XLA has to transpose (:func:`dot_copies`).

    In a train step these are transposed activations for the weight-gradient
    dots, which raise XLA's peak at large shapes. One copy per operand, shared
    until the last dot that needs it (XLA's CSE), made when XLA's breadth-first
    CPU scheduler makes it (:func:`copy_start`). ``size``: a value's buffer
    bytes where they differ from the jaxpr's (float32 buffers of low-precision
    values, :mod:`jaxmem.memory.precision`). ``reads``, when given, gets each
    ``(dot node, operand)`` read through a copy (the dot does not read the original).
    ``used``: ``used_nodes(graph)``; ``pairs``: ``dot_copies(graph, owner, used)``,
    when the caller has them.
    """
    reads = set() if reads is None else reads
    size = size or (lambda v: graph.values[v].nbytes)
    pairs = dot_copies(graph, owner, used) if pairs is None else pairs
    spans: dict[int, list[int]] = {}
    pos = {n: p for p, n in enumerate(order)}
    for ni, v in sorted(pairs, key=lambda nv: pos[nv[0]]):
        p = pos[ni]
        reads.add((ni, v))
        span = spans.setdefault(v, [min(copy_start(graph, pos, v, p), p), p])
        span[1] = p
    # A view's copy has the bytes of the buffer it views (float32 when widened); a fused
    # operand's, its own.
    buffer = {v: owner.get(v, v) for v in spans}
    return [Extra(v, size(v if buffer[v] == -1 else buffer[v]), a, b, "transposed copy")
            for v, (a, b) in spans.items()]


def _without_unit_dims(shape: tuple, contracting: tuple, batch: tuple
                       ) -> tuple[tuple, tuple, int]:
    """A dot operand's dims with its size-1 dims dropped (XLA bitcasts them away):
    Flax NNX's scanned attention has probabilities ``[1, b, h, s, s]``, whose batch
    dims are canonical once the leading 1 goes (XLA copies none of them for ``dV``)."""
    keep = {d: k for k, d in enumerate(i for i, n in enumerate(shape) if n != 1)}
    return (tuple(keep[d] for d in contracting if d in keep),
            tuple(keep[d] for d in batch if d in keep), len(keep))


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
        src = graph.producers.get(node.inputs[0]) if is_head_split(graph, node) else None
        return first_dot if src not in pos else max(pos[src], pos[prod]) + 1
    if node.kind not in ("elementwise", "opaque") or node.primitive in ("gather", "slice"):
        return first_dot
    return pos[prod] + 1


def is_head_split(graph: Graph, node: Node) -> bool:
    """Whether ``node`` reshapes a dot's output (attention heads split off a projection):
    XLA copies the projection into each layout its dots read as soon as it is written
    (bench.unseen's gradient accumulation: the q/k/v projections then die; level 2 +15.0
    -> +3.5 %). Heads made by an elementwise op (a Llama's rotary ``add``) are not."""
    if node.primitive != "reshape" or not node.inputs:
        return False
    src = graph.producers.get(node.inputs[0])
    return src is not None and graph.nodes[src].primitive == "dot_general"


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
