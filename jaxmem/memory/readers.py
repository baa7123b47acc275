"""Values XLA keeps although a reader could recompute them, for reasons the jaxpr hides.

:func:`jaxmem.memory.fusion.materialised` recomputes a cheap element-wise value in
each reader, as XLA's fusion pass does. Two kinds it must keep instead:
:func:`erfc_shared_exps`, whose readers XLA's CSE adds, and
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
        if sympy.Mul(*graph.values[u].shape) != size:  # fusion.element_count; no cycle
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
