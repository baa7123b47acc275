"""Residuals: what a train step keeps from its forward pass for its backward pass.

A residual is a materialised value made by a forward operation (JAX's name stack
says ``jvp(...)``) and read by a backward one (``transpose(...)``). Each can be
saved (the default), or recomputed just before its first backward use from
values that are saved anyway. Residuals are grouped by what they are across
layers: same primitive, same scope with layer numbers erased, and the same
computation pattern (the primitives, ranks and dtypes of the operations that make
it, a few steps back), so that plans speak of "the attention probabilities of
every layer", not of value 1234 — in a plain Python loop over layers without
``jax.named_scope`` as much as in a named one; names only make the labels nicer.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> f = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w).sum()
    >>> g = build_graph(jax.make_jaxpr(jax.grad(f))(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> [r.primitive for r in find_residuals(g)]  # the outer one is read where backward starts
    ['tanh']
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import sympy

from jaxmem.graph import Graph, Node
from jaxmem.graph.types import is_rerun
from jaxmem.memory import materialised

_WRAPPERS = re.compile(r"\b(?:jvp|transpose|vmap|remat|checkpoint|pjit|jit)\(")
_LAYER = re.compile(r"\d+")


def is_primal(scope: str) -> bool:
    """True for operations JAX made while tracing the primal: the one forward pass, which
    segment cuts and scan pairs read."""
    return "jvp(" in scope and "transpose(" not in scope


def is_forward(scope: str) -> bool:
    """True for the primal's operations (:func:`is_primal`), and for a user's
    ``jax.checkpoint`` re-running them in the backward pass (:func:`is_rerun`): the values
    both make are residuals the planner may recompute."""
    return is_primal(scope) or is_rerun(scope)


def clean_scope(scope: str) -> str:
    """The user's ``jax.named_scope`` path without JAX's transform wrappers."""
    s = _WRAPPERS.sub("", scope).replace(")", "")
    return "/".join(p for p in s.split("/") if p) or "<top>"


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value kept from the forward pass for the backward pass.

    Attributes:
        value: value id in the graph.
        producer: index of the node that makes it.
        primitive: that node's primitive.
        scope: the user's scope path (``layer_3/attn``) or ``<top>``.
        nbytes: symbolic size.
        first_use: index of the first backward node that reads it.
        recompute_nodes: forward node indices needed to recompute it from
            values that stay live anyway (inputs and other residuals); empty when
            it cannot be recomputed (it can still be offloaded).
        recompute_flops: symbolic cost of that recomputation.
        aliases: fused or view forward values derived from it that the backward
            pass reads; recomputing the residual recomputes and renames them too.
        role: what tells it from residuals of the same scope and primitive.
        label: the primitive as its group names it, where the two traces of one
            step spell it differently (:func:`_label`); empty for ``primitive``.
    """

    value: int
    producer: int
    primitive: str
    scope: str
    nbytes: sympy.Expr
    first_use: int
    recompute_nodes: tuple[int, ...]
    recompute_flops: sympy.Expr
    aliases: tuple[int, ...] = ()
    role: str = ""
    label: str = ""

    @property
    def group(self) -> str:
        """A name shared by the same residual of every layer."""
        return f"{_LAYER.sub('*', self.scope)}:{self.label or self.primitive}{self.role}"


def _symbolic_only(graph: Graph, v: int) -> bool:
    """A value only a symbolic trace has: a dim read as a number (``dim_as_value``; a
    literal on a concrete trace) or the constant indices of a gather (:func:`_label`)."""
    if v not in graph.constant:
        return False
    p = graph.producers[v]
    if graph.nodes[p].primitive == "dim_as_value":
        return True
    readers = [graph.nodes[i] for i in graph.consumers.get(v, ())]
    return bool(readers) and all(n.primitive.startswith(("gather", "scatter"))
                                 and v not in n.inputs[:1] for n in readers)


def _label(graph: Graph, p: int) -> str:
    """Node ``p``'s primitive, spelt the same on a symbolic and a concrete trace.

    ``x[:, 0]`` is a ``slice`` (then a ``squeeze``) on an array of static shape, but
    JAX's indexing takes a ``gather`` at constant indices once any dim is symbolic:
    both are named ``slice``.
    """
    n = graph.nodes[p]
    if n.primitive == "gather" and all(u in graph.constant for u in n.inputs[1:]):
        return "slice"
    if n.primitive == "squeeze" and _producer_primitive(graph, n.inputs[0]) == "slice":
        return "slice"
    return n.primitive


def _producer_primitive(graph: Graph, v: int) -> str:
    """The primitive making ``v``; ``input`` for what the differentiated pass did not make
    (an argument, or a microbatch's slice cut before it)."""
    p = graph.producers.get(v)
    if p is None or not (is_forward(graph.nodes[p].scope) or graph.nodes[p].is_backward):
        return "input"
    return graph.nodes[p].primitive


