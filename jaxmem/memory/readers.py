"""Values XLA keeps although a reader could recompute them, for reasons the jaxpr hides.

:func:`jaxmem.memory.fusion.materialised` recomputes a cheap element-wise value in
each reader, as XLA's fusion pass does. Two kinds it must keep instead:
:func:`erfc_shared_exps` and :func:`shared_squares`, whose readers XLA's CSE adds, and
:func:`low_precision_arithmetic`, which XLA's CPU backend does not duplicate. The
other way round, :func:`distinct_full_operands` counts an op's operands as XLA's CSE
leaves them: an op whose operands are one XLA does duplicate.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(jax.make_jaxpr(jax.grad(
    ...     lambda x: jax.nn.gelu(x, approximate=False).sum()))(jnp.ones((4, 8))))
    >>> len(erfc_shared_exps(g))
    1
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

from jaxmem.graph import Graph, Node
from jaxmem.memory.library import element_count


def low_precision_arithmetic(graph: Graph, node: Node, v: int) -> bool:
    """Whether ``node`` computes ``v`` in 16-bit floats by arithmetic (not a convert,
    broadcast or transpose, which XLA still folds into each reader).

    XLA's CPU backend computes such an op in float32 between converts and keeps the
    rounded result its readers share rather than recomputing it in each (measured: a
    bf16 GELU's ``h + b``, ``h ** 2`` and ``0.5 * (1 + tanh)``, read forward and
    backward, get bf16 buffers; in float32 they fuse into their readers)."""
    return (graph.values[v].dtype in ("bfloat16", "float16")
            and node.primitive not in ("convert_element_type", "broadcast_in_dim", "transpose"))


def erfc_shared_exps(graph: Graph) -> frozenset[int]:
    """``exp(-x**2)`` values XLA's CSE also hands to an ``erfc(x)``: XLA expands erfc into a
    polynomial that computes ``exp(-x*x)`` itself, and its CSE merges that with the one
    erfc's derivative computes (exact GELU's backward), so the exp has one more reader
    than the jaxpr shows (measured: a forward ``negate_exponential_fusion`` is kept for
    the backward pass)."""
    nodes, producers = graph.nodes, graph.producers

    def source(v: int, primitive: str) -> int | None:
        p = producers.get(v)
        node = nodes[p] if p is not None else None
        if node is None or node.primitive != primitive or not node.inputs:
            return None
        return node.inputs[0]

    erfc_inputs = {n.inputs[0] for n in nodes if n.primitive == "erfc" and n.inputs}
    if not erfc_inputs:
        return frozenset()
    out = set()
    for n in nodes:
        if n.primitive != "exp" or not n.inputs:
            continue
        negated = source(n.inputs[0], "neg")
        if negated is not None and source(negated, "square") in erfc_inputs:
            out.update(n.outputs)
    return frozenset(out)


def _power(node: Node) -> int | None:
    """The exponent of an ``integer_pow`` or ``square`` node, else None."""
    if node.primitive == "square":
        return 2
    if node.primitive != "integer_pow" or node.eqn is None:
        return None
    return node.eqn.params.get("y")


def shared_squares(graph: Graph) -> frozenset[int]:
    """``x ** 2`` values XLA's CSE also hands to an ``x ** k`` (``k >= 3``) of the same
    ``x``: JAX lowers integer powers to products by repeated squaring, so both compute
    ``x * x`` and the CSE merges them, one more reader than the jaxpr shows (measured,
    jax 0.10.2: the ``3 * h ** 2`` of a bfloat16 tanh-GELU's derivative reads a forward
    ``h ** 2`` buffer that the ``h ** 3`` shares). Only bfloat16 squares: in float32 and
    float16 XLA recomputes the square in each reader all the same (the same GELU)."""
    by_base: dict[int, list[tuple[int, int]]] = {}
    for n in graph.nodes:
        y = _power(n)
        if (y is not None and n.inputs and n.outputs
                and graph.values[n.outputs[0]].dtype == "bfloat16"):
            by_base.setdefault(n.inputs[0], []).append((y, n.outputs[0]))
    return frozenset(v for powers in by_base.values() if any(y >= 3 for y, _ in powers)
                     for y, v in powers if y == 2)


#: elementwise primitives whose operands XLA's CSE compares as a multiset
_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})


def distinct_full_operands(graph: Graph, inputs: Sequence[int], size: sympy.Expr
                           ) -> set[object]:
    """The operands of ``size`` elements of an op, as XLA's CSE leaves them (``x * y`` and
    ``y * x`` are one; broadcasts are left out). XLA duplicates an op whose operands are
    one into every consumer: ``x * x``'s gradient ``ct * x + x * ct`` is computed from
    ``ct`` and ``x`` again in its transposed copy (measured, jax 0.10.2)."""
    keys: set[object] = set()
    for u in dict.fromkeys(inputs):
        if element_count(graph, u) != size:
            continue
        p = graph.producers.get(u)
        node = graph.nodes[p] if p is not None else None
        if node is None or node.kind != "elementwise":
            keys.add(u)
        elif node.primitive != "broadcast_in_dim":
            ins = tuple(node.inputs)
            keys.add((node.primitive, _all_params(node),
                      tuple(sorted(ins)) if node.primitive in _COMMUTATIVE else ins))
    return keys


def _all_params(node: Node) -> str:
    """Every parameter of ``node``'s equation (``Node.params`` keeps only those later
    stages read: ``x ** 2`` and ``x ** 3`` must not be one to CSE)."""
    if node.eqn is None:
        return repr(node.params)
    return repr(sorted(node.eqn.params.items()))


def duplicated_bias_adds(graph: Graph, owner: dict[int, int], used: Sequence[bool]
                         ) -> dict[int, tuple[int, ...]]:
    """Kept bias adds that XLA also recomputes inside each element-wise reader: value ->
    the operands those readers read instead.

    A dot's result plus a broadcast vector is effectively unary, so XLA's fusion pass may
    duplicate it into every consumer it can fuse into
    (``InstructionFusion::EffectivelyAtMostUnary``), though a library reduction (a
    BatchNorm's batch statistics) or a rebuild's barrier still reads it from a buffer of
    its own: the dot's result then lives until the last element-wise reader (measured: a
    BatchNorm MLP's ``Dense`` output read by the backward pass's ``mul``, three
    ``[rows, 4d]`` buffers a layer where the model had two, -20 to -30 %). So does a YNN
    column sum's prologue (:func:`reads`' ``held``: a BatchNorm's ``x - mean`` read by its
    scale's gradient, ``broadcast_subtract_fusion``, lives into the backward pass). So is a float32
    convert's (a LayerNorm's ``x - mean`` of a bf16 residual stream: the float32 stream
    lives into the norm's gradient; the small bf16 GPT at (8, 256): -6.2 -> -2.3 %). Float32 only:
    XLA's CPU backend keeps a 16-bit add's rounded result for its readers
    (:func:`low_precision_arithmetic`; with them, the bf16 GPT's levels +5 to +11 %)."""
    out: dict[int, tuple[int, ...]] = {}
    producers, nodes, outputs = graph.producers, graph.nodes, set(graph.outputs)
    for n in nodes:
        if (not used[n.index] or n.primitive not in ("add", "sub") or len(n.outputs) != 1
                or owner.get(n.outputs[0]) != n.outputs[0] or n.outputs[0] in outputs
                or graph.values[n.outputs[0]].dtype != "float32"):
            continue
        size = element_count(graph, n.outputs[0])
        full = [v for v in n.inputs if element_count(graph, v) == size and (
            (p := producers.get(v)) is None or nodes[p].primitive != "broadcast_in_dim")]
        buffer = owner.get(full[0], full[0]) if len(full) == 1 else -1  # (through views)
        p = producers.get(buffer) if buffer != -1 else None
        readers = graph.consumers.get(n.outputs[0], ())
        if (p is not None and (nodes[p].primitive == "dot_general" or _widening(graph, nodes[p]))
                and any(used[c] and nodes[c].kind == "elementwise" for c in readers)):
            out[n.outputs[0]] = tuple(n.inputs)
    return out


def _widening(graph: Graph, node: Node) -> bool:
    """A float32 convert of a low-precision sum (a bf16 residual stream, for its norm),
    which XLA's CPU backend computes in float32 and keeps so (an argument's convert fuses
    into its readers instead)."""
    if node.primitive != "convert_element_type" or not node.inputs:
        return False
    p = graph.producers.get(node.inputs[0])
    return (p is not None and graph.nodes[p].primitive in ("add", "add_any")
            and graph.values[node.inputs[0]].dtype in ("bfloat16", "float16"))


def reads(node: Node, duplicated: dict[int, tuple[int, ...]],
          held: frozenset[int] = frozenset()) -> Sequence[int]:
    """The values element-wise ``node`` reads, with each :func:`duplicated_bias_adds` value
    replaced by its operands (any other node reads its inputs, and so do the ``held``
    nodes: a YNN column sum's prologue reads a bias add from its buffer, as YNN does
    not broadcast). Runs per node in every memory model: the common case hands back
    ``node.inputs`` uncopied."""
    if not duplicated or node.kind != "elementwise" or node.index in held:
        return node.inputs
    return [x for i in node.inputs for x in duplicated.get(i, (i,))]
