"""Recomputation and offload as a graph rewrite: residuals leave, and return where needed.

:func:`apply_remat` returns a new :class:`~jaxmem.graph.Graph` in which every backward read
of a recomputed residual reads a clone, made just before its first backward use by
re-running the forward operations that produced it. The clone's inputs pass through
``optimization_barrier`` together with the backward pass's buffers live at that point, so
XLA can neither run the recomputation early nor merge it with the forward original (on CPU
that needs the ``cse_barrier_expander`` pass off; see :mod:`jaxmem.lower`). The live
backward buffers leave the barrier renamed, so they are materialised there: XLA cannot fuse
the residual stream's running gradient sum (``dx + ...`` of every layer) into one late
consumer, which would keep every layer's recomputed values and saved cuts alive to the end
of the backward pass (plain-JAX GPT 4x256, segment plan: 113.8 MiB without, 98.6 with). The
memory model runs on the result unchanged.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.plan.residuals import find_residuals
    >>> f = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w).sum()
    >>> g = build_graph(jax.make_jaxpr(jax.grad(f))(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> r = find_residuals(g)
    >>> len(apply_remat(g, r).nodes) > len(g.nodes)
    True
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import sympy

from jaxmem.graph import Graph, Node, Value, replaced
from jaxmem.plan.chain_memo import Chain, chain_memo
from jaxmem.plan.offload import transfer_eqn
from jaxmem.plan.residuals import Residual, find_residuals, is_heavy, recompute_chains_from


def _live_anyway(graph: Graph, residuals: Sequence[Residual] | None) -> set[int]:
    """Values the backward pass keeps anyway: residuals, inputs and constants."""
    rs = find_residuals(graph) if residuals is None else residuals
    return {r.value for r in rs} | set(graph.inputs) | {v for v, _ in graph.consts}


def recompute_chains(graph: Graph, recompute: Iterable[Residual],
                     residuals: Sequence[Residual] | None = None,
                     keep: Collection[int] = (), long_chains: bool = False,
                     only: Collection[int] | None = None) -> list[tuple[Residual, Chain]]:
    """The residuals that will really be recomputed, each with the forward nodes it re-runs.

    Chains start from values that stay live anyway (inputs, constants, residuals
    not being recomputed, and ``keep``: the cuts a segment plan saves). A residual
    whose chain cannot be built stays saved, and so does one whose chain is long
    (more than a few materialising ops) unless ``long_chains`` (a segment plan
    re-runs whole layers on purpose). ``residuals`` is :func:`find_residuals` of
    ``graph``, when the caller has it. ``only`` (value ids): return just these
    residuals' chains (the others still count as recomputed, not as sources).
    """
    chosen = {r.value: r for r in recompute}
    if not chosen:
        return []
    kept = (_live_anyway(graph, residuals) | set(keep)) - set(chosen)
    memo = chain_memo(graph)
    out = []
    # A chain that is not cheap is dropped: the walk may stop as soon as it is not.
    bound = None if long_chains else _MAX_HEAVY
    wanted = [r for r in chosen.values() if only is None or r.value in only]
    # Unbounded walks (a segment plan's) share most of their nodes: one walk for all.
    walks = (recompute_chains_from(graph, [v for r in wanted for v in (r.value, *r.aliases)],
                                   kept) if bound is None else {})
    for r in wanted:
        chains = [walks[v] if bound is None else memo.chain(graph, v, kept, bound, r.producer)
                  for v in (r.value, *r.aliases)]
        if all(c is not None for c in chains):
            chain = tuple(sorted({i for c in chains for i in c}))  # type: ignore[union-attr]
            if long_chains or _cheap(graph, chain, r):
                out.append((r, chain))
    return out


def offload_chains(graph: Graph, offload: Iterable[Residual],
                   residuals: Sequence[Residual] | None = None
                   ) -> list[tuple[Residual, Chain]]:
    """The residuals that can really be offloaded, each with the nodes that rebuild its aliases.

    An offloaded residual comes back as it was; the fused or view values the
    backward pass reads from it (its ``aliases``) are re-derived from the reloaded
    copy by these (elementwise) nodes.
    """
    rs = list(offload)
    if not rs:
        return []
    kept = _live_anyway(graph, residuals)
    memo = chain_memo(graph)
    out = []
    for r in rs:
        chains = [memo.chain(graph, a, kept) for a in r.aliases]
        if all(c is not None for c in chains):
            out.append((r, tuple(sorted({i for c in chains for i in c}))))  # type: ignore[union-attr]
    return out


def apply_remat(graph: Graph, recompute: Iterable[Residual], offload: Iterable[Residual] = (),
                residuals: Sequence[Residual] | None = None, keep: Collection[int] = (),
                long_chains: bool = False,
                chains: Sequence[tuple[Residual, Chain]] | None = None) -> Graph:
    """Rewrites ``graph`` so that the given residuals are recomputed or offloaded, not kept.

    Args:
        graph: a differentiated graph.
        recompute: residuals (from :func:`find_residuals` on this graph) to recompute.
        offload: residuals to move to host memory after the forward pass makes them
            and back before their first backward use (see :mod:`jaxmem.plan.offload`).
        residuals: :func:`find_residuals` of ``graph``, when the caller has it.
        keep: values saved as recomputation sources (a segment plan's cuts).
        long_chains: recompute residuals whose chains re-run many operations.
        chains: ``recompute_chains(graph, recompute, residuals, keep, long_chains)``,
            when the caller has it (a segment level weighs its chains first).

    Returns:
        The rewritten graph, nodes in execution order.
    """
    chains = (recompute_chains(graph, recompute, residuals, keep, long_chains)
              if chains is None else list(chains))
    moved = offload_chains(graph, offload, residuals)
    if not chains and not moved:
        return graph
    off = {r.value: r for r, _ in moved}
    by_first: dict[int, list[tuple[Residual, Chain]]] = {}
    offloaded_after: dict[int, list[int]] = {}  # producer -> its offloaded outputs
    for r, chain in chains + moved:
        by_first.setdefault(r.first_use, []).append((r, chain))
    for r in off.values():
        offloaded_after.setdefault(r.producer, []).append(r.value)
    rw = _Rewrite(graph, off)
    backward = chain_memo(graph).backward(graph)
    for node in graph.nodes:
        if block := by_first.get(node.index):
            rw.rebuild_block(node, block)
        back = backward[node.index]
        rw.copy_node(node, back)
        rw.track_live(node, back)
        if node.index in offloaded_after:
            rw.offload(node, offloaded_after[node.index])
    return Graph(tuple(rw.values), tuple(rw.nodes), graph.inputs, graph.outputs, graph.consts)


class _Rewrite:
    """The graph :func:`apply_remat` builds while it walks the original in program order.

    Original values keep their ids; every clone, barrier output and transferred
    copy is a new value appended after them.
    """

    def __init__(self, graph: Graph, off: dict[int, Residual]) -> None:
        self.graph = graph
        self.off = off  # offloaded residuals by value
        self.producers = graph.producers
        self.values: list[Value] = list(graph.values)
        self.nodes: list[Node] = []
        self.rename: dict[int, int] = {}  # residual value -> its clone or reloaded copy, once made
        self.rebuilt: dict[int, int] = {}  # matmul result the latest block re-ran -> its run
        self.host: dict[int, int] = {}  # offloaded value -> its copy in host memory
        self.sent: dict[int, int] = {}  # offloaded value -> what later forward nodes read
        self.last_out: int | None = None  # latest pinnable value made before the node
        memo = chain_memo(graph)
        self.last_read = memo.last_read(graph)  # value -> the last node reading it
        self.live: dict[int, None] = {}  # backward buffers read after the current node
        # Pinned: values XLA gives a buffer anyway (a fused one would be materialised), not
        # (until the backward pass makes others) ones made of dims and constants, like the
        # loss's cotangent: pinned to one, a rebuild raced the forward tail.
        self.owner, self.constant, self.began = memo.owner(graph), graph.constant, False
        self.bodied = memo.bodied(graph)  # the optimizer reads these from a barrier

    def track_live(self, node: Node, backward: bool) -> None:
        """Updates :attr:`live` and :attr:`last_out` after ``node`` ran (``backward``: its pass)."""
        live, last_read = self.live, self.last_read
        if live:  # empty through the forward pass: nothing to drop
            for v in node.inputs:
                if last_read.get(v) == node.index:
                    live.pop(v, None)
        if backward:
            owner, began, constant = self.owner, self.began, self.constant
            live.update((v, None) for v in node.outputs if last_read.get(v, -1) > node.index
                        and owner.get(v) == v and (began or v not in constant))
            self.began = began or any(v not in constant for v in node.outputs)
        if node.outputs and self.pinnable(node.outputs[0]):
            self.last_out = node.outputs[0]

    def pinnable(self, v: int) -> bool:
        return self.owner.get(v) == v and v not in self.constant

    def new_value(self, like: int, on_host: bool = False) -> int:
        """A new value shaped like ``like`` (taking no device bytes on the host); its id."""
        v = self.values[like]
        vid = len(self.values)
        # Copied without the frozen __init__ (dataclasses.replace was most of a rewrite's time).
        self.values.append(Value(vid, v.shape, v.dtype, sympy.Integer(0), True) if on_host
                           else replaced(v, id=vid))
        return vid

    def emit(self, node: Node, inputs: Sequence[int], operands: Sequence[int | None],
             outputs: Sequence[int], scope: str | None = None) -> None:
        """Appends ``node`` reading and writing the given values (``node`` itself if unchanged)."""
        index, ins, ops, outs = len(self.nodes), tuple(inputs), tuple(operands), tuple(outputs)
        if (index == node.index and ins == node.inputs and ops == node.operands
                and outs == node.outputs and scope is None):
            self.nodes.append(node)  # the forward pass, before any block: shared, not copied
            return
        self.nodes.append(replaced(node, index=index, inputs=ins, outputs=outs, operands=ops,
                                   scope=node.scope if scope is None else scope))

    def transfer(self, src: int, original: int, to_host: bool, scope: str) -> int:
        """A ``device_put`` of ``src`` to host or device memory; the copy's value id."""
        out = self.new_value(original, on_host=to_host)
        self.nodes.append(Node(len(self.nodes), "device_put", "opaque", (src,), (out,), scope,
                               eqn=transfer_eqn(to_host), operands=(src,)))
        return out

    def offload(self, node: Node, values: Sequence[int]) -> None:
        """Moves ``values`` to host right after ``node`` makes them, past a barrier the rest
        of the forward pass reads them from (XLA GPU delayed unpinned copies to the reload)."""
        hosts = [self.transfer(v, v, True, node.scope + "/offload") for v in values]
        barrier_in = (*hosts, *values)
        barrier_out = tuple(self.new_value(v) for v in barrier_in)
        self.nodes.append(Node(len(self.nodes), "optimization_barrier", "view", barrier_in,
                               barrier_out, node.scope + "/offload", operands=barrier_in))
        self.host.update(zip(values, barrier_out, strict=False))
        self.sent.update(zip(values, barrier_out[len(values):], strict=True))

    def copy_node(self, node: Node, backward: bool) -> None:
        """Emits an original node: a backward one reads the clones and barrier outputs so
        far, a forward one what was offloaded, and any other, once the backward pass began,
        a loop's pinned results from the barrier (an optimizer reading a scan's stacked
        gradients as they were kept them past the update XLA writes in their place: 11 MiB
        more temporaries, a scanned bf16 GPT's segment level at (1, 32))."""
        rename = self.rename if backward else self.sent
        if not backward and self.began:
            late = {v: self.rename[v] for v in node.inputs
                    if v in self.bodied and v in self.rename}
            rename = {**self.sent, **late} if late else rename
        if not backward and not (rename and any(v in rename for v in node.inputs)):
            # emit's result (the node, or it at its new position) without building tuples
            index = len(self.nodes)
            self.nodes.append(node if index == node.index else replaced(node, index=index))
            return
        ins = [rename.get(v, v) for v in node.inputs]
        ops = [None if o is None else rename.get(o, o) for o in node.operands]
        self.emit(node, ins, ops, node.outputs)

    def rebuild_block(self, node: Node, block: list[tuple[Residual, Chain]]) -> None:
        """Brings back, just before ``node``, the residuals whose first use it is."""
        graph = self.graph
        # A residual the block just before re-ran as a matmul (:data:`_READ_AGAIN`) is read
        # from that run, not run again: XLA cannot merge two runs behind two barriers (a
        # ReLU's `h = x @ w`, rebuilt for `relu(h)` and again for its mask a few ops later,
        # ran twice). Only the block just before, and only the block's own residuals:
        # reading an older block's run, or a matmul inside a longer chain, holds its
        # buffer from one rebuild to the next (a tanh MLP's deepest level, whose blocks
        # re-run prefixes of one chain, came to level 0's peak).
        previous, self.rebuilt = self.rebuilt, {}
        # In the block's order (a set's would let two traces order the barrier differently).
        wanted = dict.fromkeys(v for r, _ in block for v in (r.value, *r.aliases)
                               if v in previous)
        chain = [i for i in sorted({i for _, c in block for i in c})
                 if not all(o in wanted for o in graph.nodes[i].outputs)]
        made = {o for i in chain for o in graph.nodes[i].outputs}
        reread = [v for v in wanted if v not in made]  # passed through the barrier
        leaves = list(dict.fromkeys([*(v for i in chain for v in graph.nodes[i].inputs
                                       if v not in made), *reread]))
        # Offloaded values this block needs come back now, unless they already did.
        reload = list(dict.fromkeys([r.value for r, _ in block if r.value in self.off]
                                    + [v for v in leaves if v in self.off]))
        reload = [v for v in reload if v not in self.rename]
        leaves = [v for v in leaves if v not in reload]
        local = self.barrier(node, leaves, reload, {v: previous[v] for v in reread})
        for v in reload:
            local[v] = self.rename[v] = self.transfer(local[v], v, False,
                                                      node.scope + "/offload")
        self.replay(chain, local)
        for r, _ in block:
            for v in (r.value, *r.aliases):
                if v in local:  # else: an offloaded value an earlier block reloaded
                    self.rename[v] = local[v]

    def barrier(self, node: Node, leaves: list[int], reload: list[int],
                again: dict[int, int]) -> dict[int, int]:
        """An ``optimization_barrier`` over a block's sources (``again``: those read from
        the block before's runs); original -> barrier output."""
        graph, producers = self.graph, self.producers
        # Backward operands pin the block after the node before its first use (no hoisted
        # rebuild or reload); later reads read the barrier's outputs, as XLA drops unread
        # operands. Best a buffer the node reads, then a fused one (materialised).
        backward = [v for v in node.inputs if v in producers
                    and graph.nodes[producers[v]].is_backward and v not in self.constant]
        trigger = next((v for v in backward if self.pinnable(v)),
                       backward[0] if backward else self.last_out)
        sources = [self.rename.get(v, again.get(v, v)) for v in leaves] + [
            self.host[v] for v in reload]
        sourced = set(leaves)
        pinned = [v for v in self.live if v not in sourced] or (
            [trigger] if trigger is not None and trigger not in sourced else [])
        barrier_in = sources + [self.rename.get(v, v) for v in pinned]
        barrier_out = [self.new_value(v) for v in barrier_in]
        self.nodes.append(Node(len(self.nodes), "optimization_barrier", "view", tuple(barrier_in),
                               tuple(barrier_out), node.scope + "/remat",
                               operands=tuple(barrier_in)))
        self.rename.update(zip(pinned, barrier_out[len(sources):], strict=True))
        return dict(zip(leaves + reload, barrier_out, strict=False))

    def replay(self, chain: list[int], local: dict[int, int]) -> None:
        """Re-runs the forward nodes ``chain`` on ``local``'s values, recording their clones."""
        for i in chain:
            src = self.graph.nodes[i]
            outs = [self.new_value(o) for o in src.outputs]
            ins = [local.get(v, v) for v in src.inputs]
            ops = [None if o is None else local.get(o, o) for o in src.operands]
            self.emit(src, ins, ops, outs, src.scope + "/remat")
            local.update(zip(src.outputs, outs, strict=True))
            if src.primitive in _READ_AGAIN and all(self.owner.get(o) == o for o in src.outputs):
                self.rebuilt.update(zip(src.outputs, outs, strict=True))


#: Operations whose re-run costs far more than a pass over their result: the next rebuild
#: block reads such a run again when it rebuilds that result (:meth:`_Rewrite.rebuild_block`).
_READ_AGAIN = frozenset(("dot_general", "conv_general_dilated"))

_MAX_HEAVY = 2


def _cheap(graph: Graph, chain: tuple[int, ...], r: Residual,
           max_heavy: int = _MAX_HEAVY) -> bool:
    """At most ``max_heavy`` materialising ops besides the residual's own producer."""
    heavy = [i for i in chain if is_heavy(graph.nodes[i]) and i != r.producer]
    return len(heavy) <= max_heavy
