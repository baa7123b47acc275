"""A loop's state and constant filler: which buffers XLA runs a loop in, and broadcasts of a
constant scalar XLA runs inside the loop.

:func:`carried` pairs a loop's zeroed accumulators with the gradients they become (one
buffer), :func:`feeds_loop` tells a loop's operand, :func:`stacked_outputs` lists the
stacked outputs allocated at the start, and :func:`added_updates` the zeroed slice
updates a loop body's gradient adds in place.

A causal mask's filler (``jnp.where(mask, s, -1e9)``'s broadcast, and the zeros of its
transpose) is loop-invariant, so JAX's partial evaluation hoists it out of the scan
bodies and the loops read it as a constant operand. Lowered, XLA has it inside the
loop's body, where it fuses into its readers: outside, no buffer holds it.
:func:`jaxmem.memory.fusion.materialised` gives such a broadcast no buffer.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> def f(x):
    ...     fill = jnp.broadcast_to(jnp.broadcast_to(-1e9, (8,))[None], (3, 8))
    ...     return jax.lax.scan(lambda c, _: (c + fill, None), x, length=4)[0]
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((3, 8))))
    >>> [g.values[v].shape for v in sunk_broadcasts(g)]
    [(3, 8)]
"""

from __future__ import annotations

from collections.abc import Container

from jaxmem.graph import Graph, Node, scan_counts


def sunk_broadcasts(graph: Graph) -> frozenset[int]:
    """Broadcasts of a constant scalar whose loops run them inside.

    Lowered to HLO, a broadcast of a constant that a loop reads is moved into the
    loop's body (it is there in the HLO before XLA's passes), where it fuses into its
    readers; outside, no buffer holds it (a causal mask's filler: two 32 MiB
    broadcasts at (8, 512) that gpt-scan's loops read, absent from XLA's loop state).
    A broadcast of a broadcast of one (Flax NNX's filler) is folded into one first.
    A value computed from an ``iota``, like the mask itself, stays, and so does a
    loop's initial state (:func:`_loop_state`). Not modelled: in the user's own
    function (level 0) a broadcast that a call returns (``jnp.where``'s ``jit``)
    stays in the loop's state; only the rewritten graphs, lowered flat, have the
    broadcast itself feed the loop. Level 0 of gpt-scan at (2, 64) is then
    under-predicted by its 64 KiB (-8.3 % where -7.3 % without the rule).

    Args:
        graph: the graph.

    Returns:
        The value ids of those broadcasts.
    """
    return frozenset(n.outputs[0] for n in graph.nodes
                     if n.primitive == "broadcast_in_dim" and is_sunk(graph, n.outputs[0]))


def is_sunk(graph: Graph, v: int) -> bool:
    """Whether ``v`` is one of :func:`sunk_broadcasts`: no loop's operand outside its body."""
    producer = graph.producers.get(v)
    return (producer is not None and graph.nodes[producer].primitive == "broadcast_in_dim"
            and v in graph.constant
            # the cheap test first: most broadcasts feed no loop
            and _only_read_by_loops(graph, v)
            and _filled_from_scalar(graph, graph.nodes[producer]))


def stacked_outputs(graph: Graph, used: list[bool]) -> list[int]:
    """The stacked outputs (``ys``) of the used scans.

    JAX lowers a scan to a loop whose state holds a zero-filled buffer per stacked
    output; the filler reads nothing, so a breadth-first scheduler makes it among the
    program's first instructions, and the buffer lives from there (an RNN's hidden
    states, stacked while its input projection is computed: -14 -> 0 %).
    """
    ys: list[int] = []
    for n in graph.nodes:
        if n.primitive == "scan" and used[n.index] and n.eqn is not None:
            ys.extend(n.outputs[scan_counts(n.eqn.params)[1]:])
    return ys


def added_updates(graph: Graph) -> frozenset[int]:
    """Values XLA folds into an add: a ``dynamic_update_slice`` into a broadcast zero that
    only an add reads, and that zero.

    XLA rewrites ``A + DUS(0, U, i)`` to ``DUS(A, A[i] + U, i)``, in place in ``A``: the
    transpose of a scan body's ``params[i]`` accumulates its gradient so, one slice a
    step, where the model had a zeroed copy of all the layers' params in every step
    (+28 % on a six-layer loop at 8 rows).
    """
    out: set[int] = set()
    for n in graph.nodes:
        if n.primitive != "dynamic_update_slice" or not n.inputs or len(n.outputs) != 1:
            continue
        base, (o,) = n.inputs[0], n.outputs
        zero = graph.producers.get(base)
        readers = graph.consumers.get(o, ())
        if (zero is not None and _zero_fill(graph.nodes[zero])
                and graph.consumers.get(base) == (n.index,) and len(readers) == 1
                and graph.nodes[readers[0]].primitive in ("add", "add_any")):
            out.update((o, base))
    return frozenset(out)


