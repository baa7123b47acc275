"""Buffers and their live ranges under an op order: what XLA allocates, and when.

Which values XLA materialises (and the extra buffers it adds) comes from
:mod:`jaxmem.memory.fusion`; this module decides when each buffer is born and when it
dies, including XLA's buffer sharing (an elementwise or in-place op writing into an
operand that dies there).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((4, 8))))
    >>> [b.kind for b in liveness(g)]
    ['argument', 'temp', 'output']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import sympy

from jaxmem.graph import EXPENSIVE, Graph
from jaxmem.memory.columns import Library, library_extras, library_fusions, library_owner
from jaxmem.memory.copies import copied_early
from jaxmem.memory.epilogues import epilogue_broadcasts
from jaxmem.memory.fillers import carried, feeds_loop, stacked_outputs
from jaxmem.memory.fusion import Extra, element_count, transposed_copies, used_nodes
from jaxmem.memory.loop_operands import widened_loop_operands
from jaxmem.memory.precision import (
    buffer_sizes,
    narrow_copy_ranges,
    operand_copies,
    upcast_dots,
)
from jaxmem.memory.random_bits import random_bits_counters, random_bits_sizes
from jaxmem.memory.readers import distinct_full_operands, duplicated_bias_adds, reads
from jaxmem.memory.reductions import reduction_sizes
from jaxmem.memory.scatters import batched_index_tuples, scattered_zeros
from jaxmem.memory.schedule import BFS_BACKENDS
from jaxmem.memory.tree_sums import tree_sum_inputs
from jaxmem.memory.windows import conv_copies, max_pool_gradient_buffers, window_broadcasts
from jaxmem.memory.ynn import row_fused_sizes


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer XLA would allocate for one materialised value.

    Attributes:
        value: the value id whose bytes it holds.
        nbytes: symbolic size.
        start: order position of the node that writes it (-1 for arguments).
        end: last order position that reads it (``len(order)`` for outputs).
        kind: ``argument``, ``output`` or ``temp``.
        note: why a buffer exists that no jaxpr value names (``"transposed copy"``
            of a dot operand XLA must transpose); empty otherwise.
    """

    value: int
    nbytes: sympy.Expr
    start: int
    end: int
    kind: str
    note: str = ""


def liveness(graph: Graph, order: Sequence[int] | None = None,
             backend: str | None = None, owner: dict[int, int] | None = None,
             used: list[bool] | None = None, pairs: Sequence[tuple[int, int]] | None = None,
             library: Library | None = None, state_outputs: bool = False) -> tuple[Buffer, ...]:
    """Buffers and their live ranges when the graph runs in ``order``.

    Args:
        graph: the graph.
        order: a permutation of node indices (program order when None).
        backend: the JAX platform whose XLA rules apply (``jax.default_backend()``
            when None): on CPU, low-precision dots take float32 buffers
            (:mod:`jaxmem.memory.precision`).
        owner: ``library_owner(graph, used, library)``, when the caller has it.
        used: ``used_nodes(graph)``, when the caller has it.
        pairs: ``dot_copies(graph, owner, used)``, when the caller has them.
        library: ``library_fusions(graph, used, backend)``, when the caller has it.
        state_outputs: a loop body's outputs are the state it runs in: no operand's buffer.

    Donation changes no live range (an argument lives for the whole run either way);
    :func:`jaxmem.memory.model.memory_model` subtracts the aliased bytes.

    Returns:
        One :class:`Buffer` per materialised value, then the buffers XLA adds (copies of
        dot operands, broadcast operands, a random-bits loop's counters, ...).
    """
    order = list(range(len(graph.nodes))) if order is None else list(order)
    backend = backend or jax.default_backend()
    used = used_nodes(graph) if used is None else used
    library = library_fusions(graph, used, backend) if library is None else library
    owner = library_owner(graph, used, library) if owner is None else owner
    widened, bits, sizes, narrow = _sizes(graph, order, owner, used, backend, library)
    size = lambda v: sizes.get(v, graph.values[v].nbytes)  # noqa: E731
    duplicated, held = _duplicated(graph, owner, used, backend, library)
    srcs, copied = _buffer_sources(graph, owner, duplicated, held), set[tuple[int, int]]()
    upcast = frozenset(upcast_dots(graph, backend))
    copies = transposed_copies(graph, order, owner, size, copied, used, pairs, upcast)
    base, copied = copied_early(graph, order, owner, used, copies, copied, upcast)
    convs = conv_copies(graph, order, size, copied)
    first_def, last_use = _definitions_and_uses(graph, order, owner, srcs, used, copied,
                                                backend, duplicated, held)
    loops, ends = widened_loop_operands(graph, order, backend)
    _read_by_copies(graph, (*copies, *convs), ends, narrow, base, srcs, owner, last_use)
    outputs = _output_buffers(graph, order, owner, first_def)
    reuse_end, in_output, taken = _shared_buffers(graph, order, owner, srcs, last_use,
                                                  outputs, widened, sizes, state_outputs)
    held = _held_outputs(first_def, outputs, taken)
    buffers = _value_buffers(graph, len(order), owner, outputs, {**first_def, **held},
                             last_use, reuse_end, in_output, size)
    for x in (*copies, *convs, *loops,
              *epilogue_broadcasts(graph, order, owner, first_def, upcast),
              *operand_copies(graph, order, owner, backend, widened, narrow),
              *window_broadcasts(graph, order, used, backend),
              *max_pool_gradient_buffers(graph, order, used, backend),
              *batched_index_tuples(graph, order, backend),
              *scattered_zeros(graph, order, backend, owner),
              *tree_sum_inputs(graph, order, used, backend),
              *random_bits_counters(graph, order, bits),
              *library_extras(graph, order, used, backend, library)):
        buffers.append(Buffer(x.value, x.nbytes, x.start, x.end, "temp", x.note))
    return tuple(buffers)