def _made_from(graph: Graph, p: int) -> tuple[str, ...]:
    """The primitives making node ``p``'s inputs from the arguments (what is made from
    constants alone is a literal on one trace and computed on the other); for a ``slice``
    (:func:`_label`), those making the sliced array."""
    node = graph.nodes[p]
    inputs = [u for u in node.inputs if u not in graph.constant]
    if inputs and node.primitive == "squeeze" and _label(graph, p) == "slice":
        inputs = list(graph.nodes[graph.producers[inputs[0]]].inputs[:1])
    return tuple(sorted({_producer_primitive(graph, u) for u in inputs}))


def _pattern(graph: Graph, r: Residual) -> tuple[Any, ...]:
    """What computation makes ``r`` and what reads it, one operation either side: the
    primitives, ranks and dtypes, never sizes (a concrete trace must give its twin the
    same patterns) and never further away (a layer's first op reads the previous layer,
    the first layer's reads the embedding: one step keeps the pattern inside the layer)."""
    value = graph.values[r.value]
    # Sets, not counts: the first layer's backward reads less (no input gradient).
    read_by = sorted({graph.nodes[i].primitive for i in graph.consumers.get(r.value, ())})
    return len(value.shape), value.dtype, _made_from(graph, r.producer), tuple(read_by)


def _roles(graph: Graph, residuals: Sequence[Residual]) -> list[Residual]:
    """``residuals`` with a role where residuals of one label (scope and primitive)
    play different parts (:func:`_pattern`): ``(dot_general,add)`` after the label
    names the operations that make the residual's inputs, ``#k`` where those clash."""
    by_label: dict[str, dict[Any, list[int]]] = {}
    for k, r in enumerate(residuals):
        by_label.setdefault(r.group, {}).setdefault(_pattern(graph, r), []).append(k)
    out = list(residuals)
    for patterns in by_label.values():
        if len(patterns) < 2:
            continue
        hints: dict[str, int] = {}
        for pattern, members in patterns.items():
            hint = f"({','.join(pattern[2])})"
            hints[hint] = hints.get(hint, 0) + 1
            role = hint if hints[hint] == 1 else f"{hint}#{hints[hint]}"
            for m in members:
                out[m] = dataclasses.replace(out[m], role=role)
    return out


def _sources(graph: Graph, owner: dict[int, int], v: int) -> set[int]:
    """Materialised values whose buffers a fused or view value ``v`` reads."""
    producers, nodes = graph.producers, graph.nodes
    out: set[int] = set()
    stack, seen = [v], set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        o = owner.get(u, u)
        if o == u:
            out.add(u)
            continue
        if o != -1:
            stack.append(o)
            continue
        p = producers.get(u)
        if p is not None:
            stack.extend(nodes[p].inputs)
    return out


def find_residuals(graph: Graph) -> tuple[Residual, ...]:
    """All residuals of a differentiated graph, in program order of their producers.

    A backward read of a fused or view forward value (``1 - tanh(x)**2`` fused
    into its backward consumer, a reshape of a forward buffer) keeps that value's
    materialised sources alive: each such source is the residual, and the value
    read is one of its ``aliases``, recomputed and renamed together with it.
    """
    owner = materialised(graph)
    producers = graph.producers
    nodes = graph.nodes
    inputs = set(graph.inputs)
    outputs = set(graph.outputs)
    candidates: dict[int, int] = {}
    aliases: dict[int, dict[int, None]] = {}

    def forward_buffer(v: int) -> bool:
        p = producers.get(v)
        return (p is not None and v not in inputs and v not in outputs
                and is_forward(nodes[p].scope) and nodes[p].kind != "view")

    for n in nodes:
        if not n.is_backward:
            continue
        for v in n.inputs:
            p = producers.get(v)
            if p is None or v in inputs or v in outputs or not is_forward(nodes[p].scope):
                continue
            if owner.get(v, v) == v:
                if forward_buffer(v):
                    candidates.setdefault(v, n.index)
                continue
            for s in _sources(graph, owner, v):
                if forward_buffer(s):
                    candidates.setdefault(s, n.index)
                    candidates[s] = min(candidates[s], n.index)
                    aliases.setdefault(s, {})[v] = None
    kept = set(candidates) | inputs | {v for v, _ in graph.consts}
    began = _backward_start(graph)
    out = []
    for v, first in sorted(candidates.items(), key=lambda kv: producers[kv[0]]):
        if _symbolic_only(graph, v) or first <= began:
            continue  # a few bytes; or read where the backward pass starts (nothing to free)
        al = tuple(a for a in aliases.get(v, {}) if a != v)
        if any(recompute_chain(graph, a, kept) is None for a in al):
            continue  # its aliases could not be re-derived even from the residual itself
        # A residual no forward chain rebuilds (a random mask, a control-flow result)
        # can still be offloaded: it is kept with no recompute nodes.
        chain = recompute_chain(graph, v, kept - {v}) or ()
        flops = sympy.expand(sum((nodes[i].flops for i in chain), sympy.Integer(0)))
        p = producers[v]
        label = _label(graph, p)
        out.append(Residual(v, p, nodes[p].primitive, clean_scope(nodes[p].scope),
                            graph.values[v].nbytes, first, chain, flops, al,
                            label="" if label == nodes[p].primitive else label))
    return tuple(_roles(graph, out))


