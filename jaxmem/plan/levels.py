"""Plans: which residual groups to recompute or offload, chosen once per function.

Residual groups are ranked by what they give back per second of extra work at
the domain's largest shape: bytes freed over the time to re-run their FLOPs or,
where offload is planned, to move them to host memory and back, whichever is
cheaper (:mod:`jaxmem.plan.offload`). Level ``k`` adds the ``k``-th useful group.
Where a constraint such as ``b*s <= T`` cuts the box, each of the domain's largest
shapes (``ShapeDomain.extreme_points``) ranks the groups for a chain of its own.
A group is useful when it lowers the symbolic peak somewhere in the domain
(decided symbolically, by sampling where the peaks are piecewise); one that
cannot (its bytes are never at the peak) is skipped, which is the BladeDISC++
idea of deciding rematerialisation by symbolic memory impact. Each level's peak
is a sympy expression; its guard is ``peak_k(dims) <= budget``: at a call the
fastest level there (``PlanSet.order_at``) whose guard holds runs. Levels no budget
would pick anywhere are dropped (:mod:`jaxmem.plan.pareto`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> from jaxmem.symbolic import ShapeDomain
    >>> b, = jax.export.symbolic_shape("b", constraints=("b <= 512",))
    >>> f = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w).sum()
    >>> g = build_graph(jax.make_jaxpr(jax.grad(f))(jnp.ones((64, 64)),
    ...                 jax.ShapeDtypeStruct((b, 64), jnp.float32)))
    >>> plans = plan_levels(g, ShapeDomain.from_constraints(("b",), ("b <= 512",)))
    >>> plans.levels[0].recompute
    ()
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import sympy

from jaxmem.fastexpr import sum_at
from jaxmem.graph import Graph
from jaxmem.memory import MemoryModel, memory_model
from jaxmem.plan.level import Level
from jaxmem.plan.loops import apply_loop_plan, loop_candidates, with_groups
from jaxmem.plan.offload import Costs, costs_for
from jaxmem.plan.pareto import on_frontier
from jaxmem.plan.remat import apply_remat, offload_chains, recompute_chains
from jaxmem.plan.residuals import Residual, find_residuals
from jaxmem.plan.scan_pairs import find_scan_pairs
from jaxmem.plan.segment_levels import segment_levels
from jaxmem.plan.select import select_level
from jaxmem.symbolic import ShapeDomain, lowers_somewhere, sym
from jaxmem.units import human_bytes


@dataclasses.dataclass(frozen=True)
class PlanSet:
    """All levels of one function, from "save everything" to "recompute all it can".

    Attributes:
        domain: the shape domain the plans are valid on.
        groups: residual groups in the order levels add them, with their residuals.
        levels: plans; ``levels[0]`` recomputes nothing.
        comparisons: how the ranking and pruning comparisons were decided.
        costs: the device rates that rank the levels by predicted step time.
    """

    domain: ShapeDomain
    groups: tuple[tuple[str, tuple[Residual, ...]], ...]
    levels: tuple[Level, ...]
    comparisons: tuple[tuple[str, int], ...]
    costs: Costs = costs_for("gpu")

    def order_at(self, dims: Mapping[str, int]) -> list[int]:
        """Level indices from fastest to slowest at ``dims`` (predicted step seconds; ties
        in level order), the order in which :func:`~jaxmem.plan.select.select_level`
        tries them."""
        seconds = [level.step_s(dims, self.costs) for level in self.levels]
        return sorted(range(len(self.levels)), key=lambda k: (seconds[k], k))

    def __repr__(self) -> str:
        return (f"PlanSet(symbols={self.domain.symbols}, levels={len(self.levels)}, "
                f"groups={len(self.groups)}, comparisons={dict(self.comparisons)})")

    def describe(self, budget_bytes: int | None = None) -> str:
        """Each level: what it adds, its symbolic peak (the guard's left side) and its figure
        at the domain's largest shapes (``extreme_points``); with a budget, at which sampled
        shapes it is chosen.

        Example:
            >>> import jax, jax.numpy as jnp, jaxmem
            >>> f = jaxmem.jit(lambda x: jax.grad(lambda x: jnp.tanh(x).sum())(x),
            ...                polymorphic_shapes=("b, 8",), constraints=("b <= 64",))
            >>> print(f.plans(jnp.ones((4, 8))).describe().splitlines()[0])
            1 level(s) over b in [1, 64]; the fastest whose guard peak(dims) <= budget runs
        """
        dom = self.domain
        ranges = ", ".join(f"{n} in [{lo}, {'inf' if hi is None else hi}]"
                           for n, lo, hi in zip(dom.symbols, dom.lower, dom.upper, strict=True))
        anchors = dom.extreme_points()
        points = dom.sample_points()
        chosen = ([select_level(self, p, budget_bytes).level for p in points]
                  if budget_bytes is not None else [])
        lines = [f"{len(self.levels)} level(s) over {ranges}; the fastest whose guard "
                 "peak(dims) <= budget runs"]
        seen_r: tuple[str, ...] = ()
        seen_o: tuple[str, ...] = ()
        for k, level in enumerate(self.levels):
            # A level of another chain (or a segment level) does not extend the one before.
            extends = set(seen_r) <= set(level.recompute) and set(seen_o) <= set(level.offload)
            if not extends:
                seen_r, seen_o = (), ()
            added = ([f"recompute {g}" for g in level.recompute if g not in seen_r]
                     + [f"offload {g}" for g in level.offload if g not in seen_o])
            if level.segments is not None:
                extends, added = False, [f"re-run {level.segments.name}"]
            if level.loops is not None:  # loop levels do not extend the level before them
                groups = len(level.recompute) + len(level.offload) - 1
                added = [level.loops.name] + ([f"and the {groups} group(s) of the greedy "
                                               "chain's last level"] if groups else [])
            seen_r, seen_o = level.recompute, level.offload
            shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3
                                            else "")
            what = ("save every residual" if k == 0 else
                    shown if level.loops is not None or not extends else "+ " + shown)
            expr = str(level.memory.peak_bytes)
            expr = expr if len(expr) <= 120 else expr[:117] + "..."
            lines.append(f"  level {k}: {what}")
            lines.append(f"    peak_bytes = {expr}")
            lines.extend(f"    at {', '.join(f'{n}={v}' for n, v in p.items())}: "
                         f"{human_bytes(level.peak_fn(p))}" for p in anchors)
            if chosen:
                lines.append(f"    chosen at {chosen.count(k)} of {len(points)} sampled shapes")
        if chosen:
            lines.append(f"  budget {human_bytes(budget_bytes or 0)}: no level is predicted to "
                         f"fit at {chosen.count(None)} of {len(points)} sampled shapes")
        counts = dict(self.comparisons)
        lines.append(f"  comparisons: {counts.get('symbolic', 0)} symbolic, "
                     f"{counts.get('fallback', 0)} by sampling")
        return "\n".join(lines)

    def choose(self, dims: Mapping[str, int], budget_bytes: int | None) -> int:
        """Index of the fastest level whose predicted peak fits (the lowest-peak one if none).

        The predictions-only form of :func:`~jaxmem.plan.select.select_level`.
        """
        selection = select_level(self, dims, budget_bytes)
        if selection.level is not None:
            return selection.level
        smallest = selection.smallest
        return 0 if smallest is None else smallest.level


PlanKey = tuple[frozenset[int], frozenset[int]]  # values recomputed, values offloaded


def _plan_key(recomputed: Sequence[Residual], offloaded: Sequence[Residual]) -> PlanKey:
    return frozenset(r.value for r in recomputed), frozenset(r.value for r in offloaded)


def _efficiency(graph: Graph, chosen: list[Residual], group: list[Residual],
                corner: dict[sympy.Symbol, int], costs: Costs, residuals: Sequence[Residual],
                min_bytes: float = 0.0, offload: bool = False,
                moved: tuple[Residual, ...] = ()) -> tuple[float, str]:
    """Bytes freed per second of extra work if ``group`` joins the plan, and how.

    Evaluated at the domain's corner. Recomputation costs the FLOPs of its chains,
    taken relative to what stays saved, so a group whose residuals would have to be
    rebuilt from other recomputed ones costs what it really costs; offload (when
    allowed) costs a round trip over the host link, and is chosen where it is the
    cheaper of the two or the only one possible. A group freeing less than
    ``min_bytes`` scores 0: it would spend a level on noise and keep the levels that
    matter out of reach.

    Returns:
        ``(score, "recompute" | "offload")``.
    """
    def size(rs: list[Residual]) -> float:
        return float(sum_at([r.nbytes for r in rs], corner))

    best = (0.0, "recompute")
    ids = {r.value for r in group}
    chains = [c for _, c in recompute_chains(graph, chosen + group, residuals, only=ids)]
    if chains and (freed := size(group)) >= min_bytes:
        nodes = {i for c in chains for i in c}
        flops = float(sum_at([graph.nodes[i].flops for i in nodes], corner)) + 1.0
        best = (freed / costs.recompute_s(flops), "recompute")
    if offload:
        movable = [r for r, _ in offload_chains(graph, moved + tuple(group), residuals)
                   if r.value in ids]
        freed = size(movable)
        if movable and freed >= min_bytes:
            score = freed / costs.transfer_s(freed)
            if score > best[0]:
                best = (score, "offload")
    return best


_MIN_GROUP_FRACTION = 0.01  # of the unplanned peak at the domain's largest corner

#: A loop plan that rebuilds more must lower the peak by this share somewhere: plans
#: rebuilding the last, small residuals would otherwise each cost a level (and a
#: compile while selecting) for a fraction of a per cent. (Asked of segment plans too,
#: it left the quick forms of two bench.unseen programs, whose segments gain under 1 %,
#: with no level to check the rewrite on.)
LOOP_MARGIN = 0.01


def plan_levels(graph: Graph, dom: ShapeDomain, *, symbolic: bool = True,
                donated: tuple[int, ...] = (), max_levels: int = 16, offload: bool = False,
                costs: Costs | None = None) -> PlanSet:
    """Derives the levels of recomputation (and offload) for a differentiated graph.

    Args:
        graph: the (symbolic) graph of a train step.
        dom: its shape domain.
        symbolic: False for the fallback-only ablation.
        donated: donated input indices (for the memory model's aliasing).
        max_levels: at most this many levels beyond "save everything".
        offload: also consider moving residual groups to host memory.
        costs: device rates that weigh FLOPs against transfers (default: GPU's).

    Returns:
        A :class:`PlanSet`.
    """
    costs = costs or costs_for("gpu")
    residuals = find_residuals(graph)
    groups: dict[str, list[Residual]] = {}
    for r in residuals:
        groups.setdefault(r.group, []).append(r)
    base = memory_model(graph, dom, donated=donated, symbolic=symbolic)
    models: dict[PlanKey, tuple[Graph, MemoryModel]] = {}
    # One greedy chain per extreme shape: where b*s <= T binds, the matmul-heavy and the
    # attention-heavy ends of the domain rank the groups differently.
    chains = [_Greedy(graph, dom, residuals, base, costs, symbolic=symbolic, donated=donated,
                      offload=offload, corner={sym(n): v for n, v in anchor.items()},
                      models=models)
              for anchor in dom.extreme_points()]
    for search in chains:
        remaining = dict(groups)
        # Greedy: the group that frees most bytes per second of extra work, given what
        # is already recomputed or offloaded; kept only if it lowers the symbolic peak
        # somewhere.
        while remaining and len(search.levels) <= max_levels:
            picked = search.pick(remaining)
            if picked is not None:
                search.accept(*picked)
        search.order.extend(sorted(remaining))
    search = chains[0]
    greedy = search.levels[-1]
    for other in chains[1:]:
        search.adopt(other.levels[1:], other.tally)
    search.add_segment_levels()
    search.add_loop_levels(greedy)
    levels = on_frontier(search.levels, dom.sample_points(), costs, search.tally)
    # Largest first at the first extreme shape, so that level k+1 is the smaller one.
    anchor = dom.extreme_points()[0]
    levels = (levels[0], *sorted(levels[1:], key=lambda lv: -lv.peak_fn(anchor)))
    for k, v in base.comparisons:
        search.tally[k] += v
    return PlanSet(dom, tuple((n, tuple(groups[n])) for n in search.order), levels,
                   tuple(sorted(search.tally.items())), costs)


class _Greedy:
    """The state of :func:`plan_levels`' greedy search: what its levels have taken so far.

    Each round :meth:`pick` takes the next group off the remaining ones and
    :meth:`accept` turns it into a level if that lowers the peak.
    """

    def __init__(self, graph: Graph, dom: ShapeDomain, residuals: Sequence[Residual],
                 base: MemoryModel, costs: Costs, *, symbolic: bool, donated: tuple[int, ...],
                 offload: bool, corner: dict[sympy.Symbol, int],
                 models: dict[PlanKey, tuple[Graph, MemoryModel]]) -> None:
        self.graph, self.dom, self.residuals, self.costs = graph, dom, residuals, costs
        self.models = models  # shared by the chains: one memory model per plan
        self.symbolic, self.donated, self.offload = symbolic, donated, offload
        self.tally: collections.Counter[str] = collections.Counter()
        self.levels = [Level((), (), graph, base)]
        self.chosen: list[Residual] = []
        self.moved: tuple[Residual, ...] = ()
        self.names: list[str] = []
        self.moved_names: tuple[str, ...] = ()
        self.order: list[str] = []  # groups in the order the search took them
        # Groups too small for a level of their own join the next level that is kept.
        self.small: list[Residual] = []
        self.small_names: list[str] = []
        self.corner = corner
        self.min_bytes = _MIN_GROUP_FRACTION * self.levels[0].peak_fn(
            {str(k): v for k, v in self.corner.items()})

    def pick(self, remaining: dict[str, list[Residual]]
             ) -> tuple[str, list[Residual], str] | None:
        """Takes the best-scoring group off ``remaining``, sweeping the small ones aside.

        Returns:
            ``(name, group, "recompute" | "offload")``, or None when no group is
            left or the best one frees nothing.
        """
        scores = {n: _efficiency(self.graph, self.chosen, list(rs), self.corner, self.costs,
                                 self.residuals, self.min_bytes, self.offload, self.moved)
                  for n, rs in remaining.items()}
        for n in sorted(remaining):
            if (scores[n][0] <= 0.0
                    and _efficiency(self.graph, self.chosen, list(remaining[n]), self.corner,
                                    self.costs, self.residuals)[0] > 0):
                self.small.extend(remaining.pop(n))  # too small for a level: rides along
                self.small_names.append(n)
                self.order.append(n)
        if not remaining:
            return None
        name = max(sorted(remaining), key=lambda n: scores[n][0])
        group = remaining.pop(name)
        self.order.append(name)
        score, how = scores[name]
        return None if score <= 0.0 else (name, group, how)

    def accept(self, name: str, group: list[Residual], how: str) -> None:
        """Adds a level with ``group`` (and the small groups waiting) if it lowers the peak."""
        trial = self.chosen + self.small + (list(group) if how == "recompute" else [])
        trial_moved = self.moved + (tuple(group) if how == "offload" else ())
        key = _plan_key(trial, trial_moved)
        if key not in self.models:
            g2 = apply_remat(self.graph, trial, trial_moved, self.residuals)
            self.models[key] = g2, memory_model(g2, self.dom, donated=self.donated,
                                                symbolic=self.symbolic)
        g2, m = self.models[key]
        if not lowers_somewhere(m.peak_bytes, self.levels[-1].memory.peak_bytes, self.dom,
                                self.symbolic, self.tally):
            return  # never lowers the peak: it would only cost time
        self.chosen, self.moved = trial, trial_moved
        self.names = self.names + ([name] if how == "recompute" else []) + self.small_names
        self.moved_names = self.moved_names + ((name,) if how == "offload" else ())
        self.small, self.small_names = [], []
        flops = sympy.Add(*[r.recompute_flops for r in self.chosen])
        self.levels.append(Level(tuple(self.names), tuple(self.chosen), g2, m, flops,
                                 self.moved_names, self.moved))

    def adopt(self, levels: Sequence[Level], tally: collections.Counter[str]) -> None:
        """Takes another chain's levels (those not already held) and its decision counts."""
        held = {_plan_key(lv.residuals, lv.offloaded) for lv in self.levels}
        self.levels.extend(lv for lv in levels
                           if _plan_key(lv.residuals, lv.offloaded) not in held)
        self.tally.update(tally)

    def add_segment_levels(self) -> None:
        """Appends the segment plans (:mod:`jaxmem.plan.segment_levels`) that lower the
        peak somewhere below every level that re-runs less, and those keeping roles
        (left to the Pareto pass: they trade bytes for re-run time)."""
        plain, keeping = segment_levels(self.graph, self.dom, self.residuals, self.corner,
                                        self.donated, self.symbolic)
        self.keep_lowering(plain)
        self.levels.extend(keeping)

    def keep_lowering(self, candidates: list[Level], margin: float = 0.0) -> None:
        """Appends, cheapest first, each candidate whose peak at some sampled shape is below
        every level's so far by more than ``margin`` of it (whatever it re-runs: the
        Pareto pass drops the levels a cheaper and smaller one makes useless)."""
        points = self.dom.sample_points()
        self.tally["fallback"] += len(candidates)
        for level in sorted(candidates, key=lambda lv: float(lv.recompute_flops.subs(
                self.corner))):
            if any(level.peak_fn(p) < (1 - margin) * min(lv.peak_fn(p) for lv in self.levels)
                   for p in points):
                self.levels.append(level)

    def add_loop_levels(self, base: Level) -> None:
        """Appends the loop plans (:mod:`jaxmem.plan.loops`) that lower the peak somewhere,
        each alone and on top of ``base``'s groups (the greedy chain's smallest level)."""
        pairs = find_scan_pairs(self.graph)
        if not pairs:
            return
        bases = list(dict.fromkeys([((), ()), (base.recompute, base.offload)]))
        candidates = []
        graph_flops = sympy.Add(*[n.flops for n in self.graph.nodes])
        for plan in loop_candidates(self.graph, pairs, self.corner, self.costs):
            looped = apply_loop_plan(self.graph, plan)
            for recompute, offload in bases:
                g2, chosen, moved = with_groups(looped, recompute, offload)
                m = memory_model(g2, self.dom, donated=self.donated, symbolic=self.symbolic)
                flops = sympy.expand(sympy.Add(*[n.flops for n in g2.nodes]) - graph_flops)
                candidates.append(Level((*recompute, plan.name), chosen, g2, m, flops,
                                        offload, moved, loops=plan))
        self.keep_lowering(candidates, LOOP_MARGIN)
