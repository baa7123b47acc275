"""The buffers XLA CPU's YNN row fusions' operands add (:mod:`jaxmem.memory.ynn`).

A YNN fusion cannot broadcast: a vector it multiplies by (a norm's scale) or a scalar
constant one of its ops reads comes in as a full-size broadcast, and where XLA's CSE
shares that broadcast with ops elsewhere it is a buffer of its own, from its definition
(the step's start, for a constant) until the last fusion reading it
(:func:`shared_row_broadcasts`, :func:`prologue_constants`; both from
:data:`~jaxmem.memory.library.YNN_MIN_ROWS` rows on).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.memory.fusion import used_nodes
    >>> def mlp_norm(x, w):  # gelu's constants, read before the norm's row sums' fusion
    ...     h = jax.nn.gelu(x @ w)
    ...     return (h * h).sum(-1) + jax.nn.gelu(x).sum()
    >>> g = build_graph(jax.make_jaxpr(mlp_norm)(jnp.ones((8192, 64)), jnp.ones((64, 64))))
    >>> order = list(range(len(g.nodes)))
    >>> isinstance(prologue_constants(g, order, used_nodes(g), "cpu"), list)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

from jaxmem.graph import Graph, Node
from jaxmem.memory.constants import ConstantUse, shared_constants
from jaxmem.memory.fusion import Extra
from jaxmem.memory.library import constant_operands, from_rows
from jaxmem.memory.ynn import YNN_ELEMENTWISE, RowFusion, is_row_sum, row_fusions


def prologue_constants(graph: Graph, order: Sequence[int], used: Sequence[bool],
                       backend: str, fusions: list[RowFusion] | None = None,
                       readers: Mapping[tuple, list[int]] | None = None) -> list[Extra]:
    """Full-size broadcasts of the scalar constants a row fusion's prologue reads.

    gelu's constants (0.5, 1, 0.044715, sqrt(2/pi)) are broadcast to the hidden size;
    the backward pass reads the same broadcasts (its gelu derivative, its
    recomputation), so XLA's CSE makes each one op that no longer fuses into the YNN
    fusion: a buffer computed at the program's start (it reads nothing) and read until
    the fusion runs (measured, jax 0.10.2: the plain GPT's last layer at (8, 512), four
    ``wrapped_broadcast`` of f32[8, 512, 1024]; none below :data:`YNN_MIN_ROWS` rows).
    A constant no other op reads at that shape fuses and takes nothing.
    """
    if backend != "cpu":
        return []
    fusions = row_fusions(graph, used) if fusions is None else fusions
    pos = {n: p for p, n in enumerate(order)}
    uses = []
    for reduction, fused, _, chain in fusions:
        reads = chain | _sunk_scalings(graph, fused, used)
        if reads:
            uses.append(ConstantUse(
                frozenset(reads), frozenset(reads), max(pos[n] for n in fused | reads),
                sympy.Mul(*graph.values[graph.nodes[reduction].outputs[0]].shape),
                graph.nodes[reduction].inputs[0]))
    return shared_constants(graph, used, uses, "YNN fusion constant operand", readers=readers)


def _sunk_scalings(graph: Graph, fused: set[int], used: Sequence[bool]) -> set[int]:
    """Element-wise ops by a scalar constant that read a transpose of the fusion's result:
    XLA's simplifier sinks them through the transpose into the fusion (measured, jax
    0.10.2: ``jax.nn.dot_product_attention``'s softmax gradient ends in ``* scale`` after
    moving its group axis, and its YNN fusion reads the scale's broadcast, shared with the
    forward scores', as a buffer: ``wrapped_broadcast``, the scores' size)."""
    out: set[int] = set()
    for n in fused:
        for v in graph.nodes[n].outputs:
            for t in graph.consumers.get(v, ()):
                if t in fused or not used[t] or graph.nodes[t].primitive != "transpose":
                    continue
                readers = [c for c in graph.consumers.get(graph.nodes[t].outputs[0], ())
                           if used[c]]
                if (len(readers) == 1 and graph.nodes[readers[0]].primitive in YNN_ELEMENTWISE
                        and constant_operands(graph, graph.nodes[readers[0]])):
                    out.add(readers[0])
    return out


def shared_row_broadcasts(graph: Graph, order: Sequence[int], used: Sequence[bool],
                          backend: str) -> list[Extra]:
    """Full-size broadcasts of a vector (a norm's scale) that YNN row fusions read.

    A LayerNorm's scale is broadcast along its rows in the forward pass (inside the
    YNN fusion of the norm and the matmul after it) and again in its backward pass
    (``dy * scale``, inside the fusion of the row sums of the input's gradient). XLA's
    CSE makes the two one broadcast, which no longer fuses into either reader: a
    buffer of the rows' size, computed when its vector is (the program's start for a
    parameter) and read until its last reader (measured, jax 0.10.2: the plain GPT's
    ``wrapped_broadcast`` fusions at (8, 512), none at (4, 256), whose norms sum 1024
    rows). Gated on the rows reaching :data:`YNN_MIN_ROWS`, or on the elements where a
    row sum alone reads the product (Flax's LayerNorm: :func:`_summed_alone`). A bfloat16
    norm's scale is broadcast in float32, the precision XLA CPU computes it in (the bf16 GPT's
    ``convert_broadcast_fusion`` operands). A float32 norm's gradient that is a sum of
    cotangents (``add_any``: a Llama's q/k/v or gate/up inputs) is multiplied by the scale
    in a loop fusion that reads the vector itself, so only the forward pass reads its
    broadcast there (:func:`_reads_broadcast_scale`).
    """
    if backend != "cpu":
        return []
    summed = {graph.values[graph.nodes[n.index].inputs[0]].shape
              for n in graph.nodes
              if n.primitive == "reduce_sum" and used[n.index] and is_row_sum(graph, n.index)}
    if not summed:
        return []
    pos = {n: p for p, n in enumerate(order)}
    readers: dict[tuple[int, tuple], list[int]] = {}
    for n in graph.nodes:
        if not used[n.index] or n.kind != "elementwise" or len(n.outputs) != 1:
            continue
        out = graph.values[n.outputs[0]]
        if (out.dtype not in ("float32", "bfloat16") or out.shape not in summed
                or (out.dtype == "float32" and not _reads_broadcast_scale(graph, n))):
            continue
        for v in n.inputs:  # a vector it reads broadcast along its rows
            if graph.values[v].shape == out.shape:
                continue
            src = _vector_source(graph, v, out.shape[-1])
            if src is not None:
                readers.setdefault((src, out.shape), []).append(pos[n.index])
    out = []
    for (src, shape), at in readers.items():
        if len(at) < 2:  # one reader: the broadcast fuses into it
            continue
        p = graph.producers.get(src)
        start = pos[p] if p is not None else 0
        # A product summed alone joins its row sum's YNN fusion from the sum's input
        # elements on; other readers join only once the rows reach the threshold.
        alone = any(_summed_alone(graph, order[q], used) for q in at)
        rows = sympy.Mul(*shape) if alone else sympy.Mul(*shape[:-1])
        nbytes = sympy.expand(4 * sympy.Mul(*shape) * from_rows(rows))
        out.append(Extra(src, nbytes, start, max(at), "norm scale broadcast"))
    return out


def _summed_alone(graph: Graph, node_index: int, used: Sequence[bool]) -> bool:
    """Whether ``node_index``'s output is read by one used op, a row sum (as Flax's
    LayerNorm's gradient of ``rsqrt(var) * scale`` is): YNN then fuses the product and
    reads the scale's broadcast as an operand once the sum's input has
    :data:`YNN_MIN_ROWS` elements (measured, jax 0.10.2: ``nnx.LayerNorm`` over 16 x 256
    and 512 x 64, not 64 x 16; a plain LayerNorm's ``dy * scale``, read three times,
    only from 4096 rows)."""
    readers = [r for r in graph.consumers.get(graph.nodes[node_index].outputs[0], ())
               if used[r]]
    return len(readers) == 1 and is_row_sum(graph, readers[0])


def _reads_broadcast_scale(graph: Graph, node: Node) -> bool:
    """Whether float32 ``node`` reads a norm scale's shared broadcast: a ``mul``, and not by
    a cotangent sum (measured, the 4-layer Llama at (8, 512): its norms' backward
    ``dy * scale`` is a loop fusion reading the parameter, and the broadcast lives only
    through the forward pass)."""
    return node.primitive == "mul" and not any(
        graph.producers.get(v) is not None
        and graph.nodes[graph.producers[v]].primitive == "add_any" for v in node.inputs)


def _vector_source(graph: Graph, v: int, width: sympy.Expr, hops: int = 3) -> int | None:
    """The vector ``v`` is (seen through reshapes and broadcasts to ``[1, ..., width]``),
    when it is one: a value of shape ``(width,)``."""
    for _ in range(hops + 1):
        shape = graph.values[v].shape
        if not shape or shape[-1] != width or any(d != 1 for d in shape[:-1]):
            return None
        if len(shape) == 1:
            return v
        p = graph.producers.get(v)
        if (p is None or graph.nodes[p].primitive not in ("reshape", "broadcast_in_dim")
                or not graph.nodes[p].inputs):
            return None
        v = graph.nodes[p].inputs[0]
    return None


def row_fusion_extras(graph: Graph, order: Sequence[int], used: Sequence[bool],
                      backend: str, fusions: list[RowFusion],
                      readers: Mapping[tuple, list[int]] | None = None) -> list[Extra]:
    """The buffers the row fusions' operands add: :func:`shared_row_broadcasts` and
    :func:`prologue_constants` (``readers``: ``constant_readers``, where known)."""
    return [*shared_row_broadcasts(graph, order, used, backend),
            *prologue_constants(graph, order, used, backend, fusions, readers)]
