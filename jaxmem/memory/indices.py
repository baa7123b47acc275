"""The index tuples XLA's CPU backend builds for a gather or scatter with batching dims.

A gather or scatter whose operand has batching dims (``jnp.take_along_axis``, the
gradient of ``jnp.sort``: ``operand_batching_dims`` in its dimension numbers) is
rewritten before XLA's CPU backend runs it: each index gets its batch positions
prepended, one iota per batching dim concatenated with the indices into a new array of
``(index vector + batching dims)`` entries per index, made right before the first gather
or scatter that reads it. For a sort's gradient that array is three times the sorted operand (the
gradient of ``jnp.sort(x, axis=1)`` on ``[8, 256, 64]``: 1.5 MiB beside a 0.5 MiB
operand; read from XLA's buffer assignment, jax 0.10.2).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = jax.grad(lambda x: jnp.sort(x, axis=1)[:, :2].sum())
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((4, 16, 8))))
    >>> [int(x.nbytes) for x in batched_index_tuples(g, range(len(g.nodes)), "cpu")]
    [6144]
"""

from __future__ import annotations

from collections.abc import Iterable

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.fusion import Extra


def batched_index_tuples(graph: Graph, order: Iterable[int], backend: str) -> list[Extra]:
    """The index tuples of the gathers and scatters with batching dims (module docstring):
    one buffer per index array, shared by every gather and scatter reading it (XLA's CSE
    makes one: a cross-entropy's gather and its gradient's scatter), live from the first
    to the last; none off CPU."""
    if backend != "cpu":
        return []
    spans: dict[tuple[int, int], list] = {}
    for p, ni in enumerate(order):
        node = graph.nodes[ni]
        if node.primitive not in _GATHER_SCATTER or len(node.inputs) < 2 or node.eqn is None:
            continue
        dims = node.eqn.params.get("dimension_numbers")
        batching = len(getattr(dims, "operand_batching_dims", ()) or ())
        if batching and graph.values[node.inputs[1]].shape:
            spans.setdefault((node.inputs[1], batching), [p, p])[1] = p
    out = []
    for (v, batching), (start, end) in spans.items():
        indices = graph.values[v]
        count = sympy.Mul(*indices.shape[:-1])
        size = count * (indices.shape[-1] + batching) * indices.nbytes / sympy.Mul(*indices.shape)
        out.append(Extra(v, sympy.expand(size), start, end, "index tuples with batch positions"))
    return out


_GATHER_SCATTER = frozenset(("gather", "scatter", "scatter-add", "scatter-sub", "scatter-mul",
                             "scatter-min", "scatter-max"))
