"""XLA CPU's library fusions that grow from a reduction through dots.

XLA's CPU ``LibraryRewriter`` starts a fusion at each float32 reduction (from the
program's end backwards) and grows it breadth first through the ops the library runs:
elementwise ops, views, other reductions and dots (:func:`_reduction_region`). In a
forward-only step (an eval loss) such a fusion takes in whole chains of matmuls
(``mean((tanh(x @ w1) @ w2 - y) ** 2)`` is one fusion, no intermediate buffer), and a
softmax with the dot that reads its probabilities. A train step keeps its activations
for the backward pass, so its fusions stop at the first value read outside; fusions
without a dot change nothing the elementwise rules do not already give.

XLA starts a fusion at each dot too; one whose readers all end in a reduction's fusion
merges into it (:func:`_merged_dot`: attention's score matmul into the row max's, the
softmax gradient's ``dP`` into its row sum's). A reduction over unit axes only is a
reshape to XLA and starts nothing.

A fusion exists from :data:`LIBRARY_MIN_ELEMENTS` reduced elements on (measured, jax
0.10.2: ``tanh(x @ w).sum()`` over 2048 elements is a dot fusion and a loop fusion,
over 4096 one library fusion, whatever the axes), so the values it computes take a
``Piecewise`` size, full below the threshold and none from it on
(:func:`reduction_sizes`): a symbolic trace and a concrete one get the same buffers.
Going down from the reduction it grows through an elementwise op only from that many
elements (:func:`fused_from`). Such a fusion reads the scalar constants other ops share
as full-size buffers (:func:`reduction_constants`). Row sums' fusions have rules of
their own as well (:mod:`jaxmem.memory.ynn`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w).sum())(
    ...     jnp.ones((64, 64)), jnp.ones((64, 64))))
    >>> used = [True] * len(g.nodes)
    >>> fusions = reduction_fusions(g, used)
    >>> sorted((g.nodes[g.producers[v]].primitive, size)
    ...        for v, size in reduction_sizes(g, fusions, {}).items())
    [('dot_general', 0), ('tanh', 0)]
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import sympy

from jaxmem.graph import Graph, Node
from jaxmem.memory.constants import ConstantUse, shared_constants
from jaxmem.memory.copies import copied_operands
from jaxmem.memory.fusion import Extra
from jaxmem.memory.library import LIBRARY_ELEMENTWISE, YNN_MIN_ROWS, below_rows, element_count

#: Reductions that start a library fusion (``IsReduceOpSupportedByYnn``: add, max, min).
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
#: Reduced elements from which a reduction is a library fusion (the same 4096 as YNN's
#: row threshold, whose step function serves both).
LIBRARY_MIN_ELEMENTS = YNN_MIN_ROWS
#: Elementwise ops a reduction's library fusion takes in (``add_any`` is an add in HLO).
_ELEMENTWISE = LIBRARY_ELEMENTWISE | {"add_any"}
#: Views a reduction's library fusion grows through (bitcasts and broadcasts in HLO;
#: ``stop_gradient`` is the identity).
_FUSED_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "stop_gradient",
                          "broadcast_in_dim"})


#: What a dim counts for when :func:`_small` sizes a reduction symbolically.
_TYPICAL_DIM = 256


class ReductionFusion(NamedTuple):
    """A reduction's library fusion: the elements it reduces, its nodes, the values it
    computes for itself alone (``inner``), those it writes for readers outside
    (``roots``, the program's outputs among them), and the ops it reaches only from a
    number of elements on (``gates``, :func:`fused_from`), and per op the largest count
    another reduction in the fusion that reaches it reduces (``reseeded``: where the
    fusion's own reduction is under the threshold, that one starts a fusion of its own,
    which takes the op in)."""

    reduced: sympy.Expr
    nodes: frozenset[int]
    inner: frozenset[int]
    roots: frozenset[int]
    gates: Mapping[int, sympy.Expr]
    reseeded: Mapping[int, sympy.Expr]


def reduction_fusions(graph: Graph, used: Sequence[bool]) -> list[ReductionFusion]:
    """Each used float32 reduction's library fusion that holds a dot, the fusions found
    from the program's end backwards, as XLA starts them: at each reduction, and at each
    dot, which merges into the fusion its results end in (:func:`_merged_dot`)."""
    regions: list[tuple[Node, set[int]]] = []
    owner: dict[int, int] = {}  # node -> index into regions
    consumers = _UsedReaders(graph, used)
    for node in reversed(graph.nodes):
        if not used[node.index] or node.index in owner:
            continue
        if (node.primitive in _REDUCTIONS and node.inputs
                and graph.values[node.inputs[0]].dtype == "float32"
                and not _small(element_count(graph, node.inputs[0]))
                and not _unit_reduction(graph, node)):
            region = _reduction_region(graph, node, consumers, owner.keys())
            owner.update(dict.fromkeys(region, len(regions)))
            regions.append((node, region))
        elif node.primitive == "dot_general" and _library_op(graph, node):
            k, chain = _merged_dot(graph, node, consumers, owner)
            if k is not None:
                regions[k][1].update(chain)
                owner.update(dict.fromkeys(chain, k))
    return [_fusion(graph, seed, frozenset(region), consumers) for seed, region in regions
            if any(graph.nodes[n].primitive == "dot_general" for n in region)]


def _merged_dot(graph: Graph, dot: Node, consumers: _UsedReaders, owner: dict[int, int]
                ) -> tuple[int | None, list[int]]:
    """The fusion a dot's own library fusion merges into, and the ops it brings: XLA
    starts a fusion at each dot too, grows it down its chain of single readers, and
    merges it with the fusion it then reaches (attention's ``q @ k.T / sqrt(d)``, read
    by the row max and ``scores - max`` of one fusion; the backward's ``dP``, read by
    ``dP * P`` in the fusion and ``dP / sum``, whose only reader is in it too)."""
    chain = [dot.index]
    for _ in range(8):  # epilogues are short
        outs = graph.nodes[chain[-1]].outputs
        readers = consumers[outs[0]] if len(outs) == 1 else []
        into = [_fusion_of(graph, c, consumers, owner) for c in readers]
        if readers and None not in into and len({k for k, _ in into}) == 1:
            return into[0][0], chain + [c for k, c in into if c is not None]
        if (len(readers) != 1 or readers[0] in owner
                or not _library_op(graph, graph.nodes[readers[0]])
                or graph.nodes[readers[0]].primitive == "dot_general"):
            break
        chain.append(readers[0])
    return None, chain


def _fusion_of(graph: Graph, n: int, consumers: _UsedReaders, owner: dict[int, int]
               ) -> tuple[int, int | None] | None:
    """The fusion op ``n`` is in, or that its only reader is in (with ``n`` itself, which
    that fusion then takes in); None for neither."""
    if n in owner:
        return owner[n], None
    outs = graph.nodes[n].outputs
    readers = consumers[outs[0]] if len(outs) == 1 else []
    if (len(readers) == 1 and readers[0] in owner and _library_op(graph, graph.nodes[n])
            and graph.nodes[n].primitive != "dot_general"):
        return owner[readers[0]], n
    return None


def _fusion(graph: Graph, seed: Node, region: frozenset[int],
            consumers: _UsedReaders) -> ReductionFusion:
    """``region``'s :class:`ReductionFusion`, its values split by where they are read."""
    outputs = set(graph.outputs)
    values = [o for n in region for o in graph.nodes[n].outputs]
    roots = frozenset(o for o in values
                      if o in outputs or any(c not in region for c in consumers[o]))
    return ReductionFusion(element_count(graph, seed.inputs[0]), region,
                           frozenset(values) - roots, roots, fused_from(graph, seed, region),
                           _reseeded(graph, seed, region))


def _reseeded(graph: Graph, seed: Node, region: frozenset[int]) -> dict[int, sympy.Expr]:
    """Per op of ``region`` down from another reduction that can start a fusion, the
    largest count such a reduction reduces (measured through a symbolic and a concrete
    trace agreeing: ``sum(x, 1)`` over 4100 elements read by a matmul whose result's
    sum over 100 starts none at ``b = 10, s = 41``, the inner sum's fusion does)."""
    counts: dict[int, set[sympy.Expr]] = {}
    for n in sorted(region):
        node = graph.nodes[n]
        inherited = {c for v in node.inputs for c in counts.get(graph.producers.get(v), ())}
        if (n != seed.index and node.primitive in _REDUCTIONS
                and not _small(count := element_count(graph, node.inputs[0]))):
            inherited.add(count)
        if inherited:
            counts[n] = inherited
    return {n: _most(frozenset(c)) for n, c in counts.items()}


def _unit_reduction(graph: Graph, node: Node) -> bool:
    """A reduction over axes of size 1 only: a reshape once XLA simplifies it (the
    ``reduce_sum`` of a ``keepdims`` cotangent in softmax's backward pass)."""
    shape, axes = graph.values[node.inputs[0]].shape, dict(node.params).get("axes")
    return bool(axes) and all(shape[a] == 1 for a in axes)


def fused_from(graph: Graph, seed: Node, region: frozenset[int]) -> dict[int, sympy.Expr]:
    """Per op of the fusion ``region`` grown from reduction ``seed``, the elements from
    which the fusion reaches it, where there is such a bound: XLA's library fusion grows
    down through an elementwise op only from :data:`LIBRARY_MIN_ELEMENTS` of them
    (softmax's backward at (2, 512): ``-sum`` over 1024 rows stops it, so ``/ sqrt(d)``
    after it is a loop fusion's); an op before those (taken going up, or a merged dot's
    chain) takes the smallest bound of its readers in the fusion, where all have one."""
    down: dict[int, sympy.Expr | None] = {seed.index: None}  # None: no bound
    for n in sorted(region):
        node = graph.nodes[n]
        parents = [down[graph.producers[v]] for v in node.inputs
                   if graph.producers.get(v) in down]
        if n == seed.index or not parents:
            continue
        gate = None if None in parents else _most(frozenset(parents))
        if node.primitive in _ELEMENTWISE:
            count = element_count(graph, node.outputs[0])
            gate = count if gate is None else _least(frozenset({gate, count}))
        down[n] = gate
    gates = {n: g for n, g in down.items() if g is not None}
    for n in sorted(region - down.keys(), reverse=True):  # up from the reduction
        readers = [gates.get(c) for o in graph.nodes[n].outputs
                   for c in graph.consumers.get(o, ()) if c in region]
        if readers and None not in readers:
            gates[n] = _least(frozenset(readers))
    return gates


@functools.cache  # a step has few distinct element counts; sympy's Min and Max are slow
def _least(counts: frozenset[sympy.Expr]) -> sympy.Expr:
    return sympy.Min(*counts)


@functools.cache
def _most(counts: frozenset[sympy.Expr]) -> sympy.Expr:
    return sympy.Max(*counts)


class _UsedReaders(dict[int, list[int]]):
    """A value's readers XLA keeps (a dropped gradient's forward residuals do not count),
    found when first asked for: a fusion's walk reads a few of a graph's values."""

    def __init__(self, graph: Graph, used: Sequence[bool]) -> None:
        super().__init__()
        self._graph, self._used = graph, used

    def __missing__(self, v: int) -> list[int]:
        self[v] = [c for c in self._graph.consumers.get(v, ()) if self._used[c]]
        return self[v]


@functools.cache  # a step's reductions have few distinct sizes; sympy's subs is slow
def _small(reduced: sympy.Expr) -> bool:
    """A reduction taken as no fusion's start: under the threshold, each dim counted as
    :data:`_TYPICAL_DIM` (a mean over the batch of per-example losses; XLA's fusion
    starts at their row sums). Any other count decides per shape, by
    :func:`reduction_sizes`' step, which a concrete trace takes at its numbers."""
    reduced = sympy.sympify(reduced)
    typical = reduced.subs({x: _TYPICAL_DIM for x in reduced.free_symbols})
    return bool(typical < LIBRARY_MIN_ELEMENTS)


def reduction_sizes(graph: Graph, fusions: Sequence[ReductionFusion],
                    widened: Mapping[int, sympy.Expr]) -> dict[int, sympy.Expr]:
    """Buffer bytes of the values :func:`reduction_fusions`' fusions compute for
    themselves: none from :data:`LIBRARY_MIN_ELEMENTS` reduced elements on.
    ``widened``: sizes other rules already changed."""
    return {o: sympy.expand(widened.get(o, graph.values[o].nbytes)
                            * below_rows(_fused_count(f, graph.producers[o])))
            for f in fusions for o in f.inner}


def _fused_count(f: ReductionFusion, n: int) -> sympy.Expr:
    """The count from which op ``n``'s value is inside a library fusion: from the fusion's
    bound for ``n``, or from another reduction's own fusion (``reseeded``)."""
    gate = f.gates.get(n)
    count = f.reduced if gate is None else _least(frozenset({f.reduced, gate}))
    return count if n not in f.reseeded else _most(frozenset({count, f.reseeded[n]}))


def reduction_roots(fusions: Sequence[ReductionFusion]) -> frozenset[int]:
    """The values :func:`reduction_fusions`' fusions write for readers outside them: a
    library fusion's result is a buffer, even where XLA's loop fusion would recompute
    the op in each reader (``logits - max``, read by the exponential's sum and by the
    log-probabilities: measured, a cross-entropy gradient at (8, 256))."""
    return frozenset(o for f in fusions for o in f.roots)


def _reduction_region(graph: Graph, seed: Node, consumers: _UsedReaders,
                      taken: AbstractSet[int]) -> set[int]:
    """The reduction and the ops its library fusion takes in, breadth first as XLA's
    ``FuseNeighbors`` grows it: from an op taken going up (and the reduction), each
    operand whose readers the fusion then all holds; from an op taken going down (and the
    reduction), its only reader (``logits - max``; a softmax's normalisation, and the dot
    reading its probabilities in place). ``taken``: ops other fusions hold."""
    producers, nodes = graph.producers, graph.nodes
    region = {seed.index}
    queue: collections.deque[tuple[int, int | None]] = collections.deque()
    copied = _CopiedOperands(graph)

    def candidates(ni: int, up: bool, down: bool) -> None:
        for v in nodes[ni].inputs if up else ():
            p = producers.get(v)
            if (p is not None and p not in taken and p not in region and v not in copied[ni]
                    and all(c in region for c in consumers[v])):
                queue.append((p, None))
        outs = nodes[ni].outputs
        readers = consumers[outs[0]] if down and len(outs) == 1 else ()
        if len(readers) == 1 and readers[0] not in taken:
            queue.append((readers[0], outs[0]))

    candidates(seed.index, True, True)
    while queue:
        ni, via = queue.popleft()  # via: the value a downward step reads (None: upward)
        node = nodes[ni]
        if ni in region or not _library_op(graph, node) or (
                via is not None and node.primitive == "dot_general"
                and not _read_in_place(graph, node, via, copied[ni])):
            continue
        region.add(ni)
        candidates(ni, via is None, via is not None and node.primitive != "dot_general")
        if not queue:  # a dot whose readers the fusion now all holds merges its own in
            queue.extend((p, None) for p in _held_dots(graph, region, consumers, taken))
    return region


def _held_dots(graph: Graph, region: set[int], consumers: _UsedReaders,
               taken: AbstractSet[int]) -> list[int]:
    """Dots outside ``region`` whose result only ``region`` reads (the logits' dot, read
    by a log-softmax's row max and by ``logits - max``)."""
    out = []
    for v in {i for n in region for i in graph.nodes[n].inputs}:
        p = graph.producers.get(v)
        if (p is not None and p not in region and p not in taken
                and graph.nodes[p].primitive == "dot_general"
                and all(c in region for c in consumers[v])):
            out.append(p)
    return out


def _library_op(graph: Graph, node: Node) -> bool:
    """An op a reduction's library fusion takes in: float32 results of the library's
    elementwise ops, views, reductions and dots."""
    if len(node.outputs) != 1 or graph.values[node.outputs[0]].dtype != "float32":
        return False
    if node.primitive in _ELEMENTWISE or node.primitive in _FUSED_VIEWS:
        return True
    if node.primitive in _REDUCTIONS:
        return bool(node.inputs) and graph.values[node.inputs[0]].dtype == "float32"
    return (node.primitive == "dot_general" and len(node.inputs) == 2
            and all(graph.values[v].dtype == "float32" for v in node.inputs))


class _CopiedOperands(dict[int, frozenset[int]]):
    """A dot's operands XLA copies (:func:`~jaxmem.memory.fusion.copied_operands`;
    none for other ops), found when first asked for."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self._graph = graph

    def __missing__(self, n: int) -> frozenset[int]:
        node = self._graph.nodes[n]
        self[n] = frozenset(copied_operands(self._graph, node, {})
                            if node.primitive == "dot_general" else ())
        return self[n]


def _read_in_place(graph: Graph, dot: Node, v: int, copied: frozenset[int]) -> bool:
    """Whether the library's dot reads operand ``v`` as laid out: one XLA does not copy
    (:func:`~jaxmem.memory.fusion.copied_operands`) whose batch dims lead, counting unit
    dims (``jax.nn.dot_product_attention``'s probabilities ``[1, b, h, t, s]``, batch dims
    1 and 2, are copied first; an einsum's ``[b, h, t, s]`` are read in place).
    ``copied``: the operands XLA copies."""
    if v in copied:
        return False
    (_, _), (lb, rb) = dict(dot.params)["dimension_numbers"]
    batch = lb if v == dot.inputs[0] else rb
    return tuple(batch) == tuple(range(len(batch)))


def reduction_constants(graph: Graph, order: Sequence[int], used: Sequence[bool],
                        fusions: Sequence[ReductionFusion],
                        taken: frozenset[tuple] = frozenset(),
                        readers: Mapping[tuple, list[int]] | None = None) -> list[Extra]:
    """Full-size broadcasts of the scalar constants :func:`reduction_fusions`' fusions
    read, where other ops read them too (:func:`~jaxmem.memory.constants.shared_constants`;
    gelu's four, shared by every layer's MLP through XLA's CSE, measured on a 2-layer GPT
    eval step at (8, 256): four ``f32[8, 256, 512]``; attention's ``1 / sqrt(d)``, read by
    the score fusions and the softmax gradient's). An op down from the reduction counts
    only where the fusion reaches it (:func:`fused_from`): a loss's constant at the logits'
    shape, past a row sum under the threshold, is a loop fusion's. ``taken``: constant
    keys another rule counts."""
    pos = {n: p for p, n in enumerate(order)}
    uses = []
    for f in fusions:
        groups: dict[sympy.Expr, set[int]] = {}
        for n in f.nodes:
            groups.setdefault(f.gates.get(n, f.reduced), set()).add(n)
        uses += [ConstantUse(frozenset(chain), f.nodes, max(pos[n] for n in chain), rows,
                             graph.nodes[min(f.nodes)].outputs[0])
                 for rows, chain in groups.items()]
    return shared_constants(graph, used, uses, "library fusion constant operand", taken,
                            readers)
