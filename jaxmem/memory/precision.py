"""Low-precision dots a backend computes in float32, and the float32 buffers that costs.

Mixed-precision training keeps float32 parameters and runs matmuls in bfloat16.
XLA's CPU backend has no bfloat16 -> bfloat16 (nor any float16) matmul kernel: its
float normalization rewrites such a dot to read float32 operands and write a
float32 result (measured on jax 0.10.2: ``bf16 x bf16 -> bf16`` and every
``f16`` dot become ``f32 x f32 -> f32``; ``bf16 x bf16 -> f32``, a dot with
``preferred_element_type=float32``, runs natively on bfloat16 operands). So

* each low-precision operand of such a dot is materialised in float32 (a
  convert fusion, shared by every dot reading it: XLA's CSE; in a train step the
  forward and backward dots of a layer share one float32 copy of its weight and
  of its input). Where nothing else reads the low-precision buffer, its producer
  fuses into that convert and the float32 buffer replaces it;
* its result buffer is float32, twice the jaxpr's bytes, unless XLA writes the convert
  after it (a result held narrow: an output, a barrier's, one that bfloat16 readers in
  several fusions read); a float16 one held narrow stays float32 until its last
  element-wise reader, each of which converts it itself.

Low-precision arithmetic runs in float32 too, a convert to the low type after it.
Where a reader converts such a result back to float32 (a norm over a bfloat16
residual stream), XLA keeps the float32 result as the buffer
(:func:`arithmetic_in_float32`).

:func:`buffer_sizes` gives the float32 sizes of the buffers replaced or widened,
:func:`operand_copies` the copies added next to buffers that stay. Other
backends (GPU, TPU) run bfloat16 dots natively: no rule applies there.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> bf = jnp.bfloat16
    >>> g = build_graph(jax.make_jaxpr(lambda x, w: jnp.sin(x @ w))(
    ...     jax.ShapeDtypeStruct((8, 16), bf), jax.ShapeDtypeStruct((16, 4), bf)))
    >>> [g.nodes[i].primitive for i in upcast_dots(g, "cpu")], upcast_dots(g, "gpu")
    (['dot_general'], ())
    >>> buffer_sizes(g, {v: v for v in range(len(g.values))}, "cpu")  # the f32 result
    {2: 128}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.copies import copied_operands
from jaxmem.memory.fusion import Extra, converges, float32_bytes

#: dtypes XLA may widen to float32
LOW_PRECISION = ("bfloat16", "float16")
#: element-wise primitives that move or retype values: XLA runs them at low precision
_NOT_ARITHMETIC = frozenset("""
convert_element_type convert copy copy_p select_n broadcast_in_dim iota transpose slice
concatenate pad rev dynamic_slice squeeze expand_dims split tile stop_gradient
reduce_precision bitcast_convert_type
""".split())


def upcast_dots(graph: Graph, backend: str) -> tuple[int, ...]:
    """Indices of the dots ``backend`` runs in float32 though the jaxpr types them lower.

    Args:
        graph: the graph.
        backend: a JAX platform name (``jax.default_backend()``).
    """
    if backend != "cpu":
        return ()
    out = []
    for n in graph.nodes:
        if n.primitive != "dot_general" or not n.outputs or not n.inputs:
            continue
        ins = {graph.values[i].dtype for i in n.inputs}
        result = graph.values[n.outputs[0]].dtype
        # bf16 x bf16 -> f32 has a kernel; a low-precision result, any f16 or an operand
        # of each type (f32 x bf16: the bfloat16 one converted) has none.
        if "float16" in ins or (ins & set(LOW_PRECISION) and (
                result in LOW_PRECISION or "float32" in ins)):
            out.append(n.index)
    return tuple(out)


def converted_reads(graph: Graph, owner: Mapping[int, int], backend: str
                    ) -> list[tuple[int, int]]:
    """The ``(dot, operand buffer)`` pairs a :func:`upcast_dots` dot reads through a float32
    convert: instructions of their own in XLA's schedule, as transposed copies are."""
    return [(d, o) for o, readers in _low_operands(graph, owner, upcast_dots(graph, backend))
            .items() for d in readers]


def _readers(graph: Graph, owner: Mapping[int, int], v: int) -> list[int | None]:
    """Nodes reading ``v`` through views and through transposes folded into dots (None:
    a view of ``v`` is a program output)."""
    outputs = set(graph.outputs)
    out: list[int | None] = []
    for c in graph.consumers.get(v, ()):
        n = graph.nodes[c]
        folded = n.primitive == "transpose" and all(owner.get(o) == -1 for o in n.outputs)
        if folded or (n.kind == "view" and n.primitive != "optimization_barrier"):
            for o in n.outputs:
                out.extend([None] if o in outputs else [])
                out.extend(_readers(graph, owner, o))
        else:
            out.append(c)
    return out


