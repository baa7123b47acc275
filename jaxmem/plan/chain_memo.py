"""Memos of one graph's recompute walks and of what every rewrite of it asks again.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda w: jnp.tanh(w).sum()))(jnp.ones(4)))
    >>> chain_memo(g) is chain_memo(g)
    True
"""

from __future__ import annotations

import weakref

from jaxmem.graph import Graph
from jaxmem.memory import materialised
from jaxmem.plan.residuals import recompute_chain

Chain = tuple[int, ...]  # indices of the forward nodes one residual's rewrite re-runs


class ChainMemo:
    """The :func:`~jaxmem.plan.residuals.recompute_chain` walks made on one graph, reused
    where their answer cannot differ.

    A plan search asks for the chain of the same residual against saved sets that
    differ only in residuals far from it. A walk depends on the saved set only
    through the values it visits (each either stops the walk or is rebuilt), so a
    found chain is reused whenever every value it visited has the same membership
    as when it was found; anything else walks again (failed walks are not kept).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxmem.graph import build_graph
        >>> from jaxmem.plan.residuals import find_residuals
        >>> loss = lambda w: jnp.sin(jnp.cos(w) * w).sum()
        >>> g = build_graph(jax.make_jaxpr(jax.grad(loss))(jnp.ones(8)))
        >>> r, memo = find_residuals(g)[-1], ChainMemo()
        >>> memo.chain(g, r.value, set(g.inputs)) == recompute_chain(g, r.value, set(g.inputs))
        True
    """

    def __init__(self) -> None:
        # Not the graph itself: the memo lives while its graph does (see chain_memo).
        # (value, max_heavy, besides) -> [(chain, visited values in the saved set, the rest)]
        self.found: dict[tuple[int, int | None, int | None],
                         list[tuple[Chain, frozenset[int], frozenset[int]]]] = {}
        self._owner: dict[int, int] | None = None
        self._last_read: dict[int, int] | None = None
        self._backward: list[bool] | None = None
        self._bodied: frozenset[int] | None = None

    def backward(self, graph: Graph) -> list[bool]:
        """``node.is_backward`` per node, computed once per graph (each rewrite of a
        22-layer step asked it three times per node). Read only."""
        if self._backward is None:
            self._backward = [n.is_backward for n in graph.nodes]
        return self._backward

    def bodied(self, graph: Graph) -> frozenset[int]:
        """Results of the ops with bodies (loops, conds, calls), computed once per graph.
        Read only."""
        if self._bodied is None:
            self._bodied = frozenset(o for n in graph.nodes if n.subgraphs for o in n.outputs)
        return self._bodied

    def owner(self, graph: Graph) -> dict[int, int]:
        """``materialised(graph)``, computed once: every candidate plan rewrites the same
        graph (17 rewrites of a 22-layer step each spent 20 ms on it). Read only."""
        if self._owner is None:
            self._owner = materialised(graph)
        return self._owner

    def last_read(self, graph: Graph) -> dict[int, int]:
        """Value -> the last node reading it (outputs left out: they stay live to the end
        anyway), computed once per graph. Read only."""
        if self._last_read is None:
            last: dict[int, int] = {}
            for n in graph.nodes:
                last.update((v, n.index) for v in n.inputs)
            for v in graph.outputs:
                last.pop(v, None)
            self._last_read = last
        return self._last_read

    def chain(self, graph: Graph, value: int, leaves: set[int], max_heavy: int | None = None,
              besides: int | None = None) -> Chain | None:
        """``recompute_chain(graph, value, leaves, max_heavy, besides)``."""
        key = (value, max_heavy, besides)
        entries = self.found.setdefault(key, [])
        for chain, stops, rebuilt in entries:
            if stops <= leaves and rebuilt.isdisjoint(leaves):
                return chain
        chain = recompute_chain(graph, value, leaves, max_heavy, besides)
        if chain is not None:
            nodes = graph.nodes
            visited = {v for i in chain for v in nodes[i].inputs} - {value}
            stops = frozenset(v for v in visited if v in leaves)
            entries.insert(0, (chain, stops, frozenset(visited - stops)))
            del entries[_MEMO_ENTRIES:]
        return chain


_MEMO_ENTRIES = 4  # chains kept per residual: the searches alternate between a few
_MEMOS: dict[int, tuple[weakref.ref, ChainMemo]] = {}


def chain_memo(graph: Graph) -> ChainMemo:
    """The :class:`ChainMemo` of ``graph``: one per live graph object, dropped with it."""
    key = id(graph)
    entry = _MEMOS.get(key)
    if entry is not None and entry[0]() is graph:
        return entry[1]
    memo = ChainMemo()
    _MEMOS[key] = (weakref.ref(graph, lambda _: _MEMOS.pop(key, None)), memo)
    return memo