def _backward_start(graph: Graph) -> int:
    """The first backward node that makes a value not of dims and constants alone (the
    loss's cotangent is one of those). A residual read there or before would be rebuilt
    where it dies, with no backward value made yet to pin the rebuild after the forward
    pass (a rebuild of a decoder's last hidden state, read by the loss's backward, was
    pinned to the forward loss; XLA dropped the unread pin)."""
    constant = graph.constant
    return next((n.index for n in graph.nodes if n.is_backward
                 and any(o not in constant for o in n.outputs)), len(graph.nodes))


def recompute_chain(graph: Graph, value: int, leaves: set[int], max_heavy: int | None = None,
                    besides: int | None = None) -> tuple[int, ...] | None:
    """Forward nodes that recompute ``value`` from ``leaves``; None when impossible.

    With ``max_heavy``, also None as soon as the chain holds more than that many
    materialising ops (:data:`HEAVY_KINDS`) other than node ``besides``: a caller
    that rejects such chains as too long is spared the walk back through whole layers.
    """
    producers = graph.producers
    nodes = graph.nodes
    heavy = 0
    need: set[int] = set()
    stack = [value]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in leaves and v != value:
            continue
        p = producers.get(v)
        if p is None:
            return None  # a constant or an input we cannot recompute
        n = nodes[p]
        if not is_forward(n.scope) or n.kind == "control" or n.eqn is None:
            return None  # only plain forward ops are recomputed
        if n.primitive in _RANDOM:
            return None
        if max_heavy is not None and p != besides and p not in need and is_heavy(n):
            heavy += 1
            if heavy > max_heavy:
                return None
        need.add(p)
        stack.extend(n.inputs)
    return tuple(sorted(need))


def recompute_chains_from(graph: Graph, values: Sequence[int], leaves: set[int]
                          ) -> dict[int, tuple[int, ...] | None]:
    """``recompute_chain(graph, v, leaves)`` of each of ``values``, from one walk.

    A segment plan recomputes every residual of a layer from the layer's cut: their
    walks back cover the same nodes again and again (most of a segment level's time
    on a 22-layer step). Here each value's chain is computed once, as a bit set of node
    indices (the union of its operands' chains), for every value the walks reach.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxmem.graph import build_graph
        >>> loss = lambda w, x: jnp.sin(jnp.sin(x @ w) @ w).sum()
        >>> g = build_graph(jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 3)), jnp.ones((2, 3))))
        >>> vs = [r.value for r in find_residuals(g)]
        >>> chains = recompute_chains_from(g, vs, set(g.inputs))
        >>> all(chains[v] == recompute_chain(g, v, set(g.inputs)) for v in vs)
        True
    """
    producers, nodes = graph.producers, graph.nodes
    bits: dict[int, int | None] = {}  # value -> its chain as a bit set (None: impossible)
    for root in values:
        stack = [root]
        while stack:
            v = stack[-1]
            if v in bits:
                stack.pop()
                continue
            p = producers.get(v)
            n = None if p is None else nodes[p]
            if (n is None or not is_forward(n.scope) or n.kind == "control" or n.eqn is None
                    or n.primitive in _RANDOM):
                bits[v] = None
                stack.pop()
                continue
            # The root itself is rebuilt even where it is a leaf (as recompute_chain does).
            todo = [i for i in n.inputs if i not in bits and i not in leaves]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            mask: int | None = 1 << p
            for i in n.inputs:
                if i in leaves:
                    continue
                b = bits[i]
                if b is None:
                    mask = None
                    break
                mask |= b  # type: ignore[operator]
            bits[v] = mask
    return {v: None if bits[v] is None else _indices(bits[v]) for v in values}  # type: ignore[arg-type]


def _indices(mask: int) -> tuple[int, ...]:
    """The set bits of ``mask``, in increasing order."""
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return tuple(np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist())


#: Node kinds that materialise their result from memory: what makes a chain expensive.
HEAVY_KINDS = frozenset(("opaque", "control", "inplace"))


def is_heavy(node: Node) -> bool:
    """Whether a re-run of ``node`` materialises a result (:data:`HEAVY_KINDS`). A
    ``dim_as_value`` is not: it is a literal on the concrete trace that runs, so counting
    it made a BatchNorm's statistics (a sum divided by the batch size) too long to rebuild
    on the symbolic trace only, and the model kept what the executable rebuilt (+39 %).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxmem.graph import build_graph
        >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.tanh(x @ x))(jnp.ones((2, 2))))
        >>> [is_heavy(n) for n in g.nodes]
        [True, False]
    """
    return node.kind in HEAVY_KINDS and node.primitive != "dim_as_value"


# Ops whose re-run may not give the same result: stateful RNG and host callbacks.
# Counter-based random bits (``threefry2x32``, ``random_bits``) are pure functions of
# their key, so a dropout mask is re-drawn exactly, as ``jax.checkpoint`` re-draws it.
_RANDOM = frozenset("rng_bit_generator rng_uniform pure_callback io_callback".split())