def _low_operands(graph: Graph, owner: Mapping[int, int], dots: Sequence[int]
                  ) -> dict[int, list[int]]:
    """Low-precision operand buffers of the upcast ``dots`` -> the dots reading each."""
    out: dict[int, list[int]] = {}
    for d in dots:
        for v in dict.fromkeys(graph.nodes[d].inputs):
            o = _through_views(graph, owner, v)
            if graph.values[o].dtype in LOW_PRECISION:
                out.setdefault(o, []).append(d)
    return out


def _through_views(graph: Graph, owner: Mapping[int, int], v: int) -> int:
    """The buffer a dot operand is read from (a transpose folded into the dot: its source)."""
    o = owner.get(v, v)
    while o == -1:
        inputs = graph.nodes[graph.producers[v]].inputs
        if not inputs:  # fused from constants alone (a broadcast literal): no buffer to widen
            return v
        v = inputs[0]
        o = owner.get(v, v)
    return o


def _replaced(graph: Graph, owner: Mapping[int, int], o: int, dots: set[int]) -> bool:
    """Whether the float32 convert replaces buffer ``o``: only upcast dots read it and its
    producer is elementwise (so it fuses into the convert)."""
    if o in graph.inputs or o in graph.outputs:
        return False
    p = graph.producers.get(o)
    if p is None or graph.nodes[p].kind != "elementwise":
        return False
    return all(r is not None and r in dots for r in _readers(graph, owner, o))


def _held_narrow(graph: Graph, owner: Mapping[int, int], v: int) -> bool:
    """Whether dot result ``v`` is kept at its own low precision: XLA writes the convert
    after the float32 dot, and the float32 result dies at once, where it cannot fuse that
    convert into the readers. So for a program output, a result a loop or an output view
    reads, and one an optimization barrier reads beside other readers (measured: a
    segment plan's barrier over a bf16 Llama's saved MLP projections holds
    ``wrapped_convert`` bf16 buffers); a barrier that is the only reader gets the float32
    result, the convert sunk past it. And for a bfloat16 result whose readers do not meet
    in one element-wise op: one ``wrapped_convert`` they all read (measured, jax 0.10.2:
    ``sin(h)`` and ``cos(h)`` as two outputs; the forward and backward readers of a
    GELU's input)."""
    readers = set(_readers(graph, owner, v))
    barriers = {r for r in readers
                if r is not None and graph.nodes[r].primitive == "optimization_barrier"}
    return (v in graph.outputs
            or any(r is None or graph.nodes[r].kind == "control" for r in readers)
            or 0 < len(barriers) < len(readers)
            or (graph.values[v].dtype == "bfloat16" and len(readers) > 1
                and not converges(graph, v, set(graph.outputs))))


def _widened_reader(graph: Graph, owner: Mapping[int, int], r: int | None) -> bool:
    """Whether reader ``r`` converts to float32 inside its fusion (its result fused)."""
    if r is None:
        return False
    n = graph.nodes[r]
    return (n.primitive == "convert_element_type" and bool(n.outputs)
            and graph.values[n.outputs[0]].dtype == "float32"
            and owner.get(n.outputs[0], n.outputs[0]) != n.outputs[0])


def _narrow_reader(graph: Graph, r: int | None) -> bool:
    """Whether reader ``r`` reads a low-precision buffer, not a convert it can fuse: a
    program output, a loop, a barrier."""
    return (r is None or graph.nodes[r].kind == "control"
            or graph.nodes[r].primitive == "optimization_barrier")


def arithmetic_in_float32(graph: Graph, owner: Mapping[int, int], backend: str
                          ) -> dict[int, list[int | None]]:
    """Low-precision element-wise results ``backend`` writes in float32 -> their readers.

    XLA's CPU backend computes low-precision arithmetic in float32, a convert to the
    low type after it. Where a reader converts the result to float32 (a norm's
    ``x.astype(float32)`` of a bfloat16 residual stream), the float32 result is the
    buffer, and every reader rounds it itself (measured, jax 0.10.2: the residual adds
    of a bfloat16 decoder are ``f32`` ``bitcast_add_fusion`` buffers at every shape).
    A reader that cannot fuse the rounding (see :func:`_narrow_reader`) reads a
    low-precision copy besides. Not so a softmax's ``exp`` (:func:`softmax_exps`).
    """
    if backend != "cpu":
        return {}
    out: dict[int, list[int | None]] = {}
    exps = softmax_exps(graph)
    for n in graph.nodes:
        if len(n.outputs) != 1 or graph.values[n.outputs[0]].dtype not in LOW_PRECISION:
            continue
        v = n.outputs[0]
        if (n.kind != "elementwise" or n.primitive in _NOT_ARITHMETIC
                or owner.get(v, v) != v or v in graph.outputs or v in exps):
            continue
        direct = [graph.nodes[c] for c in graph.consumers.get(v, ())]
        if not any(c.primitive == "convert_element_type" or c.kind == "view" for c in direct):
            continue  # no float32 reader, directly or through a view: skip the walk
        readers = _readers(graph, owner, v)
        if any(_widened_reader(graph, owner, r) for r in readers):
            out[v] = readers
    return out


