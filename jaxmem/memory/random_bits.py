"""The buffers XLA's CPU backend gives ``random_bits``: a threefry loop over two words.

JAX lowers counter-based random bits (``jax.random.bernoulli``, ``uniform``, dropout)
to a ``while`` loop of threefry rounds over two 32-bit words per element: two counter
arrays are built, then the loop carries two word arrays and writes two results, which
every reader (the dropout mask's forward ``select`` and, through the backward pass,
its transpose's) reads together. Measured with ``hlo_passes.timeline`` (jax 0.10.2,
CPU): at the loop, four arrays of the bits' element count in ``uint32``; after it, the
two results, held until the last reader. So the value's buffer is two words per
element (:func:`random_bits_sizes`), and the loop adds two more while it runs
(:func:`random_bits_counters`). Where an ``optimization_barrier`` holds the bits (a level
keeps the draw past its recomputation's barrier), XLA cannot fuse the words' final
``xor`` into the readers: it writes the xor right after the loop, one word per element,
and the two words die there (a dropout decoder's levels that keep the draw were +16.6
and +19.1 % over XLA at two words). Other backends are not measured: no rule applies
there.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = lambda key, x: jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x, 0.0)
    >>> g = build_graph(jax.make_jaxpr(f)(jax.random.key(0), jnp.ones((4, 8))))
    >>> random_bits_sizes(g, "cpu"), random_bits_sizes(g, "gpu")
    ({9: 256}, {})
    >>> held = lambda key, x: jax.lax.optimization_barrier(
    ...     jax.random.bits(key, x.shape))
    >>> random_bits_sizes(build_graph(jax.make_jaxpr(held)(jax.random.key(0),
    ...                                                 jnp.ones((4, 8)))), "cpu")
    {...: 128}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

from jaxmem.graph import Graph
from jaxmem.memory.fusion import Extra, element_count

#: bytes of one threefry word
WORD_BYTES = 4


def _words_bytes(graph: Graph, v: int) -> sympy.Expr:
    """Bytes of one word array for bits ``v``: a 32-bit word per element, two for 64."""
    per = 2 if graph.values[v].dtype.endswith("64") else 1
    return sympy.expand(element_count(graph, v) * WORD_BYTES * per)


def random_bits_sizes(graph: Graph, backend: str) -> dict[int, sympy.Expr]:
    """Value id -> bytes of each ``random_bits`` result: the loop's two word arrays, or
    their xor where a barrier holds the bits."""
    if backend != "cpu":
        return {}
    bits = [n.outputs[0] for n in graph.nodes if n.primitive == "random_bits" and n.outputs]
    return {v: _words_bytes(graph, v) * (1 if _held_by_barrier(graph, v) else 2) for v in bits}


def _held_by_barrier(graph: Graph, v: int) -> bool:
    return any(graph.nodes[r].primitive == "optimization_barrier"
               for r in graph.consumers.get(v, ()))


def random_bits_counters(graph: Graph, order: Sequence[int],
                         bits: Mapping[int, sympy.Expr]) -> list[Extra]:
    """The two counter arrays each ``random_bits`` loop reads, and its two words where the
    result is their xor: four word arrays while the loop runs, less the result's own
    buffer. ``bits``: :func:`random_bits_sizes`."""
    if not bits:
        return []
    pos = {n: p for p, n in enumerate(order)}
    return [Extra(v, sympy.expand(4 * _words_bytes(graph, v) - nbytes), pos[p], pos[p],
                  "threefry counters")
            for v, nbytes in bits.items() if (p := graph.producers[v]) in pos]
