"""Buffers XLA's CPU backend adds around gathers and scatters (read from its buffer
assignments, jax 0.10.2).

* :func:`batched_index_tuples`: a gather or scatter whose operand has batching dims
  (``jnp.take_along_axis``, the gradient of ``jnp.sort``: ``operand_batching_dims`` in
  its dimension numbers) is rewritten before XLA's CPU backend runs it: each index gets
  its batch positions prepended, one iota per batching dim concatenated with the
  indices into a new array of ``(index vector + batching dims)`` entries per index, made
  right before the first gather or scatter that reads it. For a sort's gradient that
  array is three times the sorted operand (the gradient of ``jnp.sort(x, axis=1)`` on
  ``[8, 256, 64]``: 1.5 MiB beside a 0.5 MiB operand).
* :func:`scattered_zeros`: a scatter into zeros (an embedding's gradient, the transpose
  of ``x[idx]``) runs in place on a broadcast of zeros, which reads nothing and so runs
  at the start of XLA's breadth-first schedule: the gradient's buffer lives through
  the whole forward pass (a 4096 x 128 embedding's: 2 MiB from the program's start).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = jax.grad(lambda x: jnp.sort(x, axis=1)[:, :2].sum())
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((4, 16, 8))))
    >>> [int(x.nbytes) for x in batched_index_tuples(g, range(len(g.nodes)), "cpu")]
    [6144]
    >>> from jaxmem.memory.fusion import materialised
    >>> step = lambda e, i: e - jax.grad(lambda e: (e[i] ** 2).sum())(e)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((32, 4)), jnp.arange(3)))
    >>> zeros = scattered_zeros(g, range(len(g.nodes)), "cpu", materialised(g))
    >>> [(x.start, g.values[x.value].shape) for x in zeros]
    [(0, (32, 4))]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import sympy

from jaxmem.graph import Graph, Node
from jaxmem.memory.fusion import Extra
from jaxmem.memory.library import itemsize


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
        size = count * (indices.shape[-1] + batching) * itemsize(graph, v)
        out.append(Extra(v, sympy.expand(size), start, end, "index tuples with batch positions"))
    return out


_SCATTER_INTO = frozenset(("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                           "scatter-max"))
_GATHER_SCATTER = _SCATTER_INTO | {"gather"}


def scattered_zeros(graph: Graph, order: Sequence[int], backend: str,
                    owner: dict[int, int]) -> list[Extra]:
    """The zeros each scatter into a constant adds into (module docstring), from the
    program's start to where the model's own buffer of them starts (``owner``: the
    materialised values), or else to the scatter, which then holds them as its result;
    none for a scatter that writes a result (counted whole), whose result is only added
    to (XLA's simplifier scatters into the other summand) or whose indices are constant
    (the transpose of ``qkv[:, :, 0]``, a gather only where a dim is symbolic: the
    concrete trace slices and pads), none off CPU."""
    if backend != "cpu":
        return []
    pos = {n: p for p, n in enumerate(order)}
    results, out = set(graph.outputs), []
    for ni in order:
        node = graph.nodes[ni]
        if (node.primitive not in _SCATTER_INTO or len(node.inputs) < 2
                or node.inputs[0] not in graph.constant or node.outputs[0] in results
                or node.inputs[1] in graph.constant or added_scatter(graph, node)):
            continue
        zeros = node.inputs[0]
        held = owner.get(zeros) == zeros and zeros in graph.producers
        end = pos[graph.producers[zeros]] if held else pos[ni]
        if end > 0:
            out.append(Extra(node.outputs[0], graph.values[node.outputs[0]].nbytes, 0,
                             end - 1, "zeros a scatter adds into"))
    return out


def added_scatter(graph: Graph, node: Node) -> bool:
    """Whether ``node`` scatters into zeros only to be added to: XLA's simplifier scatters
    into the other summand instead (the cross-entropy gradient's ``-1`` at the labels,
    which needs only the labels and would otherwise run first and live throughout)."""
    if node.primitive != "scatter-add" or node.inputs[0] not in graph.constant:
        return False
    readers = graph.consumers.get(node.outputs[0], ())
    return bool(readers) and all(graph.nodes[r].primitive in ("add", "add_any")
                                 for r in readers)
