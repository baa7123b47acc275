"""XLA CPU's YNN column sums: a norm's scale gradient reads its per-row factor at full size.

A sum over the leading dims of a float32 ``[..., d]`` value (a LayerNorm or RMSNorm
scale's gradient, ``sum(dy * x_hat)`` over the rows) is handed to XLA CPU's YNN library
at any size. Its fusion takes in the element-wise ops before it whose every reader it
holds (its prologue), but it does not broadcast a per-row value (``[..., 1]``, a
norm's ``rsqrt``) along the rows' last dim. XLA materialises what it cannot broadcast
(measured, jax 0.10.2, ``f32[16, 1000, 64]`` norms and the 4-layer GPT and Llama at
(8, 512)):

* a per-row value the prologue multiplies by becomes a full-size broadcast
  (``bitcast_broadcast_fusion``), computed with its source and read until the sum
  (Flax's LayerNorm: ``dscale = sum(dy * (x - mean) * rsqrt)``), see
  :func:`column_broadcasts`;
* a product of a per-row value that the prologue shares with other readers is
  computed once into a buffer of its own (``broadcast_multiply_fusion``) instead of
  in each reader: a two-pass LayerNorm's ``x_hat``, an RMSNorm's ``x * rsqrt``, read by
  the forward pass and by the scale's gradient, see :func:`column_products`.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory.fusion import materialised, used_nodes
    >>> def rms_norm_grad(x, g):  # the scale's gradient is a column sum of dy * x * rsqrt
    ...     y = lambda g: (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True)) * g).sum()
    ...     return jax.value_and_grad(y)(g)  # x * rsqrt: read by the output and the sum
    >>> args = [jax.ShapeDtypeStruct((16, 1000, 64), jnp.float32),
    ...         jax.ShapeDtypeStruct((64,), jnp.float32)]
    >>> g = build_graph(jax.make_jaxpr(rms_norm_grad)(*args))
    >>> sums = column_sums(g, used_nodes(g), "cpu")
    >>> [g.values[v].shape for v in column_products(g, materialised(g), sums)]
    [(16, 1000, 64)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.fusion import Extra, materialised
from jaxmem.memory.library import constant_operands, constant_readers
from jaxmem.memory.reductions import (
    ReductionFusion,
    reduction_constants,
    reduction_fusions,
    reduction_roots,
)
from jaxmem.memory.ynn import RowFusion, centred_values, row_fusions
from jaxmem.memory.ynn_operands import row_fusion_extras


class ColumnSum(NamedTuple):
    """A YNN column sum: its node, the summed ``shape``, its ``prologue`` (the nodes it
    fuses, itself included) and the ``shared`` producers it reads (readers elsewhere)."""

    reduction: int
    shape: tuple
    prologue: frozenset[int]
    shared: tuple[int, ...]


def _is_column_sum(graph: Graph, node_index: int) -> bool:
    node = graph.nodes[node_index]
    if node.primitive != "reduce_sum" or not node.inputs:
        return False
    x = graph.values[node.inputs[0]]
    axes = tuple(dict(node.params).get("axes", ()))
    return (x.dtype == "float32" and len(x.shape) >= 2 and bool(axes)
            and len(x.shape) - 1 not in axes)


def column_sums(graph: Graph, used: Sequence[bool], backend: str) -> list[ColumnSum]:
    """Each used float32 column sum's prologue on ``backend`` (none off XLA's CPU)."""
    if backend != "cpu":
        return []
    out = []
    for node in graph.nodes:
        if not used[node.index] or not _is_column_sum(graph, node.index):
            continue
        shape = graph.values[node.inputs[0]].shape
        prologue, todo, shared = {node.index}, [node.index], []
        while todo:  # up through full-size element-wise producers whose readers it holds
            for v in graph.nodes[todo.pop()].inputs:
                p = graph.producers.get(v)
                producer = graph.nodes[p] if p is not None else None
                if (producer is None or p in prologue or graph.values[v].shape != shape
                        or producer.kind != "elementwise" or len(producer.outputs) != 1):
                    continue
                if all(u in prologue for u in graph.consumers.get(v, ()) if used[u]):
                    prologue.add(p)
                    todo.append(p)
                elif p not in shared:
                    shared.append(p)
        out.append(ColumnSum(node.index, shape, frozenset(prologue), tuple(shared)))
    return out


def _per_row_source(graph: Graph, v: int, shape: tuple, hops: int = 3) -> int | None:
    """The per-row value (``shape[:-1]``, or with a last dim of 1) that operand ``v`` of an
    op of ``shape`` is, seen through broadcasts and reshapes; None for anything else."""
    rows = tuple(shape[:-1])
    for _ in range(hops):
        s = tuple(graph.values[v].shape)
        if s == rows or (len(s) == len(shape) and s[:-1] == rows and s[-1] == 1):
            return v
        p = graph.producers.get(v)
        if (p is None or graph.nodes[p].primitive not in ("broadcast_in_dim", "reshape")
                or not graph.nodes[p].inputs):  # (a literal broadcast)
            return None
        v = graph.nodes[p].inputs[0]
    return None


def _per_row_operands(graph: Graph, node_index: int, shape: tuple) -> list[int]:
    """The per-row sources a ``mul``/``div`` of ``shape`` reads broadcast along the rows."""
    node = graph.nodes[node_index]
    if node.primitive not in ("mul", "div") or shape[-1] == 1:
        return []
    out = []
    for v in node.inputs:
        p = graph.producers.get(v)
        broadcast = p is not None and graph.nodes[p].primitive == "broadcast_in_dim"
        if graph.values[v].shape != shape or broadcast:
            src = _per_row_source(graph, v, shape)
            if src is not None:
                out.append(src)
    return out


def column_products(graph: Graph, owner: Mapping[int, int],
                    sums: Sequence[ColumnSum]) -> dict[int, int]:
    """Products of a per-row value that a column sum's prologue shares with other readers
    and :func:`~jaxmem.memory.fusion.materialised` recomputes in each: value -> itself
    (XLA gives each a buffer)."""
    out: dict[int, int] = {}
    for s in sums:
        for p in s.shared:
            v = graph.nodes[p].outputs[0]
            if owner.get(v, v) == -1 and _per_row_operands(graph, p, s.shape):
                out[v] = v
    return out


def column_broadcasts(graph: Graph, order: Sequence[int],
                      sums: Sequence[ColumnSum]) -> list[Extra]:
    """Full-size broadcasts of the per-row values column sums' prologues multiply by: one
    per value and shape (XLA's CSE), from the value's definition to its last such sum."""
    pos = {n: p for p, n in enumerate(order)}
    ends: dict[tuple[int, tuple], int] = {}
    for s in sums:
        for ni in s.prologue:
            for src in _per_row_operands(graph, ni, s.shape):
                ends[src, s.shape] = max(ends.get((src, s.shape), -1), pos[s.reduction])
    out = []
    for (src, shape), end in ends.items():
        p = graph.producers.get(src)
        out.append(Extra(src, sympy.expand(4 * sympy.Mul(*shape)), pos[p] if p is not None else 0,
                         end, "per-row factor a column sum reads"))
    return out


class Library(NamedTuple):
    """XLA CPU's YNN library fusions in a graph, found once per memory model: the row sums'
    (:func:`~jaxmem.memory.ynn.row_fusions`), the column sums' (:func:`column_sums`), and
    other reductions' fusions that hold a dot
    (:func:`~jaxmem.memory.reductions.reduction_fusions`); all empty off the CPU backend."""

    rows: list[RowFusion]
    columns: list[ColumnSum]
    reductions: list[ReductionFusion]


def library_fusions(graph: Graph, used: Sequence[bool], backend: str) -> Library:
    """The graph's :class:`Library` on ``backend``."""
    reductions = reduction_fusions(graph, used) if backend == "cpu" else []
    return Library(row_fusions(graph, used, backend), column_sums(graph, used, backend),
                   reductions)


def library_owner(graph: Graph, used: Sequence[bool], library: Library) -> dict[int, int]:
    """:func:`~jaxmem.memory.fusion.materialised` with the values XLA CPU's YNN library
    writes to buffers of their own: a row fusion's centred value
    (:func:`~jaxmem.memory.ynn.centred_values`), a column sum's shared per-row
    products (:func:`column_products`) and a reduction fusion's results
    (:func:`~jaxmem.memory.reductions.reduction_roots`)."""
    owner = materialised(graph)
    return {**owner, **centred_values(graph, owner, used, library.rows),
            **column_products(graph, owner, library.columns),
            **{v: v for v in reduction_roots(library.reductions)}}


def library_extras(graph: Graph, order: Sequence[int], used: Sequence[bool], backend: str,
                   library: Library) -> list[Extra]:
    """The buffers the library's fusions add: its row sums'
    (:func:`~jaxmem.memory.ynn_operands.row_fusion_extras`) and :func:`column_broadcasts`."""
    prologues = frozenset(k for f in library.rows for n in f[3]
                          for k in constant_operands(graph, graph.nodes[n]))
    # Both rules read the constants' readers: found once (a pass over every op).
    readers = constant_readers(graph, used) if library.reductions or (
        backend == "cpu" and any(f[3] for f in library.rows)) else None
    return [*row_fusion_extras(graph, order, used, backend, library.rows, readers),
            *column_broadcasts(graph, order, library.columns),
            *reduction_constants(graph, order, used, library.reductions, prologues, readers)]
