"""Buffers XLA's CPU backend adds around convolutions and pooling windows.

Two rules, both read from buffer assignments of a Flax convnet (jax 0.10.2, CPU):

* :func:`conv_copies`: XLA's CPU convolution reads its input as ``[batch, spatial...,
  feature]`` and its kernel as ``[spatial..., in, out]``. An operand laid out otherwise
  (the weight gradient's: the activation with its features as the batch, the cotangent
  as the kernel; the input gradient's kernel, in and out swapped) is first copied into
  that order, as a dot's operand is (:func:`jaxmem.memory.fusion.transposed_copies`).
* :func:`window_broadcasts`: a pooling window that tiles its input (every window dim
  of size > 1 strides by its size, no dilation: ``avg_pool``, ``max_pool``) runs in
  XLA's CPU library (YNN) as one fusion with its elementwise neighbours. Such a fusion
  reads a scalar constant of those ops as a materialised full-size operand when XLA's
  CSE shares the constant's broadcast with another op of the program (the ReLU's 0
  with its gradient's ``select``, ``avg_pool``'s divisor with its transpose's), from
  the start of the program (it reads no argument) until the fusion runs.

The backward pass of a pool pads its cotangent for a stride-1 window
(``pad`` then ``reduce_window``); XLA folds the pad into the window, so the padded
value takes no buffer (:func:`jaxmem.memory.fusion.materialised`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
    ...     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> f = lambda x, w: jax.grad(lambda w: conv(x, w).sum())(w)
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))))
    >>> order = list(range(len(g.nodes)))
    >>> [g.values[x.value].shape for x in conv_copies(g, order, lambda v: v)]
    [(2, 8, 8, 3), (2, 8, 8, 4)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.copies import copy_start
from jaxmem.memory.fusion import Extra
from jaxmem.memory.library import (
    constant_operands,
    constant_readers,
    itemsize,
    library_window,
    pooling_region,
)


def conv_copies(graph: Graph, order: Sequence[int], size: Callable[[int], sympy.Expr],
                reads: set[tuple[int, int]] | None = None) -> list[Extra]:
    """Copies of convolution operands XLA's CPU convolution cannot read as laid out.

    One copy per operand, shared by every convolution reading it the same way, made
    when XLA's breadth-first scheduler makes it (:func:`copy_start`). ``size``: a
    value's buffer bytes. ``reads``, when given, gets each ``(convolution, operand)``
    read through a copy made as soon as the operand is written: the convolution reads
    the copy, and the operand dies once its in-place readers ran (a U-Net's kernel
    gradients read the skip connections' concatenates and the ReLUs in copies made in
    the forward pass: +34 % at level 0 while the model held both).
    """
    pos = {n: p for p, n in enumerate(order)}
    spans: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for ni, v, spec in sorted(_copied_operands(graph), key=lambda c: pos[c[0]]):
        p = pos[ni]
        span = spans.setdefault((v, spec), [min(copy_start(graph, pos, v, p), p), p])
        span[1] = p
        prod = graph.producers.get(v)
        if reads is not None and prod in pos and span[0] == pos[prod] + 1:
            reads.add((ni, v))
    return [Extra(v, size(v), a, b, "convolution operand copy")
            for (v, _), (a, b) in spans.items()]


def conv_copy_pairs(graph: Graph) -> list[tuple[int, int]]:
    """The ``(convolution node, operand)`` pairs XLA reads through a copy
    (:func:`conv_copies`), for its scheduler's queue
    (:func:`jaxmem.memory.schedule.xla_order`)."""
    return [(ni, v) for ni, v, _ in _copied_operands(graph)]


def _copied_operands(graph: Graph) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(convolution node, operand, its layout)`` of each operand laid out otherwise than
    the CPU convolution reads it."""
    out = []
    for node in graph.nodes:
        if node.primitive != "conv_general_dilated":  # before dict(params), for speed
            continue
        params = dict(node.params)
        if "lhs_spec" not in params:
            continue
        for v, spec, canonical in zip(node.inputs[:2], (params["lhs_spec"], params["rhs_spec"]),
                                      (_input_layout, _kernel_layout), strict=False):
            if tuple(spec) != canonical(len(spec)):
                out.append((node.index, v, tuple(spec)))
    return out


