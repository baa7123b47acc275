"""The float32 copy of its input XLA's CPU backend writes for a bfloat16 sum.

A ``reduce_sum`` of bfloat16 values (JAX's transpose of a broadcast and a softmax's
gradient sum in the type they have; ``jnp.sum`` does not, it sums in float32)
accumulates in float32 on XLA's CPU backend, which splits it, from
:data:`TREE_MIN_ELEMENTS` reduced elements on, into a ``reduce-window`` of partial sums
and a reduce of those. The window reads its input from memory: a float32 convert of
the whole input, written right before it (measured, jax 0.10.2: ``f32[8,512,256]`` for
a bf16 bias gradient over the first two axes of ``[8, 512, 256]``, ``f32[64,128,128]``
for a bf16 softmax gradient's row sum; none over 32 elements; float16 is windowed in
its own type, with no copy). The partial sums (a 32nd of that) are left out.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = lambda x: jax.lax.reduce_sum_p.bind(x, axes=(0,), out_sharding=None)
    >>> g = build_graph(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((64, 8), jnp.bfloat16)))
    >>> [(x.nbytes, x.start, x.end) for x in tree_sum_inputs(g, [0], [True], "cpu")]
    [(2048, 0, 0)]
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.fusion import Extra, float32_bytes

#: reduced elements from which XLA's CPU backend sums bfloat16 in windows (33 measured)
TREE_MIN_ELEMENTS = 33


def tree_sum_inputs(graph: Graph, order: Sequence[int], used: Sequence[bool],
                    backend: str) -> list[Extra]:
    """The float32 input of each used bfloat16 ``reduce_sum`` ``backend`` sums in windows,
    at the sum's position in ``order``; ``Piecewise`` in the reduced element count where
    the dims decide it."""
    sums = [n for n in graph.nodes if n.primitive == "reduce_sum" and used[n.index]
            and n.inputs and graph.values[n.inputs[0]].dtype == "bfloat16"]
    if backend != "cpu" or not sums:
        return []  # (a float32 program: no positions to build)
    pos = {ni: p for p, ni in enumerate(order)}
    out = []
    for n in sums:
        if n.index not in pos:
            continue
        x = n.inputs[0]
        shape = graph.values[x].shape
        count = sympy.Mul(*[shape[a] for a in dict(n.params).get("axes", ())])
        size = float32_bytes(graph, x)
        if count.is_number:
            if count < TREE_MIN_ELEMENTS:
                continue
        else:
            size = sympy.Piecewise((size, count >= TREE_MIN_ELEMENTS), (0, True))
        out.append(Extra(x, size, pos[n.index], pos[n.index],
                         "float32 input of a bfloat16 sum"))
    return out
