"""bfloat16 loop operands XLA's CPU backend converts to float32 in full for the loop.

XLA's CPU backend computes bfloat16 in float32. A loop body's read of a bfloat16
operand it does not carry becomes ``convert(dynamic-slice(xs))`` or ``convert(const)``,
and XLA moves the convert out of the loop: the loop runs on a float32 copy of the
whole operand, made as soon as the operand is written (a forward loop's stacks right
after that loop) and live until the loop ends; the operand dies at the convert
(measured on jax 0.10.2, a 4-layer bf16 GPT under ``lax.scan`` at (8, 256): every
bfloat16 stack of residuals the backward loop reads is float32 in its state, 38 % of
XLA's peak left out without this rule). So

* a stacked operand (``xs``) the body reads at all is widened, even when its only
  reader is a dot that takes bfloat16 operands natively (``bf16 x bf16 -> f32``);
* a loop-invariant one (a ``const``) is widened when some reader computes on it in
  float32, not when every reader is such a native dot.

Carried values and stacked outputs stay bfloat16, and so does float16 (which the CPU
backend computes in its own type outside dots). A constant's broadcast is no operand
at all: XLA makes it inside the body (:func:`~jaxmem.memory.fillers.is_sunk`; a
scanned linen bf16 decoder's causal filler, widened, was 32 MiB too many at (8, 512)).
:func:`widened_loop_operands` gives the float32 copies, :func:`as_run` the bodies
reading them.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> bf = jnp.bfloat16
    >>> f = lambda c, a: jax.lax.scan(lambda c, x: (c + x, None), c, jnp.sin(a))[0]
    >>> g = build_graph(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((4, 8), bf),
    ...                                   jax.ShapeDtypeStruct((3, 4, 8), bf)))
    >>> [n.primitive for n in g.nodes]
    ['sin', 'scan']
    >>> copies, ends = widened_loop_operands(g, range(len(g.nodes)), "cpu")
    >>> [(x.nbytes, x.start, x.end) for x in copies], list(ends.values())
    ([(384, 1, 1)], [(1, 0)])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from jaxmem.graph import Graph, Node, replaced, scan_counts
from jaxmem.memory.fillers import is_sunk
from jaxmem.memory.fusion import Extra, float32_bytes
from jaxmem.memory.precision import upcast_dots


def widened_loop_operands(graph: Graph, order: Sequence[int], backend: str
                          ) -> tuple[list[Extra], dict[int, tuple[int, int]]]:
    """The float32 copies of bfloat16 loop operands, and where the operands die.

    XLA converts an operand as soon as it is written (a forward loop's stacks right
    after that loop) and runs the loop on the copy, which lives until the loop ends.
    The operand itself dies at the convert, or at its last other reader.

    Args:
        graph: the graph.
        order: the order its nodes run in.
        backend: a JAX platform name; only ``"cpu"`` converts.

    Returns:
        ``(copies, ends)``: the copies, and for each operand whose last reader is its
        loop, ``(the loop's position, where it is last read instead)``.
    """
    if backend != "cpu":
        return [], {}
    pos = {ni: p for p, ni in enumerate(order)}
    loops: dict[int, list[int]] = {}  # operand -> positions of the loops reading it
    for p, ni in enumerate(order):
        for v in dict.fromkeys(v for v, _ in _converted_operands(graph, graph.nodes[ni])):
            loops.setdefault(v, []).append(p)
    copies, ends = [], {}
    for v, at in loops.items():  # one copy per operand: XLA's CSE shares the convert
        prod = graph.producers.get(v)
        start = pos[prod] + 1 if prod in pos else at[0]
        reads = [pos[c] for c in graph.consumers.get(v, ()) if c in pos and pos[c] not in at]
        if prod in pos and v not in graph.outputs and all(r < at[-1] for r in reads):
            ends[v] = (at[-1], max([start - 1, *reads]))
        copies.append(Extra(v, float32_bytes(graph, v), start, at[-1],
                            "float32 copy of a bfloat16 loop operand"))
    return copies, ends


def _converted_operands(graph: Graph, node: Node) -> Iterator[tuple[int, int]]:
    """The bfloat16 operands of loop ``node`` its (last) body reads through a float32
    convert, each with the body input it is read as."""
    if not node.subgraphs:
        return
    body, native = node.subgraphs[-1], None
    for kind, v, inner in body_operands(node):
        if (v is None or kind == "carry" or graph.values[v].dtype != "bfloat16"
                or is_sunk(graph, v)):  # the body makes it: no operand outside to convert
            continue
        if native is None:
            native = frozenset(n.index for n in body.nodes if n.primitive == "dot_general"
                               ) - frozenset(upcast_dots(body, "cpu"))
        readers = _readers(body, inner)
        if any(r not in native for r in readers) or (kind == "xs" and readers):
            yield v, inner


def body_operands(node: Node) -> Iterator[tuple[str, int | None, int]]:
    """``(kind, operand, body input)`` for each input of loop ``node``'s (last) body: its
    kind (``const``, ``carry``, or ``xs`` for a scan's stacked operands) and the loop's
    operand it reads (None past the operands); nothing for other ops."""
    params = node.eqn.params if node.eqn is not None else {}
    if node.primitive == "scan" and params and node.subgraphs:
        consts, carry = scan_counts(params)
        body, offset = node.subgraphs[0], 0
        kinds = ["const"] * consts + ["carry"] * carry
    elif node.primitive == "while" and "body_nconsts" in params and len(node.subgraphs) > 1:
        body, offset = node.subgraphs[-1], params["cond_nconsts"]
        kinds = ["const"] * params["body_nconsts"]
    else:
        return
    for k, inner in enumerate(body.inputs):
        v = node.operands[offset + k] if offset + k < len(node.operands) else None
        kind = kinds[k] if k < len(kinds) else ("xs" if node.primitive == "scan" else "carry")
        yield kind, v, inner


def _readers(body: Graph, v: int) -> list[int]:
    """The nodes of ``body`` computing on ``v``, through views (none: ``v`` only passes
    through to the body's outputs)."""
    out = []
    for c in body.consumers.get(v, ()):
        n = body.nodes[c]
        if n.kind == "view" and n.primitive != "optimization_barrier":
            for o in n.outputs:
                out.extend(_readers(body, o))
        else:
            out.append(c)
    return out


def widened_inputs(graph: Graph, node: Node, backend: str) -> frozenset[int]:
    """The inputs of loop ``node``'s (last) body that read float32 copies of bfloat16
    operands (:func:`widened_loop_operands`); none off the CPU backend."""
    if backend != "cpu" or not node.subgraphs:
        return frozenset()
    return frozenset(inner for _, inner in _converted_operands(graph, node))


def as_run(body: Graph, inputs: frozenset[int]) -> Graph:
    """``body`` as XLA runs it: ``inputs`` (:func:`widened_inputs`) typed float32, so the
    slices it copies out of them are float32 and its dots read them with no convert of
    their own (the scanned bf16 GPT at (8, 256), level 0: -7.7 % against XLA with the
    body as traced, -4.3 % so, when this rule was first written)."""
    if not inputs:
        return body
    values = list(body.values)
    for v in inputs:
        values[v] = replaced(values[v], dtype="float32", nbytes=float32_bytes(body, v))
    return replaced(body, values=tuple(values))