#: ops between a row max and ``x - max`` in a softmax (``max(m, -inf)``, broadcast back)
_MAX_PATH = frozenset({"max", "stop_gradient", "broadcast_in_dim"})


def softmax_exps(graph: Graph) -> set[int]:
    """Low-precision ``exp(x - max(x))`` results, ``max`` a row max (a softmax computed in
    bfloat16, as Flax's attention does with ``dtype=bfloat16``).

    XLA's CPU backend writes such an ``exp`` in float32 (a loop fusion, or the YNN
    fusion of the row max from 4096 rows on), for the row sum's fusion to read, and a
    convert of its own keeps it narrow for the other readers: not
    :func:`arithmetic_in_float32`'s float32 buffer (measured, jax 0.10.2: a ``bf16``
    ``wrapped_convert`` per softmax at 2048 and 8192 rows; a bf16 linen decoder's level 0
    at (8, 256) was +9.7 % with the float32 buffer, +0.7 % without).
    """
    out: set[int] = set()
    for n in graph.nodes:
        if (n.primitive != "reduce_max" or not n.inputs or not n.outputs
                or graph.values[n.inputs[0]].dtype not in LOW_PRECISION
                or dict(n.params).get("axes") != (len(graph.values[n.inputs[0]].shape) - 1,)):
            continue
        x, seen, frontier = n.inputs[0], set(), [n.outputs[0]]
        while frontier:  # the max through views, ``max(m, -inf)`` and broadcasts to x - m
            for c in graph.consumers.get(frontier.pop(), ()):
                r = graph.nodes[c]
                if r.primitive == "sub" and r.inputs and r.inputs[0] == x:
                    out.update(graph.nodes[e].outputs[0]
                               for e in graph.consumers.get(r.outputs[0], ())
                               if graph.nodes[e].primitive == "exp")
                elif ((r.kind == "view" or r.primitive in _MAX_PATH) and len(r.outputs) == 1
                      and r.outputs[0] not in seen):
                    seen.add(r.outputs[0])
                    frontier.append(r.outputs[0])
    return out


def _float32_exps(graph: Graph, owner: Mapping[int, int], pos: Mapping[int, int],
                  exps: set[int]) -> list[Extra]:
    """The float32 result of each ``exp`` of ``exps`` (:func:`softmax_exps`), from its
    producer to the readers converting it to float32 (the row sum), which read it before
    the convert."""
    out = []
    for v in exps:
        p = graph.producers[v]
        if p not in pos:
            continue
        wide = [pos[c] for r in _readers(graph, owner, v) if _widened_reader(graph, owner, r)
                for c in graph.consumers.get(graph.nodes[r].outputs[0], ()) if c in pos]
        out.append(Extra(v, float32_bytes(graph, v), pos[p], max([pos[p], *wide]),
                         "float32 exp before its convert"))
    return out


def buffer_sizes(graph: Graph, owner: Mapping[int, int], backend: str) -> dict[int, sympy.Expr]:
    """Buffers ``backend`` keeps in float32 though the jaxpr types them lower: value id ->
    bytes (results of upcast dots, and operands only upcast dots read)."""
    dots = upcast_dots(graph, backend)
    sizes = {v: float32_bytes(graph, v) for v in arithmetic_in_float32(graph, owner, backend)}
    for d in dots:
        w = graph.nodes[d].outputs[0]
        if graph.values[w].dtype in LOW_PRECISION and not _held_narrow(graph, owner, w):
            sizes[w] = float32_bytes(graph, w)
    chosen = set(dots)
    for o in _low_operands(graph, owner, dots):
        if o not in sizes and _replaced(graph, owner, o, chosen):
            sizes[o] = float32_bytes(graph, o)
    return sizes


