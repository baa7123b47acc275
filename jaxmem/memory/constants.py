"""Scalar constants XLA CPU's library fusions read as full-size buffers.

A library fusion cannot broadcast a scalar constant itself: an elementwise op inside it
that reads one takes the broadcast as an operand, and XLA's CSE shares one broadcast of
each constant at each shape between every op reading it. So a constant the fusion reads
and some op outside it reads too is a buffer, from the program's start until the last
fusion reading it runs (:func:`shared_constants`): gelu's four constants in an MLP,
``1 / sqrt(d)`` in attention's score fusions.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory.fusion import used_nodes
    >>> g = build_graph(jax.make_jaxpr(lambda x: (x * 0.5, jnp.tanh(x * 0.5)))(
    ...     jnp.ones((64, 64))))
    >>> used = used_nodes(g)
    >>> fused = frozenset({1, 2})  # tanh(x * 0.5); the first x * 0.5 is outside
    >>> use = ConstantUse(frozenset({1}), fused, 2, 4096, 0)
    >>> [(x.nbytes, x.start, x.end) for x in shared_constants(g, used, [use], "note")]
    [(16384, 0, 2)]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.fusion import Extra
from jaxmem.memory.library import constant_operands, constant_readers, from_rows


class ConstantUse(NamedTuple):
    """Where a library fusion takes shared scalar constants in as buffers."""

    chain: frozenset[int]  # the ops whose constant operands it reads as buffers
    inside: frozenset[int]  # the readers it holds itself
    end: int  # its last op's position
    rows: sympy.Expr  # its rows (or reduced elements): no buffer below the threshold
    value: int  # the value the buffers are noted against


@functools.cache  # few distinct row counts; sympy's Max compares its arguments pairwise
def _largest(rows: frozenset[sympy.Expr]) -> sympy.Expr:
    return sympy.Max(*rows)


def shared_constants(graph: Graph, used: Sequence[bool], uses: Sequence[ConstantUse],
                     note: str, taken: frozenset[tuple] = frozenset(),
                     readers: Mapping[tuple, list[int]] | None = None) -> list[Extra]:
    """One full-size broadcast per scalar constant and shape (XLA's CSE) that a fusion in
    ``uses`` reads and an op outside it reads too, from the program's start to the last
    such fusion that exists at the shape (a fusion under its threshold reads no buffer):
    one buffer per stretch between fusions, there where a fusion after it exists. A
    bfloat16 constant counts as float32 (XLA CPU computes a bf16 chain in float32).
    ``taken``: constant keys another rule counts; ``readers``: ``constant_readers``, where
    the caller has it."""
    if not uses:
        return []
    readers = constant_readers(graph, used) if readers is None else readers
    by_key: dict[tuple, list[ConstantUse]] = {}
    shared: set[tuple] = set()
    for use in uses:
        keys = {k for n in use.chain for k in constant_operands(graph, graph.nodes[n])}
        for key in keys - taken:
            by_key.setdefault(key, []).append(use)
            if any(u not in use.inside for u in readers[key]):
                shared.add(key)
    out: list[Extra] = []
    for key in sorted(shared, key=repr):
        _, shape, itemsize = key
        full = max(itemsize, 4) * sympy.Mul(*shape)
        later = sorted(by_key[key], key=lambda u: u.end)
        segments: list[Extra] = []
        for k, use in enumerate(later):
            rows = _largest(frozenset(u.rows for u in later[k:]))
            nbytes = sympy.expand(full * from_rows(rows))
            if segments and segments[-1].nbytes == nbytes:  # the same buffer goes on
                x = segments[-1]
                segments[-1] = Extra(x.value, x.nbytes, x.start, use.end, note)
            else:
                start = segments[-1].end + 1 if segments else 0
                segments.append(Extra(use.value, nbytes, start, use.end, note))
        out += segments
    return out
