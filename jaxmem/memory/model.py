"""The symbolic memory model: the peak of a graph under one op order, over all shapes at once.

The order is the one XLA runs the graph in when jaxmem leaves it to XLA
(:mod:`jaxmem.memory.schedule`: breadth-first on CPU), or the one a scheduler
pins. XLA's accounting of an executable is ``argument + output - alias + temp``; this
module decides each term. The first three are sums over the graph's inputs and
outputs (a tuple of results adds XLA's table of pointers; ``alias`` is the
outputs that live in donated arguments); ``temp`` is the most temporary memory
live at any program point. Which buffers exist, and when each is live, comes
from :func:`jaxmem.memory.liveness.liveness` (which values XLA materialises
from :mod:`jaxmem.memory.fusion`). :func:`memory_model` sums the live buffers
per program point and keeps the points that can be the maximum somewhere in the
domain: first by coefficient dominance, then by the comparisons of
:mod:`jaxmem.symbolic`. Without output reuse the peak is a ``sympy.Max`` of
polynomials over those points; with it (the default, as XLA does) temporaries
may sit in output buffers not written yet, placed as XLA's buffer assigner places
them (:mod:`jaxmem.memory.assign`), and the peak is a ``Min`` over assignments of
``Max`` of piecewise polynomials.

Accuracy against XLA's CPU peak: README, "Memory prediction accuracy"
(``python -m bench.accuracy``).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.symbolic import ShapeDomain
    >>> b, = jax.export.symbolic_shape("b")
    >>> f = lambda x: jnp.tanh(x @ x.T).sum()
    >>> g = build_graph(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((b, 8), jnp.float32)))
    >>> m = memory_model(g, ShapeDomain.from_constraints(("b",), ("b <= 64",)))
    >>> m.peak_bytes  # from 4096 elements XLA CPU's sum computes the dot's result itself
    4*b**2*Piecewise((1, b**2 < 4096), (0, True)) + 32*b + 4
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Sequence

import jax
import sympy

from jaxmem.fastexpr import pairs_at
from jaxmem.graph import Graph
from jaxmem.memory.assign import assignment_peak
from jaxmem.memory.columns import library_fusions, library_owner
from jaxmem.memory.copies import dot_copies
from jaxmem.memory.frontier import candidate_points, max_expr, to_expr
from jaxmem.memory.fusion import used_nodes
from jaxmem.memory.liveness import Buffer, liveness
from jaxmem.memory.loop_operands import as_run, widened_inputs
from jaxmem.memory.points import live_table
from jaxmem.memory.schedule import xla_order
from jaxmem.memory.slices import held_inputs, slices_as_temps
from jaxmem.symbolic import ShapeDomain, sym

POINTER_BYTES = 8  # one entry of a tuple's table of buffer pointers (64-bit hosts)

LinExpr = dict[sympy.Expr, sympy.Expr]  # monomial -> coefficient; all monomials are >= 0


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryModel:
    """Symbolic memory of a graph under one op order.

    Attributes:
        buffers: every buffer with its live range.
        argument_bytes: sum of argument sizes.
        output_bytes: sum of output sizes (each output buffer once).
        alias_bytes: output bytes that reuse donated arguments.
        temp_bytes: most temporary bytes live at once (a ``Max`` over program points).
        peak_bytes: ``argument + output - alias + temp``.
        points: temporary bytes live at each order position (monomial, coefficient pairs);
            ``timeline`` has them as sympy expressions.
        candidates: order positions whose live set can be the maximum somewhere.
        counted: the comparisons counted when the model was built; ``comparisons``
            (a property) adds those of the reuse-free bound.
        upper: ``temp_bytes_without_reuse``, or what it is derived from when first
            read (:class:`_Bound`).
        reuse_outputs: whether ``temp_bytes`` counts temporaries stored in
            not-yet-written output buffers (see :mod:`jaxmem.memory.reuse`).

    Properties ``comparisons`` (how the pruning comparisons were decided) and
    ``temp_bytes_without_reuse`` (``temp_bytes`` if no temporary could use an output
    buffer before the output is written: a ``Max`` of polynomials, an upper bound of
    ``temp_bytes``, equal when ``reuse_outputs=False``).
    """

    buffers: tuple[Buffer, ...]
    argument_bytes: sympy.Expr
    output_bytes: sympy.Expr
    alias_bytes: sympy.Expr
    temp_bytes: sympy.Expr
    peak_bytes: sympy.Expr
    points: Sequence[tuple[tuple[sympy.Expr, sympy.Expr], ...]] = dataclasses.field(repr=False)
    candidates: tuple[int, ...]
    counted: tuple[tuple[str, int], ...]
    upper: sympy.Expr | _Bound | None = dataclasses.field(default=None, repr=False)
    reuse_outputs: bool = False

    @functools.cached_property
    def timeline(self) -> tuple[sympy.Expr, ...]:
        """Temporary bytes live at each order position, as sympy expressions."""
        return tuple(_to_expr(dict(p)) for p in self.points)

    @functools.cached_property
    def temp_bytes_without_reuse(self) -> sympy.Expr | None:
        """``temp_bytes`` if no temporary could use an output buffer (see the class)."""
        return self._bound[0]

    @functools.cached_property
    def comparisons(self) -> tuple[tuple[str, int], ...]:
        """How the pruning comparisons were decided (those of the bound included)."""
        return self._bound[1]

    @functools.cached_property
    def _bound(self) -> tuple[sympy.Expr | None, tuple[tuple[str, int], ...]]:
        if not isinstance(self.upper, _Bound):
            return self.upper, self.counted
        tally = collections.Counter(dict(self.counted))
        upper, _ = self.upper.derive(tally)
        return upper, tuple(sorted(tally.items()))

    def _key(self) -> tuple:
        """What equality compares: every field, the bound and its comparisons as derived
        (a model read back from a stored plan holds them derived)."""
        return (self.buffers, self.argument_bytes, self.output_bytes, self.alias_bytes,
                self.temp_bytes, self.peak_bytes, self.points, self.candidates,
                self.comparisons, self.temp_bytes_without_reuse, self.reuse_outputs)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key())


@dataclasses.dataclass(frozen=True)
class _Bound:
    """What the reuse-free bound of a model with output reuse is derived from, when first
    asked for: its peak does not depend on it, and a plan search builds a model per
    candidate plan (the bound's frontier and ``Max`` were an eighth of a 22-layer step's
    plan derivation, for figures only a stored plan or a test reads).

    Attributes:
        points: the model's live bytes per order position.
        dom: the shape domain.
        symbolic: False for the sampling-only ablation.
    """

    points: Sequence[tuple[tuple[sympy.Expr, sympy.Expr], ...]] | list[LinExpr]
    dom: ShapeDomain
    symbolic: bool

    def derive(self, tally: collections.Counter[str]) -> tuple[sympy.Expr, list[int]]:
        """The ``Max`` over the points that can be the maximum somewhere, and those points;
        the comparisons made are counted in ``tally``."""
        points = self.points
        candidates = candidate_points(points, self.dom, tally, self.symbolic)  # type: ignore[arg-type]
        return max_expr([_to_expr(dict(points[p])) for p in candidates]), candidates


def _lin(e: sympy.Expr) -> LinExpr:
    return dict(_lin_cached(e))


@functools.lru_cache(maxsize=16384)
def _lin_cached(e: sympy.Expr) -> tuple[tuple[sympy.Expr, sympy.Expr], ...]:
    out: LinExpr = {}
    for term in sympy.Add.make_args(sympy.expand(e)):
        c, m = term.as_coeff_Mul()
        out[m] = out.get(m, 0) + c
    return tuple(out.items())


_to_expr = to_expr  # a point's terms as one expression


@dataclasses.dataclass(frozen=True)
class _Body:
    """What a control-flow op's body needs while it runs, at the op's order position.

    Attributes:
        temp: its most temporary bytes live at once.
        buffers: for a loop, the sizes of the buffers live at its largest point (at the
            domain's corner); each may sit in an output not written yet, as any
            temporary of the enclosing program may. Empty for ``cond``: ``temp`` then
            counts whole.
    """

    temp: sympy.Expr
    buffers: tuple[sympy.Expr, ...] = ()


def _inner(graph: Graph, dom: ShapeDomain, symbolic: bool, backend: str | None,
           slices: frozenset[int] = frozenset(), wide: frozenset[int] = frozenset()
           ) -> MemoryModel:
    """A body's memory. Its outputs are the loop's state, allocated outside and live
    throughout, so no temporary of the body can sit in them; ``slices``: its inputs
    it holds copies of (:func:`~jaxmem.memory.slices.held_inputs`); ``wide``:
    its inputs read as float32 copies (:func:`~jaxmem.memory.loop_operands.as_run`).

    One model per body graph object: the candidate plans of a scanned step share
    their bodies with the step they rewrite, which re-derived each body's model."""
    key = (id(graph), dom, symbolic, backend, slices, wide)
    hit = _BODY_MODELS.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    m = memory_model(as_run(graph, wide), dom, symbolic=symbolic, reuse_outputs=False,
                     backend=backend, body_slices=slices)
    _BODY_MODELS[key] = (weakref.ref(graph, lambda _: _BODY_MODELS.pop(key, None)), m)
    return m


_BODY_MODELS: dict[tuple, tuple[weakref.ref, MemoryModel]] = {}  # see _inner


def forget_body_models() -> None:
    """Drops the control-flow bodies' cached models (each is also dropped with its graph),
    so that the next :func:`memory_model` derives them afresh."""
    _BODY_MODELS.clear()


def _largest_point(m: MemoryModel, dom: ShapeDomain) -> tuple[sympy.Expr, ...]:
    """Sizes of the temporaries live at ``m``'s largest point at the domain's corner, and
    what the bodies of loops running there need (one lump: a scan over layers inside a
    gradient-accumulation scan, whose stacks and body were left out: -20 % at 512 rows).
    """
    corner = {sym(k): v for k, v in dom.corner().items()}
    # The pairs, not ``timeline``: building and substituting sympy sums took a third of
    # a scanned step's loop plans.
    p = max(m.candidates, key=lambda q: float(pairs_at(m.points[q], corner)), default=None)
    if p is None:
        return ()
    live = tuple(b.nbytes for b in m.buffers if b.kind == "temp" and b.start <= p <= b.end)
    inner = sympy.expand(_to_expr(dict(m.points[p])) - sympy.Add(*live))
    return (*live, inner) if inner != 0 else live


def memory_model(graph: Graph, dom: ShapeDomain, order: Sequence[int] | None = None,
                 donated: Sequence[int] = (), symbolic: bool = True,
                 reuse_outputs: bool = True, backend: str | None = None,
                 body_slices: frozenset[int] | None = None) -> MemoryModel:
    """The symbolic memory of ``graph`` run in ``order``.

    Args:
        graph: the graph.
        dom: the shape domain (for comparisons between program points).
        order: a permutation of node indices (an order jaxmem pins); None: the order
            XLA's scheduler on ``backend`` picks (:func:`~jaxmem.memory.schedule.xla_order`).
        donated: indices into ``graph.inputs`` that are donated.
        symbolic: False runs the ablation (comparisons by sampling only).
        reuse_outputs: let temporaries use output buffers before the outputs are
            written, as XLA's buffer assignment does. The peak is then piecewise
            polynomial (``Piecewise`` where a temporary fits an output only for
            some shapes); False keeps it a ``Max`` of polynomials.
        backend: the JAX platform whose XLA rules apply (default:
            ``jax.default_backend()``; see :func:`jaxmem.memory.liveness.liveness`).
        body_slices: None, or ``graph`` is a loop body (its outputs are its state) and
            these inputs are copies it holds (:mod:`.slices`: slices XLA copies out of
            their stacks, constant fillers).

    Returns:
        A :class:`MemoryModel`.
    """
    backend = backend or jax.default_backend()
    used = used_nodes(graph)  # these four once: the order and the live ranges need them
    library = library_fusions(graph, used, backend)
    owner = library_owner(graph, used, library)
    pairs = dot_copies(graph, owner, used)
    order = xla_order(graph, backend, owner, used, pairs, library) if order is None else list(order)
    buffers = liveness(graph, order, backend, owner, used, pairs, library,
                       state_outputs=body_slices is not None)
    if body_slices:
        buffers = slices_as_temps(graph, order, buffers, body_slices)
    n = len(order)
    tally: collections.Counter[str] = collections.Counter()
    bodies = _bodies(graph, order, dom, symbolic, backend)
    extra = {p: body.temp for p, body in bodies.items()}
    # The integer-matrix sweep where it applies (every case measured), else dictionaries.
    table = live_table(buffers, extra, n)
    points = _live_points(buffers, extra, n) if table is None else table
    bound = _Bound(points, dom, symbolic)
    upper: sympy.Expr | _Bound = bound
    aliased = _aliased_outputs(graph, donated, buffers)
    if not reuse_outputs:
        temp, candidates = bound.derive(tally)
        upper = temp
    else:
        temp, candidates = _reusing_peak(buffers, aliased, bodies, n, dom, tally, symbolic)
    args = _total(tuple(b.nbytes for b in buffers if b.kind == "argument"))
    outs = _total(tuple(b.nbytes for b in buffers if b.kind == "output"))
    if len(graph.outputs) > 1:  # a tuple of results: XLA's output holds its pointer table
        outs += POINTER_BYTES * len(graph.outputs)
    alias = _total(tuple(graph.values[v].nbytes for v in aliased))
    return MemoryModel(buffers, args, outs, alias, temp, args + outs - alias + temp,
                       tuple(tuple(p.items()) for p in points) if table is None else table,
                       tuple(candidates),
                       tuple(sorted(tally.items())), upper, reuse_outputs)


def _reusing_peak(buffers: Sequence[Buffer], aliased: set[int], bodies: dict[int, _Body],
                  n: int, dom: ShapeDomain, tally: collections.Counter[str], symbolic: bool
                  ) -> tuple[sympy.Expr, tuple[int, ...]]:
    """:func:`~jaxmem.memory.assign.assignment_peak` of the temporaries and the bodies'
    buffers, with the outputs not aliased to a donated argument free until written."""
    temps = [(b.nbytes, b.start, b.end) for b in buffers if b.kind == "temp"]
    outs_free = [(b.nbytes, b.start) for b in buffers
                 if b.kind == "output" and b.value not in aliased and b.start >= 0]
    temps += [(e, p, p) for p, body in bodies.items() for e in body.buffers]
    whole = {p: body.temp for p, body in bodies.items() if not body.buffers}
    return assignment_peak(temps, outs_free, whole, n, dom, tally, symbolic)


@functools.lru_cache(maxsize=256)
def _total(terms: tuple[sympy.Expr, ...]) -> sympy.Expr:
    """``sympy.Add(*terms)``: every candidate plan of a step has the same arguments and
    outputs, and sympy's sum of hundreds of parameter sizes took milliseconds a model."""
    return sympy.Add(*terms)


def _bodies(graph: Graph, order: Sequence[int], dom: ShapeDomain,
            symbolic: bool, backend: str | None) -> dict[int, _Body]:
    """What each control-flow op's bodies need, at the order position of the op.

    An op with several bodies (``cond`` branches) needs the largest (a ``Max``). A
    loop's body also holds the copies of its operands XLA makes there
    (:mod:`jaxmem.memory.slices`: a scan's slices of its ``xs``, constant fillers).
    """
    out: dict[int, _Body] = {}
    for p, ni in enumerate(order):
        node = graph.nodes[ni]
        if not node.subgraphs:
            continue
        held = held_inputs(graph, node)
        wide = widened_inputs(graph, node, backend or jax.default_backend())
        last = node.subgraphs[-1]  # a scan's body, a while's body (not its cond)
        models = [_inner(g, dom, symbolic, backend, held, wide) if g is last
                  else _inner(g, dom, symbolic, backend) for g in node.subgraphs]
        # ``max_expr``, not ``sympy.Max``: sympy re-simplified a body's own ``Max`` by
        # pairwise comparisons, a third of a scanned step's plan derivation.
        temp = max_expr([m.temp_bytes for m in models])
        if len(models) > 1 and node.primitive == "cond":
            out[p] = _Body(temp)
            continue
        out[p] = _Body(temp, _largest_point(models[-1], dom))  # a while's body, not its cond
    return out


def _live_points(buffers: Sequence[Buffer], extra: dict[int, sympy.Expr], n: int
                 ) -> list[LinExpr]:
    """Temporary bytes live at each of the ``n`` order positions (bodies' bytes included)."""
    deltas: list[list[tuple[Buffer, int]]] = [[] for _ in range(n + 2)]
    for buf in buffers:
        if buf.kind == "temp":
            deltas[buf.start].append((buf, 1))
            deltas[buf.end + 1].append((buf, -1))
    live: LinExpr = {}
    points: list[LinExpr] = []
    for p in range(n):
        for buf, sign in deltas[p]:
            for m, c in _lin(buf.nbytes).items():
                live[m] = live.get(m, 0) + sign * c
        point = dict(live)
        if p in extra:
            for m, c in _lin(extra[p]).items():
                point[m] = point.get(m, 0) + c
        points.append({m: c for m, c in point.items() if c != 0})
    return points


def _aliased_outputs(graph: Graph, donated: Sequence[int], buffers: Sequence[Buffer]
                     ) -> set[int]:
    """Output value ids that live in a donated argument's buffer.

    Each donated argument takes the first output of its shape and dtype that no
    other donated argument took (XLA's input-output aliasing of donated buffers); an
    argument without a buffer (nothing reads it: ``jax.jit`` prunes it) takes none.
    """
    free = collections.Counter()
    kept = {b.value for b in buffers if b.kind == "argument"}
    for i in donated:
        if graph.inputs[i] not in kept:
            continue
        v = graph.values[graph.inputs[i]]
        free[(v.shape, v.dtype)] += 1
    out = set()
    for vid in dict.fromkeys(graph.outputs):
        v = graph.values[vid]
        if free[(v.shape, v.dtype)] > 0:
            free[(v.shape, v.dtype)] -= 1
            out.add(vid)
    return out