def _sizes(graph: Graph, order: Sequence[int], owner: dict[int, int], used: Sequence[bool],
           backend: str, library: Library) -> tuple[dict, ...]:
    """``(widened, bits, sizes, narrow)``: buffer bytes that differ from the jaxpr's
    (float32 buffers of low-precision values; a random-bits loop's; all of them, with the
    values library fusions compute from their thresholds on), and the ranges of the
    float32 buffers read narrow too (:func:`~.precision.narrow_copy_ranges`, once for
    :func:`_read_by_copies` and the copies' buffers)."""
    widened, bits = buffer_sizes(graph, owner, backend), random_bits_sizes(graph, backend)
    narrow = (narrow_copy_ranges(graph, owner, {n: p for p, n in enumerate(order)}, widened)
              if widened else {})  # (a float32 program: no positions to build)
    return widened, bits, {
        **widened, **row_fused_sizes(graph, owner, widened, backend, library.rows),
        **reduction_sizes(graph, library.reductions, widened), **bits}, narrow


def _read_by_copies(graph: Graph, copies: Sequence[Extra], ends: dict[int, tuple[int, int]],
                    narrow: dict[int, tuple[int, int, int]],
                    base: dict[int, int], srcs: Callable[[int], frozenset[int]],
                    owner: dict[int, int], last_use: dict[int, int]) -> None:
    """Moves ``last_use`` to where copies read their operands: a dot's or a convolution's
    operand is read when its copy is made, a loop operand XLA widens to float32 when
    it is converted (``ends``: :func:`~jaxmem.memory.loop_operands.widened_loop_operands`),
    and a float32 result some reader needs narrow by its float32 readers only, the others
    reading its copy (``narrow``: :func:`~.precision.narrow_copy_ranges`)."""
    for x in copies:
        for v in _copy_reads(graph, x, base, srcs, owner):
            last_use[v] = max(last_use.get(v, x.start), x.start)
    for v, (loop, end) in ends.items():
        for s in srcs(v):
            if last_use.get(s) == loop:
                last_use[s] = end
    for v, (_, wide_end, _) in narrow.items():
        for s in srcs(v):
            last_use[s] = min(last_use.get(s, wide_end), wide_end)


def _copy_reads(graph: Graph, x: Extra, base: dict[int, int],
                srcs: Callable[[int], frozenset[int]], owner: dict[int, int]) -> frozenset[int]:
    """The buffers copy ``x`` (of a dot's or a convolution's operand) reads: its
    operand's (``base``: a head split's projection), or, where XLA duplicates the
    operand's computation into the copy, that computation's sources, which then live
    until the copy is made. XLA duplicates a cheap elementwise op whose fused work reads
    one buffer of the operand's size (and smaller ones, broadcast): the loss's cotangent
    ``2 * x / n`` (``x`` lives on), a log-softmax's gradient from the saved ``exp``; and a
    float32 one whose operands are one once its CSE merges them
    (:func:`distinct_full_operands`; applied to bfloat16 copies too it put a small bf16
    Llama at +5.2 % where it was +1.1, at (8, 256))."""
    v = base.get(x.value, x.value)
    prod = graph.producers.get(v)
    while prod is not None and graph.nodes[prod].primitive == "name":  # checkpoint_name
        prod = graph.producers.get(graph.nodes[prod].inputs[0])
    node = graph.nodes[prod] if prod is not None else None
    if node is None or node.kind != "elementwise" or node.primitive in EXPENSIVE:
        return frozenset((v,))
    sources = frozenset().union(*[srcs(i) for i in node.inputs])
    size = element_count(graph, v)
    if sum(element_count(graph, s) == size for s in sources) <= 1:
        return sources
    if graph.values[v].dtype != "float32":
        return frozenset((v,))
    direct = any(owner.get(i, i) != -1 for i in node.inputs if element_count(graph, i) == size)
    if ((direct or any(graph.nodes[c].kind == "reduce" for c in graph.consumers.get(v, ())))
            and len(distinct_full_operands(graph, node.inputs, size)) > 1):
        return frozenset((v,))
    return sources


