"""Broadcast operands of a dot's fused epilogue: buffers XLA's CPU backend adds that no
jaxpr value names (:func:`epilogue_broadcasts`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory.fusion import materialised
    >>> f = lambda x, w, t: (x @ w) * jnp.cos(t)[None]
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((4, 16, 8)), jnp.ones((8, 8)),
    ...                                    jnp.ones((16, 8))))
    >>> order = list(range(len(g.nodes)))
    >>> [x.note for x in epilogue_broadcasts(g, order, materialised(g), {})]
    ['broadcast epilogue operand']
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import sympy

from jaxmem.graph import Graph, Node
from jaxmem.memory.fusion import Extra, element_count
from jaxmem.memory.library import from_rows


def epilogue_broadcasts(graph: Graph, order: Sequence[int], owner: dict[int, int],
                         first_def: dict[int, int], upcast: Collection[int] = ()
                         ) -> list[Extra]:
    """Full-size copies of operands broadcast into a dot's fused epilogue.

    XLA's CPU backend fuses a dot with the chain of elementwise ops that consume
    its result (one library call), but such a fusion reads every other operand
    of that chain at the chain's full shape: an operand that the jaxpr broadcasts
    (``x / s[..., None]``, the softmax denominator in attention's backward pass)
    is materialised broadcast, from when its source exists until the chain runs.
    A dot in ``upcast`` (:func:`~jaxmem.memory.precision.upcast_dots`: run in float32) is
    a float32 library dot, with its threshold (measured, bfloat16 decoders' softmax
    gradients: the ``1 / sum`` stays ``[b, h, s]`` over 2048 rows and is broadcast over
    16384).
    """
    pos = {n: p for p, n in enumerate(order)}
    nodes = graph.nodes
    consumers = graph.consumers
    out: list[Extra] = []
    seen: set[tuple[int, int]] = set()
    for node in nodes:
        if node.primitive != "dot_general" or not node.outputs:
            continue
        region = {node.outputs[0]}
        frontier = [node.outputs[0]]
        for _ in range(3):  # epilogues are short; bound the walk
            nxt = []
            for v in frontier:
                for u in consumers.get(v, ()):
                    e = nodes[u]
                    # No fusion crosses an optimization barrier (a rewritten level's
                    # recomputation reads the dot's result through one); walking through
                    # it also took the barrier's first output, whatever it was, for the
                    # dot's (a recomputed softmax's exp: a 64 MiB broadcast XLA never
                    # makes, llama 4x256 at (8, 512), levels 3-7).
                    if (e.kind not in ("elementwise", "view") or not e.outputs
                            or e.primitive == "optimization_barrier"):
                        continue
                    if e.kind == "elementwise":
                        out.extend(_broadcast_operands(graph, e, region, owner, first_def,
                                                       pos, seen, node.index, upcast))
                    region.add(e.outputs[0])
                    nxt.append(e.outputs[0])
            frontier = nxt
    return _merged_by_source(graph, out)


def _library_dot(graph: Graph, dot: Node) -> bool:
    """A float32 dot: XLA CPU's library runs it."""
    return all(graph.values[v].dtype == "float32" for v in dot.inputs)


def _merged_by_source(graph: Graph, extras: list[Extra]) -> list[Extra]:
    """One buffer per broadcast XLA's CSE makes one: the same source broadcast the same
    way (each layer of an unrolled step broadcasts the rotary tables anew in the jaxpr)."""
    merged: dict[tuple, Extra] = {}
    for x in extras:
        b = graph.nodes[graph.producers[x.value]]
        key = (b.inputs[0], graph.values[x.value].shape,
               dict(b.params).get("broadcast_dimensions"), x.nbytes)
        y = merged.get(key)
        merged[key] = x if y is None else Extra(y.value, y.nbytes, min(y.start, x.start),
                                                max(y.end, x.end), y.note)
    return list(merged.values())


def _broadcast_operands(graph: Graph, e: Node, region: set[int], owner: dict[int, int],
                        first_def: dict[int, int], pos: dict[int, int],
                        seen: set[tuple[int, int]], dot: int, upcast: Collection[int]
                        ) -> list[Extra]:
    """The operands of epilogue op ``e`` of ``dot`` that XLA reads broadcast to ``e``'s
    full shape."""
    producers = graph.producers
    size = None  # e's element count, found when an operand needs it
    out = []
    for x in e.inputs:
        if x in region or (x, e.index) in seen:
            continue
        p = producers.get(x)
        # Only operands the jaxpr broadcasts count (a concatenate's operands do not).
        if (p is None or graph.nodes[p].primitive != "broadcast_in_dim"
                or not graph.nodes[p].inputs):
            continue
        src = graph.nodes[p].inputs[0]
        small = element_count(graph, src)
        size = element_count(graph, e.outputs[0]) if size is None else size
        # Broadcasts of vectors (biases, scales) are read in place. Decided by rank,
        # not by whether the size is symbolic, so that a concrete trace of the same
        # program gets the same buffers as the symbolic one.
        if len(graph.values[src].shape) <= 1 or small == size:
            continue
        # A row statistic of the dot's own result (softmax backward's ``sum(dP * P)``)
        # is no operand of the dot's fusion: XLA computes it after the dot, or inside
        # one YNN fusion with it (llama 4x256 at (8, 512), the level recomputing the
        # softmax sums: one broadcast operand in XLA's fusion, two in the model).
        if _depends_on(graph, pos, src, dot):
            continue
        seen.add((x, e.index))
        o = owner.get(src, src)
        here = pos[e.index]
        start = min(_made(graph, pos, src, first_def.get(o, 0)), here) if o != -1 else here
        # A library dot's fusion exists from its threshold on (attention's 1/sum
        # broadcast at (2, 512): read in place by a loop fusion).
        gate = from_rows(small) if dot in upcast or _library_dot(graph, graph.nodes[dot]) else 1
        out.append(Extra(x, sympy.expand(graph.values[e.outputs[0]].nbytes * gate), start, here,
                         "broadcast epilogue operand"))
    return out


def _made(graph: Graph, pos: dict[int, int], src: int, written: int) -> int:
    """Where the broadcast of ``src`` can first be made: when its buffer is ``written``, or,
    for a rebuild's operand passed through an optimization barrier, at the barrier (a
    padding mask kept from the forward pass and broadcast again in the backward pass:
    three 512 KiB buffers held across the whole step, +11 % on bench.unseen's ``padded``)."""
    p = graph.producers.get(src)
    if p is not None and graph.nodes[p].primitive == "optimization_barrier":
        return max(written, pos[p])
    return written


def _depends_on(graph: Graph, pos: dict[int, int], v: int, node: int, hops: int = 12) -> bool:
    """Whether value ``v`` is computed from an output of ``node`` within ``hops`` ops
    (``pos``: a topological order; only the nodes after ``node`` in it are visited).

    A statistic of a dot's own result is a few ops from it (``sum(dP * P)``: two; 12
    keeps every level of bench.accuracy's 4-layer GPT, linen and Llamas as before); an
    unbounded walk from a backward value back to a forward dot visited most of the
    backward pass for each broadcast (10 s of a 22-layer step's plan derivation).
    """
    start = pos[node]
    frontier, seen = [v], {v}
    for _ in range(hops):
        if not frontier:
            break
        nxt = []
        for x in frontier:
            p = graph.producers.get(x)
            if p is None or pos[p] < start:
                continue
            if p == node:
                return True
            for i in graph.nodes[p].inputs:
                if i not in seen:
                    seen.add(i)
                    nxt.append(i)
        frontier = nxt
    return False
