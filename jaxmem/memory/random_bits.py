"""The buffers XLA's CPU backend gives ``random_bits``: a threefry loop over two words.

JAX lowers counter-based random bits (``jax.random.bernoulli``, ``uniform``, dropout)
to a ``while`` loop of threefry rounds over two 32-bit words per element: two counter
arrays are built, then the loop carries two word arrays and writes two results, which
every reader (the dropout mask's forward ``select`` and, through the backward pass,
its transpose's) reads together. Measured with ``hlo_passes.timeline`` (jax 0.10.2,
CPU): at the loop, four arrays of the bits' element count in ``uint32``; after it, the
two results, held until the last reader. So the value's buffer is two words per
element (:func:`random_bits_sizes`), and the loop adds two more while it runs
(:func:`random_bits_counters`). Other backends are not measured: no rule applies there.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = lambda key, x: jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x, 0.0)
    >>> g = build_graph(jax.make_jaxpr(f)(jax.random.key(0), jnp.ones((4, 8))))
    >>> random_bits_sizes(g, "cpu"), random_bits_sizes(g, "gpu")
    ({9: 256}, {})
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
    """Value id -> bytes of each ``random_bits`` result: the loop's two word arrays."""
    if backend != "cpu":
        return {}
    return {n.outputs[0]: 2 * _words_bytes(graph, n.outputs[0]) for n in graph.nodes
            if n.primitive == "random_bits" and n.outputs}


def random_bits_counters(graph: Graph, order: Sequence[int],
                         bits: Mapping[int, sympy.Expr]) -> list[Extra]:
    """The two counter arrays each ``random_bits`` loop reads, live while it runs (as
    many bytes as its two results). ``bits``: :func:`random_bits_sizes`."""
    if not bits:
        return []
    pos = {n: p for p, n in enumerate(order)}
    return [Extra(v, nbytes, pos[p], pos[p], "threefry counters")
            for v, nbytes in bits.items() if (p := graph.producers[v]) in pos]