def _zero_fill(node: Node) -> bool:
    """Whether ``node`` broadcasts a literal zero."""
    if node.primitive != "broadcast_in_dim" or node.eqn is None or not node.eqn.invars:
        return False
    val = getattr(node.eqn.invars[0], "val", None)
    return val is not None and getattr(val, "shape", ()) == () and val == 0


def feeds_loop(graph: Graph, v: int) -> bool:
    """Whether a loop reads ``v``: XLA colocates a loop's operands with its state, in an
    allocation of their own, so ``v`` cannot be written into a dying operand's buffer
    (an RNN's input projection ``x @ w + b``, scanned over: both live; -41 -> 0 %)."""
    return any(graph.nodes[c].primitive in _LOOPS
               for c in graph.consumers.get(v, ()))


def _only_read_by_loops(graph: Graph, v: int) -> bool:
    """Whether loops read ``v``, none of them as its initial state."""
    loops = [graph.nodes[c] for c in graph.consumers.get(v, ())
             if graph.nodes[c].primitive in _LOOPS]
    return bool(loops) and all(v not in _loop_state(loop) for loop in loops)


def carried(graph: Graph, loop: Node, read: Container[int]) -> tuple[tuple[int, int], ...]:
    """``(initial value, final value)`` of each zero-filled element of a loop's state whose
    final value is read (in ``read``): XLA keeps the two in one buffer.

    XLA runs a loop in its initial values' buffers: a backward scan's zeroed gradient
    accumulator becomes the gradient, which the optimizer's update then writes as its
    output (a scan indexing its layers' params by a carried counter was +19 % at (8, 16)
    with two buffers at the loop). The same holds for any state whose initial value
    dies at the loop, but handing those over too (a forward loop's residual stream, an
    incoming cotangent) made three loop programs of ``bench.unseen`` 1.5 to 4 points
    worse, so it is left out; a zero-filled state nothing reads after the loop keeps a
    buffer of its own beside the loop's (measured). Not a loop: no pairs.
    """
    inits = _state_operands(loop)
    return tuple((i, o) for i, o in zip(inits, loop.outputs[:len(inits)], strict=True)
                 if i is not None and o in read and _zero_filled(graph, i))


def _zero_filled(graph: Graph, v: int) -> bool:
    producer = graph.producers.get(v)
    return producer is not None and _zero_fill(graph.nodes[producer])


def _loop_state(loop: Node) -> frozenset[int]:
    """The operands a loop carries (its state's initial values).

    XLA runs the loop in their buffer, made when its breadth-first scheduler reaches
    it: a backward scan's zeroed gradient accumulators live from before the forward
    scan (13 MiB of nnx-scan's peak at (4, 256), level 1).
    """
    return frozenset(v for v in _state_operands(loop) if v is not None)


def _state_operands(loop: Node) -> tuple[int | None, ...]:
    """A loop's operands that initialise its state, in order (empty: not a loop).
    A ``scan``'s consts and ``xs``, and a ``while``'s consts, are only read."""
    params = loop.eqn.params if loop.eqn is not None else {}
    if loop.primitive == "scan" and params:
        consts, carry = scan_counts(params)
        return loop.operands[consts:consts + carry]
    if loop.primitive == "while" and "body_nconsts" in params:
        return loop.operands[params["cond_nconsts"] + params["body_nconsts"]:]
    return ()


def _filled_from_scalar(graph: Graph, node: Node, hops: int = 8) -> bool:
    """Whether ``node`` broadcasts a constant scalar, directly or through broadcasts,
    reshapes and converts of one (XLA's simplifier folds the chain into one broadcast:
    Flax NNX's causal filler is broadcast to (b, h, s, s), then again for the scan's
    axis, a 64 MiB float32 buffer at (16, 512) that XLA's loop state holds none of).
    A broadcast of an ``iota``'s value is not filler."""
    for _ in range(hops):
        operand = node.inputs[0] if node.inputs else None
        producer = graph.producers.get(operand) if operand is not None else None
        if operand is None or len(graph.values[operand].shape) == 0:
            return producer is None or graph.nodes[producer].primitive != "iota"
        if producer is None or graph.nodes[producer].primitive not in _FILL_CHAIN:
            return False
        node = graph.nodes[producer]
    return False


_LOOPS = frozenset({"scan", "while"})
_FILL_CHAIN = frozenset({"broadcast_in_dim", "reshape", "convert_element_type"})