def narrow_copy_ranges(graph: Graph, owner: Mapping[int, int], pos: Mapping[int, int],
                       widened: Mapping[int, sympy.Expr]) -> dict[int, tuple[int, int, int]]:
    """Each float32-written arithmetic result (in ``widened``, :func:`buffer_sizes`) a
    reader needs narrow (:func:`_narrow_reader`) -> ``(its producer's position, the last
    read of the float32 buffer, the last read of its low-precision copy)``.

    XLA converts such a result once; the readers converting it to float32 in their
    fusion (a norm's) read the float32 buffer, every other reader the convert (measured,
    jax 0.10.2: the residual adds of bf16 decoders kept for a segment's rebuild; a linen
    decoder's next norm reads the float32 add, the next add and the barrier the
    ``wrapped_convert``: the float32 buffer held to the last reader put a segment level
    at (8, 512) 11 % over XLA; a Llama's RMS norm reads it again in the backward pass)."""
    out = {}
    for v in widened:
        p = graph.producers.get(v)
        if p is None or p not in pos or graph.nodes[p].kind != "elementwise":
            continue  # a dot's result: held narrow by its own rule
        readers = [r for r in _readers(graph, owner, v) if r is None or r in pos]
        if not any(_narrow_reader(graph, r) for r in readers):
            continue
        wide = [pos[c] for r in readers if _widened_reader(graph, owner, r)
                for c in (r, *graph.consumers.get(graph.nodes[r].outputs[0], ())) if c in pos]
        out[v] = (pos[p], max(wide, default=pos[p]),
                  max(len(pos) if r is None else pos[r] for r in readers))
    return out


def operand_copies(graph: Graph, order: Sequence[int], owner: Mapping[int, int],
                   backend: str, widened: Mapping[int, sympy.Expr] | None = None,
                   narrow: Mapping[int, tuple[int, int, int]] | None = None) -> list[Extra]:
    """Float32 copies of low-precision dot operands whose own buffer stays (an argument,
    a buffer other ops read, a dot's result), one per buffer, from the first upcast dot
    reading it to the last; and the float32 result, at its dot only, of each upcast dot
    whose result is held narrow (not in ``widened``); the low-precision copy of each
    :func:`arithmetic_in_float32` result a barrier, loop or output reads; and the float32
    result of each :func:`softmax_exps` ``exp`` until its convert. ``widened``:
    ``buffer_sizes(graph, owner, backend)``, and ``narrow``: :func:`narrow_copy_ranges`
    over ``order``, when the caller has them."""
    widened = buffer_sizes(graph, owner, backend) if widened is None else widened
    dots = upcast_dots(graph, backend)
    exps = softmax_exps(graph) if backend == "cpu" else set()
    if not dots and not widened and not exps:
        return []  # a float32 program: no pass over the order
    pos = {n: p for p, n in enumerate(order)}
    narrow = narrow_copy_ranges(graph, owner, pos, widened) if narrow is None else narrow
    out = [Extra(v, graph.values[v].nbytes, start, end, "low-precision copy")
           for v, (start, _, end) in narrow.items()] + _float32_exps(graph, owner, pos, exps)
    chosen = set(dots)
    for o, readers in _low_operands(graph, owner, dots).items():
        # A transposed copy is the convert of the dots reading through it (f32 copies).
        at = [pos[d] for d in readers if not _copied_by(graph, owner, d, o)]
        if not at or (o in widened and _replaced(graph, owner, o, chosen)):
            continue
        out.append(Extra(o, float32_bytes(graph, o), min(at), max(at), "float32 operand copy"))
    for d in dots:  # a result held narrow is float32 until its convert, right after it
        w = graph.nodes[d].outputs[0]
        if (graph.values[w].dtype in LOW_PRECISION and w not in widened and d in pos
                and owner.get(w, w) == w):
            out.append(Extra(w, float32_bytes(graph, w), pos[d], _last_fused_read(graph, owner,
                             pos, d, w), "float32 dot result"))
    return out


def _copied_by(graph: Graph, owner: Mapping[int, int], d: int, o: int) -> bool:
    """Whether dot ``d`` reads buffer ``o`` through a transposed copy."""
    return any(_through_views(graph, owner, v) == o
               for v in copied_operands(graph, graph.nodes[d], owner))


def _last_fused_read(graph: Graph, owner: Mapping[int, int], pos: Mapping[int, int], d: int,
                     w: int) -> int:
    """Where the float32 result of dot ``d`` (its low-precision result ``w`` held narrow)
    dies. A float16 result: at the last element-wise reader of ``w``, each of which fuses
    its own convert and reads the float32 buffer (measured, jax 0.10.2: a float16 MLP's
    saved ``gelu`` input, also read by order barriers, stays ``f32`` until the ``gelu``
    gradient's fusion). A bfloat16 one: at the dot, one ``wrapped_convert`` its only
    reader (the same MLP in bfloat16)."""
    if graph.values[w].dtype != "float16":
        return pos[d]
    fused = [pos[r] for r in _readers(graph, owner, w)
             if r is not None and r in pos and graph.nodes[r].kind == "elementwise"]
    return max([pos[d], *fused])
