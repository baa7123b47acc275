"""Segments: where the forward pass narrows to one activation, and plans that re-run them.

A train step's forward pass is a chain of layers joined by a residual stream: at
the end of each block one activation is all that later forward operations read
of what came before (besides parameters and a few values every layer shares,
such as rotary tables or a mask). Those values are *cuts*, found from the
dataflow graph alone — no names needed. A :class:`SegmentPlan` keeps some cuts
and recomputes everything else the forward pass would save, one segment (the
span between two kept cuts) at a time, just before that segment's backward pass:
per-layer checkpointing found automatically, or longer segments (fewer saved
cuts) where memory demands it, optionally still saving matmul outputs (as
``dots_saveable`` does).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.dims import sym
    >>> def loss(ws, x):
    ...     for w in ws:
    ...         x = x + jnp.tanh(x @ w)
    ...     return (x ** 2).sum()
    >>> b, = jax.export.symbolic_shape("b")
    >>> g = build_graph(jax.make_jaxpr(jax.grad(loss))(
    ...     [jnp.ones((8, 8))] * 3, jax.ShapeDtypeStruct((b, 8), jnp.float32)))
    >>> [str(g.values[v].shape) for v in find_segments(g, {sym('b'): 4}).cuts]
    ['(b, 8)', '(b, 8)', '(b, 8)', '(b, 8)']
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import difflib
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from jaxmem.fastexpr import sum_at
from jaxmem.graph import Graph
from jaxmem.plan.residuals import Residual, is_forward, is_primal

#: A value read across more than this share of the forward pass is shared by the
#: layers (a rotary table, a mask), not a cut: it is kept by every segment plan.
SHARED_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Segments:
    """The cuts of a graph's forward pass.

    Attributes:
        cuts: value ids of the cut activations, in forward order.
        cut_nodes: index of the node making each cut.
        shared: activations read across most of the forward pass (kept by every plan).
        cut_flops: forward FLOPs done before each cut, at the domain's corner.
        total_flops: forward FLOPs in all, at the domain's corner.
        signatures: each cut's producing primitive, rank and dtype, which two traces of
            one step share whatever their shapes (:meth:`SegmentPlan.kept_on`).
    """

    cuts: tuple[int, ...]
    cut_nodes: tuple[int, ...]
    shared: tuple[int, ...]
    cut_flops: tuple[float, ...] = ()
    total_flops: float = 0.0
    signatures: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """Which cuts to keep, and what else to save inside the segments.

    Attributes:
        count: how many segments of about equal forward FLOPs to cut the forward pass
            into (at most one per cut).
        save: primitives (``dot_general``: matmul outputs, as ``dots_saveable``) or
            residual groups (roles, :mod:`jaxmem.plan.knapsack`) whose values stay saved
            inside a segment.
        kept: indices into the symbolic trace's cuts of the cuts kept,
        n_cuts: how many cuts that trace has, and
        signatures: its cuts' :attr:`Segments.signatures`; all three set by
            :meth:`resolved`, once, so that every concrete trace keeps the same cuts.
    """

    count: int
    save: frozenset[str] = frozenset()
    kept: tuple[int, ...] = ()
    n_cuts: int = 0
    signatures: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        what = f"segments/{self.count}"
        if len(self.save) > 2:
            return what + f" saving {len(self.save)} roles"
        return what + (f" saving {'+'.join(sorted(self.save))}" if self.save else "")

    def resolved(self, segments: Segments) -> SegmentPlan:
        """This plan on ``segments`` (the symbolic trace's): the cut kept nearest each
        boundary of ``count`` equal shares of the forward FLOPs."""
        n = len(segments.cuts)
        if n == 0 or self.count <= 1:
            kept: tuple[int, ...] = ()
        elif self.count > n:
            kept = tuple(range(n))
        else:
            kept = tuple(sorted({
                min(range(n), key=lambda i: (abs(segments.cut_flops[i] - target), i))
                for target in (j * segments.total_flops / self.count
                               for j in range(1, self.count))}))
        return dataclasses.replace(self, kept=kept, n_cuts=n, signatures=segments.signatures)

    def kept_on(self, segments: Segments) -> tuple[int, ...] | None:
        """The kept cuts as indices into ``segments`` (another trace's cuts), or None when
        the two traces share no cut.

        Two traces of one step can differ away from the layers: with a symbolic length
        ``x[:, :-1]`` is a gather, with a concrete one a slice and a squeeze (one cut
        more), and a value crossing a stretch on its own in one trace may have company
        in the other. The cut sequences are aligned on their signatures: a kept cut in a
        stretch traced differently maps to the cut as far from that stretch's end (the
        value the next aligned cut reads), and one in a stretch with no cuts in this
        trace is dropped (its segment joins the next, re-run in one piece with it).
        """
        if len(segments.cuts) == self.n_cuts and (
                not self.signatures or self.signatures == segments.signatures):
            return self.kept
        if not self.signatures:
            return None
        where: dict[int, int] = {}
        shared = False
        for tag, a1, a2, b1, b2 in difflib.SequenceMatcher(
                None, self.signatures, segments.signatures, autojunk=False).get_opcodes():
            shared = shared or tag == "equal"
            if tag in ("equal", "replace"):
                where.update({i: max(b1, b2 - (a2 - i)) for i in range(a1, a2)})
        if not shared:
            return None
        return tuple(sorted({where[i] for i in self.kept if i in where}))


def encode_segment_plan(plan: SegmentPlan) -> list[Any]:
    """``plan`` as JSON-ready data (:func:`decode_segment_plan` reads it back)."""
    return [plan.count, sorted(plan.save), list(plan.kept), plan.n_cuts, list(plan.signatures)]


def decode_segment_plan(data: Sequence[Any]) -> SegmentPlan:
    """The :class:`SegmentPlan` of :func:`encode_segment_plan`'s ``data`` (an entry
    written before signatures were stored has four fields: its plan aligns by count)."""
    return SegmentPlan(int(data[0]), frozenset(str(x) for x in data[1]),
                       tuple(int(i) for i in data[2]), int(data[3]),
                       tuple(str(x) for x in data[4]) if len(data) > 4 else ())


def batch_inputs(graph: Graph) -> tuple[int, ...]:
    """Positions of the graph inputs whose shapes hold a symbolic dim (the batch)."""
    out = tuple(i for i, v in enumerate(graph.inputs) if graph.values[v].nbytes.free_symbols)
    return out or tuple(range(len(graph.inputs)))


def find_segments(graph: Graph, corner: Mapping[Any, int] | None = None,
                  batch: Collection[int] | None = None) -> Segments:
    """The cuts of ``graph``'s forward pass.

    Args:
        graph: a differentiated graph.
        corner: where FLOPs are evaluated (sympy symbol -> value); None skips the
            FLOPs (a concrete trace only needs its cuts).
        batch: positions in ``graph.inputs`` of the batch arguments (activations
            are what depends on them); default :func:`batch_inputs`. Pass the
            symbolic graph's positions when analysing its concrete twin.
    """
    batch = batch_inputs(graph) if batch is None else batch
    forward = [n for n in graph.nodes if is_primal(n.scope)]
    where = {n.index: p for p, n in enumerate(forward)}
    producers = graph.producers
    inputs = _sources(graph, batch)
    active = set(inputs)
    last_read: dict[int, int] = {}
    for p, n in enumerate(forward):
        if any(v in active for v in n.inputs):
            active.update(n.outputs)
        for v in n.inputs:
            if producers.get(v) in where or v in inputs:
                last_read[v] = p
    crossing: list[frozenset[int]] = []
    live = {v for v in inputs if v in last_read}
    for p, n in enumerate(forward):
        live.update(o for o in n.outputs if o in active and last_read.get(o, -1) > p)
        live = {v for v in live if last_read[v] > p}
        crossing.append(frozenset(live))
    spans = collections.Counter(v for c in crossing for v in c)
    shared = {v for v, k in spans.items() if k > SHARED_FRACTION * len(forward)}
    # sum_at evaluates each distinct FLOP expression once (every layer repeats them).
    done = (list(itertools.accumulate(float(sum_at([n.flops], corner)) for n in forward))
            if corner is not None else [0.0] * len(forward))
    cuts: list[int] = []
    cut_flops: list[float] = []
    for p, c in enumerate(crossing):
        rest = c - shared
        if len(rest) == 1 and (v := next(iter(rest))) not in cuts and v not in inputs:
            cuts.append(v)
            cut_flops.append(done[p])
    signatures = tuple(f"{graph.nodes[producers[v]].primitive}/{len(graph.values[v].shape)}/"
                       f"{graph.values[v].dtype}" for v in cuts)
    return Segments(tuple(cuts), tuple(producers[v] for v in cuts), tuple(sorted(shared)),
                    tuple(cut_flops), done[-1] if done else 0.0, signatures)


def _sources(graph: Graph, batch: Collection[int]) -> set[int]:
    """The batch inputs, and what the step makes of them outside any differentiated pass
    (a microbatch's slice, targets built before the loss): the forward pass's sources."""
    sources = {graph.inputs[i] for i in batch}
    for n in graph.nodes:
        if not n.is_backward and not is_forward(n.scope) and any(v in sources for v in n.inputs):
            sources.update(n.outputs)
    return sources


def segment_residuals(graph: Graph, segments: Segments, plan: SegmentPlan,
                      residuals: Sequence[Residual]) -> tuple[list[Residual], set[int]]:
    """The residuals a resolved ``plan`` recomputes, and the values it keeps as sources.

    ``segments`` are ``graph``'s own cuts; ``plan.kept`` indexes them.

    Every forward residual is recomputed from the arguments and the kept cuts,
    except kept cuts, shared values and what ``plan.save`` names. Residuals of
    one segment are rebuilt together (their first use is the segment's earliest),
    so the segment's forward pass runs once before its backward pass.
    """
    cuts = [segments.cuts[i] for i in plan.kept]
    keep = set(cuts) | set(segments.shared)
    starts = [graph.producers[v] for v in cuts]
    members: dict[int, list[Residual]] = collections.defaultdict(list)
    for r in residuals:
        if (r.value in keep or r.primitive in plan.save or r.group in plan.save
                or not is_primal(graph.nodes[r.producer].scope)):
            continue
        members[bisect.bisect_right(starts, r.producer)].append(r)
    chosen = []
    for rs in members.values():
        first = min(r.first_use for r in rs)
        chosen.extend(dataclasses.replace(r, first_use=first) for r in rs)
    return chosen, keep


def segment_candidates(n_cuts: int) -> tuple[SegmentPlan, ...]:
    """The segment plans worth scoring for a forward pass with ``n_cuts`` cuts.

    From one segment per cut down to about sqrt(n) segments (fewer saved cuts,
    longer re-runs: the classic sqrt(n) checkpointing trade), each re-running
    everything; and the finest, saving matmul outputs (cheaper, larger).
    """
    counts = sorted({n_cuts + 1, (n_cuts + 1) // 2, (n_cuts + 1) // 4,
                     math.isqrt(n_cuts + 1)} - {0, 1}, reverse=True)
    return (*[SegmentPlan(c) for c in counts],
            SegmentPlan(n_cuts + 1, frozenset({"dot_general"})))
