"""The copies of its operands a loop body holds in memory of its own.

A scan body reads row ``i`` of each ``xs`` operand. XLA's CPU backend fuses that
dynamic slice into elementwise and reducing readers, and copies it out (a
dynamic-slice fusion, scheduled at the body's start) for a reader that takes its
operands from memory, such as a dot or an optimization barrier. :func:`sliced_xs`
names those slices. A constant's broadcast a loop reads is made inside its body
(:func:`~jaxmem.memory.fillers.is_sunk`), where it fuses into its readers, except
into a barrier, which holds it in a buffer (:func:`held_fills`).
:func:`held_inputs` gives both, :func:`slices_as_temps` makes each a temporary of the
body's memory model.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = lambda h, w: jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), h, w)[0]
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((2, 4)), jnp.ones((3, 4, 4))))
    >>> scan = next(n for n in g.nodes if n.primitive == "scan")
    >>> body = scan.subgraphs[0]
    >>> [body.values[v].shape for v in sliced_xs(body, scan.eqn.params)]
    [(4, 4)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxmem.graph import Graph, Node, scan_counts
from jaxmem.memory.fillers import is_sunk
from jaxmem.memory.liveness import Buffer
from jaxmem.memory.loop_operands import body_operands


def sliced_xs(body: Graph, params: dict) -> frozenset[int]:
    """The per-iteration ``xs`` slices a scan body reads in memory.

    XLA's CPU backend fuses a slice of a stacked operand into elementwise and
    reducing consumers, but copies it out (a dynamic-slice fusion) for one that
    reads its operands from memory, such as a dot (gpt-scan 3x64 at (2, 64):
    -9 % against XLA without these copies, -2 % with them).
    """
    first = sum(scan_counts(params))
    return frozenset(v for v in body.inputs[first:]
                     if any(not _fuses_slice(body, c) for c in body.consumers.get(v, ())))


def held_inputs(graph: Graph, node: Node) -> frozenset[int]:
    """The inputs of loop ``node``'s (last) body it holds copies of: a scan's
    :func:`sliced_xs` and any loop's :func:`held_fills`."""
    sliced = (sliced_xs(node.subgraphs[0], node.eqn.params)
              if node.primitive == "scan" and node.eqn is not None else frozenset())
    return sliced | held_fills(graph, node)


def held_fills(graph: Graph, node: Node) -> frozenset[int]:
    """The inputs of loop ``node``'s (last) body that are a constant's broadcast outside
    (:func:`~jaxmem.memory.fillers.is_sunk`) and that a reader in the body needs in
    memory: XLA writes the broadcast at the body's start, and the buffer lives until
    its last reader, through a barrier's copy (measured, jax 0.10.2: a causal mask's
    ``-1e9`` filler that a level's barrier holds in the scanned bf16 GPT's backward
    body, ``f32[8, 4, 512, 512]``; its level 3 at (8, 512) -13.4 % before)."""
    if not node.subgraphs:
        return frozenset()
    body = node.subgraphs[-1]
    return frozenset(inner for _, v, inner in body_operands(node)
                     if v is not None and is_sunk(graph, v)
                     and any(not _fuses_slice(body, c) for c in body.consumers.get(inner, ())))


def _fuses_slice(body: Graph, reader: int) -> bool:
    node = body.nodes[reader]
    return (node.kind in ("elementwise", "reduce", "view")
            and node.primitive != "optimization_barrier")


def _memory_readers(body: Graph, v: int) -> list[int]:
    """The readers of ``v`` that need it in memory, and through a barrier that holds it,
    every reader of the barrier's copy (the same buffer)."""
    out = []
    for c in body.consumers.get(v, ()):
        node = body.nodes[c]
        if node.primitive == "optimization_barrier":
            out.append(c)
            # By operand position: ``inputs`` leaves out the literals a barrier may read
            # (a causal mask's ``-1e9`` filler), ``operands`` keeps their places.
            operands = node.operands if len(node.operands) == len(node.outputs) else node.inputs
            for x, o in zip(operands, node.outputs, strict=True):
                if x == v:
                    out.extend(body.consumers.get(o, ()))
        elif not _fuses_slice(body, c):
            out.append(c)
    return out


def slices_as_temps(graph: Graph, order: Sequence[int], buffers: Sequence[Buffer],
                    slices: frozenset[int]) -> list[Buffer]:
    """``buffers`` with each of a loop body's ``slices`` a temporary from the body's start
    to its last reader in memory (XLA schedules the dynamic-slice fusions first; a
    buffer made after that reader may take its place: a scanned tanh MLP's backward
    body, where the slices were counted through the whole body, +8 % at 1024 rows)."""
    pos = {ni: p for p, ni in enumerate(order)}
    out = []
    for b in buffers:
        if b.kind == "argument" and b.value in slices:
            ends = [pos[c] for c in _memory_readers(graph, b.value) if c in pos]
            b = dataclasses.replace(b, start=0, end=max(ends, default=0), kind="temp",
                                    note="the body's copy of a loop operand")
        out.append(b)
    return out