def _duplicated(graph: Graph, owner: dict[int, int], used: Sequence[bool], backend: str,
                library: Library) -> tuple[dict[int, tuple[int, ...]], frozenset[int]]:
    """:func:`duplicated_bias_adds` on XLA's CPU, and the element-wise nodes that read them
    from their buffers all the same (the YNN column sums' prologues)."""
    duplicated = duplicated_bias_adds(graph, owner, used) if backend == "cpu" else {}
    if not duplicated:
        return duplicated, frozenset()
    return duplicated, frozenset(n for c in library.columns for n in c.prologue)


def _buffer_sources(graph: Graph, owner: dict[int, int],
                    duplicated: dict[int, tuple[int, ...]], held: frozenset[int]
                    ) -> Callable[[int], frozenset[int]]:
    """Buffers a value is read from: XLA recomputes a fused value from its sources' buffers."""
    nodes, producers = graph.nodes, graph.producers
    sources: dict[int, frozenset[int]] = {}

    def srcs(v: int) -> frozenset[int]:
        if v in sources:
            return sources[v]
        o = owner.get(v, v)
        if o != -1:
            res = frozenset([o])
        else:
            n = nodes[producers[v]]
            res = frozenset().union(*[srcs(i) for i in reads(n, duplicated, held)])
        sources[v] = res
        return res

    return srcs


def _definitions_and_uses(graph: Graph, order: Sequence[int], owner: dict[int, int],
                          srcs: Callable[[int], frozenset[int]], used: Sequence[bool],
                          copied: set[tuple[int, int]], backend: str,
                          duplicated: dict[int, tuple[int, ...]], held: frozenset[int]
                          ) -> tuple[dict[int, int], dict[int, int]]:
    """Where XLA allocates each buffer (its first writer) and frees it (after its last
    reader); dead code neither writes nor reads, a dot reading an operand through its
    transposed copy (``copied``: node, operand) reads the copy, and an element-wise op
    reads a ``duplicated`` bias add's operands. On a breadth-first ``backend`` a scan's
    stacked outputs are allocated at the start (:func:`stacked_outputs`)."""
    last_use: dict[int, int] = {}
    first_def: dict[int, int] = {}
    nodes = graph.nodes
    for p, ni in enumerate(order):
        n = nodes[ni]
        if not used[ni]:
            continue  # dead code: XLA removes it
        for i in reads(n, duplicated, held):
            o = owner.get(i, i)
            if o != -1:  # a buffer of its own (or a view of one): read in place
                if (ni, o) not in copied and (ni, i) not in copied:
                    last_use[o] = p  # positions only grow: the latest reader is the last
                continue
            for s in srcs(i):
                if (ni, s) not in copied:
                    last_use[s] = p
        for o in n.outputs:
            if o not in first_def and owner.get(o) == o:
                first_def[o] = p
    if backend in BFS_BACKENDS:
        first_def.update({v: 0 for v in stacked_outputs(graph, used) if v in first_def})
    return first_def, last_use


def _output_buffers(graph: Graph, order: Sequence[int], owner: dict[int, int],
                    first_def: dict[int, int]) -> set[int]:
    """The result buffers: XLA writes an output that fused away with the fusion computing it
    (such an output gets its producer's position in ``first_def``)."""
    pos = {n: p for p, n in enumerate(order)}
    outputs = {owner.get(v, v) for v in graph.outputs if owner.get(v, v) != -1}
    for v in graph.outputs:
        if owner.get(v) == -1:
            outputs.add(v)
            first_def.setdefault(v, pos[graph.producers[v]])
    return outputs


