"""The slices of its stacked operands a ``scan`` body reads from memory.

A scan body reads row ``i`` of each ``xs`` operand. XLA's CPU backend fuses that
dynamic slice into elementwise and reducing readers, and copies it out (a
dynamic-slice fusion, scheduled at the body's start) for a reader that takes its
operands from memory, such as a dot. :func:`sliced_xs` names those slices,
:func:`slices_as_temps` makes each a temporary of the body's memory model.

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

from jaxmem.graph import Graph, scan_counts
from jaxmem.memory.liveness import Buffer


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


def _fuses_slice(body: Graph, reader: int) -> bool:
    return body.nodes[reader].kind in ("elementwise", "reduce", "view")


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
            ends = [pos[c] for c in graph.consumers.get(b.value, ())
                    if c in pos and not _fuses_slice(graph, c)]
            b = dataclasses.replace(b, start=0, end=max(ends, default=0), kind="temp",
                                    note="slice of a stacked operand")
        out.append(b)
    return out