def _input_layout(rank: int) -> tuple[int, ...]:
    """``lhs_spec`` of an input read in place: batch first, feature last (NHWC)."""
    return (0, rank - 1, *range(1, rank - 1))


def _kernel_layout(rank: int) -> tuple[int, ...]:
    """``rhs_spec`` of a kernel read in place: spatial dims first, then in, out (HWIO)."""
    return (rank - 1, rank - 2, *range(rank - 2))


def window_broadcasts(graph: Graph, order: Sequence[int], used: Sequence[bool],
                      backend: str) -> list[Extra]:
    """Full-size constant operands of the CPU library's pooling fusions (module docstring).

    Not modelled: the library's size threshold (4096 elements, which XLA decides at
    each shape; the rule assumes every pool is that large).
    """
    if backend != "cpu":
        return []
    pos = {n: p for p, n in enumerate(order)}
    windows = [n for n in graph.nodes if used[n.index] and library_window(graph, n)]
    if not windows:
        return []
    users = constant_readers(graph, used)
    last: dict[tuple, tuple[int, int]] = {}  # key -> (the last pool reading it, its input)
    for w in windows:
        region = pooling_region(graph, w)
        keys = {k for ni in region for k in constant_operands(graph, graph.nodes[ni])}
        for key in keys:
            if any(u not in region for u in users[key]):  # XLA's CSE shares it outside
                last[key] = max(last.get(key, (-1, 0)), (pos[w.index], w.inputs[0]))
    # One buffer per constant and shape, however many pools read it (a pool and its
    # rebuild: two 160 KiB copies too many, bench.unseen's convnet +17 % on a level).
    return [Extra(v, sympy.expand(itemsize * sympy.Mul(*shape)), 0, end,
                  "pooling fusion constant operand")
            for (_, shape, itemsize), (end, v) in last.items()]


#: XLA's CPU expansion of ``select_and_scatter`` indexes with 32-bit integers.
_INDEX_BYTES = 4


def max_pool_gradient_buffers(graph: Graph, order: Sequence[int], used: Sequence[bool],
                              backend: str) -> list[Extra]:
    """The buffers of XLA's CPU expansion of a max pool's gradient (module docstring).

    One iota per dim of each pooled operand's shape (shared by the pools of that shape,
    as XLA's CSE shares them) from the program's start to the last window that reads
    them; the window's maxima with their indices at the window, which runs as soon as
    its operand is written; the selected indices from the next step to the scatter;
    and the zeros the scatter adds into, from the program's start.
    """
    if backend != "cpu":
        return []
    pos = {n: p for p, n in enumerate(order)}
    iotas: dict[tuple[sympy.Expr, ...], list] = {}
    results = set(graph.outputs)
    out = []
    for ni in order:
        node = graph.nodes[ni]
        if node.primitive != "select_and_scatter_add" or not used[ni] or len(node.inputs) != 2:
            continue
        source, operand = (graph.values[v] for v in node.inputs)
        pooled, rank = sympy.Mul(*source.shape), len(operand.shape)
        item_bytes = itemsize(graph, operand.id)
        producer = graph.producers.get(operand.id)
        window, p = (0 if producer is None else pos[producer] + 1), pos[ni]
        span = iotas.setdefault(operand.shape, [operand.id, window])
        span[1] = max(span[1], window)
        out.append(Extra(operand.id, sympy.expand((item_bytes + rank * _INDEX_BYTES) * pooled),
                         window, window, "max-pool gradient: window maxima and indices"))
        out.append(Extra(operand.id, sympy.expand(rank * _INDEX_BYTES * pooled),
                         min(window + 1, p), p, "max-pool gradient: selected indices"))
        if p > 0 and node.outputs[0] not in results:  # a result's zeros are in the output
            out.append(Extra(node.outputs[0], sympy.expand(operand.nbytes), 0, p - 1,
                             "max-pool gradient: zeros the scatter adds into"))
    out.extend(Extra(v, sympy.expand(len(shape) * _INDEX_BYTES * sympy.Mul(*shape)), 0, end,
                     "max-pool gradient: iota of an operand dim") for shape, (v, end)
               in iotas.items())
    return out