def _shared_buffers(graph: Graph, order: Sequence[int], owner: dict[int, int],
                    srcs: Callable[[int], frozenset[int]], last_use: dict[int, int],
                    outputs: set[int], widened: dict[int, sympy.Expr],
                    sizes: dict[int, sympy.Expr], state_outputs: bool = False
                    ) -> tuple[dict[int, int], set[int], dict[int, int]]:
    """XLA's buffer sharing: an elementwise or in-place op writes into an operand dying there.

    Sharing is decided on the sizes before row fusions (``widened``): a row-fused
    value's ``Piecewise`` size (``sizes``) never equals its reader's, though where it is
    materialised (few rows) the two are equal. An operand never fused away is
    preferred: it is a buffer at every shape.

    Returns:
        ``(reuse_end, in_output, taken)``: for each operand whose buffer a result takes
        over, the position before that op (its own range ends there); the
        operands whose buffer ends up as an output (they take no temp bytes); and
        for each of those, the result that took its buffer over.
        Walking backwards lets a result own the buffer from the birth of the
        first operand of a chain.
    """
    def size(v: int) -> sympy.Expr:
        return widened.get(v, graph.values[v].nbytes)

    def fused(v: int) -> bool:
        return sizes.get(v, graph.values[v].nbytes) != size(v)

    inputs = set(graph.inputs)
    reuse_end: dict[int, int] = {}
    in_output: set[int] = set()
    taken: dict[int, int] = {}
    nodes, read = graph.nodes, last_use.keys() | outputs
    for p in range(len(order) - 1, -1, -1):
        n = nodes[order[p]]
        elementwise = n.kind in ("elementwise", "inplace")
        if elementwise:
            operands = list(dict.fromkeys(s for i in n.inputs for s in srcs(i)))
            handed = [(o, operands) for o in n.outputs]
        else:  # a loop: a zeroed accumulator's buffer passes to its final value, and on
            handed = [(o, list(srcs(i))) for i, o in carried(graph, n, read)]
        for o, operands in handed:
            if (owner.get(o) != o or (o in reuse_end and elementwise)
                    or feeds_loop(graph, o) or (state_outputs and o in outputs)):
                continue
            cands = [i for i in operands
                     if owner.get(i, i) == i and i not in inputs and last_use.get(i) == p
                     and size(i) == size(o)
                     and i not in reuse_end and i not in outputs]
            cands.sort(key=fused)
            if n.kind == "inplace" and n.inputs:
                first = srcs(n.inputs[0])
                cands = [c for c in cands if c in first][:1]
            if not cands:
                continue
            if o in outputs or o in in_output:
                in_output.add(cands[0])
                taken[cands[0]] = o
            reuse_end[cands[0]] = p - 1
    return reuse_end, in_output, taken


def _held_outputs(first_def: dict[int, int], outputs: set[int], taken: dict[int, int]
                  ) -> dict[int, int]:
    """Where each output whose buffer an operand hands over is first held: that operand's
    birth.

    Until then a temporary may sit in the output (XLA's buffer assignment; see
    :mod:`jaxmem.memory.reuse`), not after: a train step's stacked weight gradients,
    written into the optimizer's outputs, occupy them from the backward scan on, where
    the model had let the forward scan's stacked residuals sit in them too (XLA: the
    residuals in the outputs, the gradients in the temp allocation; nnx-scan at
    (4, 256), level 1: -9.1 % against XLA with the output free until written).
    """
    held: dict[int, int] = {}
    for v, o in taken.items():
        while o not in outputs and o in taken:
            o = taken[o]
        if o in outputs and v in first_def:
            held[o] = min(held.get(o, first_def.get(o, first_def[v])), first_def[v])
    return held


def _value_buffers(graph: Graph, end: int, owner: dict[int, int], outputs: set[int],
                   first_def: dict[int, int], last_use: dict[int, int],
                   reuse_end: dict[int, int], in_output: set[int],
                   size: Callable[[int], sympy.Expr]) -> list[Buffer]:
    """One buffer per materialised value: XLA keeps arguments and outputs for the whole run.

    Temporaries live from their writer to their last reader (or until a result
    takes their buffer over); an argument returned as is is also copied into an
    output buffer. An argument nothing live reads is no argument of the executable:
    ``jax.jit`` prunes it (``keep_unused=False``), donated or not.
    """
    inputs, buffers, values = set(graph.inputs), [], graph.values
    # Only arguments, outputs and values some node writes can have a buffer: those, in
    # value order (``values[i].id == i``), not every value of the graph.
    for vid in sorted(inputs.union(outputs, first_def)):
        v = values[vid]
        if vid in inputs:
            if vid not in last_use and vid not in outputs:
                continue
            buffers.append(Buffer(vid, v.nbytes, -1, end, "argument"))
            if vid in outputs:
                buffers.append(Buffer(vid, v.nbytes, end, end, "output", "copied argument"))
        elif vid in outputs:
            buffers.append(Buffer(vid, v.nbytes, first_def.get(vid, end), end, "output"))
        elif owner.get(vid) == vid and vid in first_def and vid not in in_output:
            start = first_def[vid]
            stop = reuse_end.get(vid, last_use.get(vid, start))
            buffers.append(Buffer(vid, size(vid), start, max(stop, start), "temp"))
    return buffers
