"""The falsifier: two legal op orders whose relative memory is non-affine in the dims.

Each program has two independent branches, A and B, and a join that needs both
branch results whole. A branch makes a wide transient (``rows x H``) and
shrinks it to a live-out (``rows x L``) that waits for the join; which branch
should run first depends on which has more rows, and that relation is
non-affine in the dims:

* ``floordiv``: A has ``s1 // 2`` rows (a slice of an ``s1``-row input), B has
  ``s0`` rows; the boundary is ``s0 = s1 // 2``.
* ``maxmin``: A has ``max(s0, s1)`` rows (an input padded to the longer one),
  B has ``min(s0, s1)`` rows and a transient three times as wide; the
  boundary is ``max(s0, s1) = 3 min(s0, s1)``.

The program text interleaves the branches (XLA's default order). For each
shape of a grid over the declared domain this measures XLA's peak
(``argument + output - alias + temp``) of

* ``ab`` / ``ba``: the same computation written with the order pinned by one
  ``lax.optimization_barrier`` (A entirely before B, or B before A), compiled
  with the barrier kept (the exact-shape optimum is the lower of the two);
* ``xla``: the interleaved program under ``jax.jit`` (XLA's own order);
* ``jaxmem``: ``jaxmem.jit`` with ``MemoryAware(reorder=True)``, which proposes
  an order from symbolic comparisons and keeps it at a shape only where XLA's
  peak is lower with it (``order_kept``); the default ``MemoryAware()`` leaves
  the order to XLA;
* ``jx_ab`` / ``jx_ba`` (full run only): jaxmem enforcing each order itself
  (a :class:`BranchFirst` scheduler), which chains every materialising op
  through barriers.

and records how jaxmem's comparisons decided: the branch transients compared
directly (``compare``), the greedy order's tally, and the symbolic peaks of
the two orders (jaxmem's memory model) compared over the domain and at the shape.

Usage::

    python -m bench.falsifier [--quick] [--out falsifier.json] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxmem
from bench.outputs import TextTable, add_output_arguments
from jaxmem.lower import compiler_options
from jaxmem.memory import memory_model
from jaxmem.schedulers import MemoryAware, ScheduleGraph, memory_order
from jaxmem.symbolic import compare, lowers_somewhere, sym

H, L, IN = 512, 256, 8  # transient width, live-out width, input width (float32)


def _weights(h_b: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    shapes = {"at": (IN, H), "al": (H, L), "bt": (IN, h_b), "bl": (h_b, L)}
    return {k: jnp.asarray(0.05 * rng.standard_normal(s, np.float32)) for k, s in shapes.items()}


def _join(la: jax.Array, lb: jax.Array) -> jax.Array:
    """Reads both live-outs whole (one fused loop over the concatenation)."""
    return jnp.tanh(jnp.concatenate([la, lb], 0)).sum()


def _branches(w: dict[str, jax.Array], xa: jax.Array, yb: jax.Array,
              order: str | None) -> jax.Array:
    """Branch A on ``xa``, branch B on ``yb``: interleaved (None), or pinned ``ab`` / ``ba``."""
    def a(v: jax.Array) -> jax.Array:
        with jax.named_scope("branch_a"):
            return jnp.exp(v @ w["at"]) @ w["al"]

    def b(v: jax.Array) -> jax.Array:
        with jax.named_scope("branch_b"):
            return jnp.exp(v @ w["bt"]) @ w["bl"]

    if order == "ab":
        la = a(xa)
        la, yb = lax.optimization_barrier((la, yb))  # B's input now waits for A's result
        return _join(la, b(yb))
    if order == "ba":
        lb = b(yb)
        lb, xa = lax.optimization_barrier((lb, xa))
        return _join(a(xa), lb)
    with jax.named_scope("branch_a"):
        ta = jnp.exp(xa @ w["at"])
    with jax.named_scope("branch_b"):
        tb = jnp.exp(yb @ w["bt"])
    with jax.named_scope("branch_a"):
        la = ta @ w["al"]
    with jax.named_scope("branch_b"):
        lb = tb @ w["bl"]
    return _join(la, lb)


def floordiv_fn(order: str | None = None) -> Callable[..., jax.Array]:
    """``f(w, x[s1, 8], y[s0, 8])``: A on the first ``s1 // 2`` rows of x, B on y reversed."""
    def f(w: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        with jax.named_scope("branch_a"):
            xa = lax.slice_in_dim(x, 0, x.shape[0] // 2)
        with jax.named_scope("branch_b"):
            yb = lax.rev(y, (0,))
        return _branches(w, xa, yb, order)
    return f


def _dim_fn(name: str) -> Callable[[Any, Any], Any]:
    """``max_dim`` / ``min_dim`` of symbolic dims (``jax.core`` as of JAX 0.10; the
    shape-polymorphism docs' ``core.max_dim``, wherever a later JAX keeps it)."""
    fn = getattr(jax.core, name, None)
    if fn is None:  # pragma: no cover - a JAX that moved it
        from jax._src import core
        fn = getattr(core, name)
    return fn


def maxmin_fn(order: str | None = None) -> Callable[..., jax.Array]:
    """``f(w, x[s0, 8], y[s1, 8])``: A on x zero-padded to ``max(s0, s1)`` rows, B on
    the first ``min(s0, s1)`` rows of y."""
    def f(w: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        n, m = x.shape[0], y.shape[0]
        with jax.named_scope("branch_a"):
            xa = jnp.pad(x, ((0, _dim_fn("max_dim")(n, m) - n), (0, 0)))
        with jax.named_scope("branch_b"):
            yb = lax.slice_in_dim(y, 0, _dim_fn("min_dim")(n, m))
        return _branches(w, xa, yb, order)
    return f


@dataclasses.dataclass(frozen=True)
class Falsifier:
    """One program of the falsifier and its shape domain.

    Attributes:
        name: label.
        fn: ``order -> f(w, x, y)``; order None is the interleaved program text.
        h_b: branch B's transient width.
        shapes: ``(x, y)`` polymorphic shapes.
        constraints: the declared domain.
        rows: dims -> (rows of A, rows of B), the non-affine relation itself.
        full: grid of dims for the full run; quick: a few of them.
    """

    name: str
    fn: Callable[[str | None], Callable[..., jax.Array]]
    h_b: int
    shapes: tuple[str, str]
    constraints: tuple[str, ...]
    rows: Callable[[dict[str, int]], tuple[int, int]]
    full: tuple[dict[str, int], ...]
    quick: tuple[dict[str, int], ...]

    def args(self, dims: dict[str, int]) -> tuple[Any, ...]:
        """Weights and inputs at concrete dims."""
        x, y = (jnp.ones(tuple(dims[d] if d in dims else int(d) for d in
                              (t.strip() for t in spec.split(","))), jnp.float32)
                for spec in self.shapes)
        return (_weights(self.h_b), x, y)

    def jit(self, scheduler: jaxmem.Scheduler) -> jaxmem.Jitted:
        return jaxmem.jit(self.fn(None), polymorphic_shapes=(None, *self.shapes),
                          constraints=self.constraints, scheduler=scheduler)


def _grid(s1s: Sequence[int], s0s: Sequence[int]) -> tuple[dict[str, int], ...]:
    return tuple({"s1": a, "s0": b} for a in s1s for b in s0s)


FLOORDIV = Falsifier(
    "floordiv", floordiv_fn, H, ("s1, 8", "s0, 8"), ("s1 >= 2", "s1 <= 512", "s0 <= 256"),
    lambda d: (d["s1"] // 2, d["s0"]),
    _grid((2, 63, 127, 128, 129, 255, 256, 257, 511, 512), (1, 32, 63, 64, 127, 128, 129, 256)),
    ({"s1": 512, "s0": 64}, {"s1": 257, "s0": 128}, {"s1": 255, "s0": 128},
     {"s1": 64, "s0": 200}))
MAXMIN = Falsifier(
    "maxmin", maxmin_fn, 3 * H, ("s0, 8", "s1, 8"), ("s0 <= 256", "s1 <= 256"),
    lambda d: (max(d["s0"], d["s1"]), min(d["s0"], d["s1"])),
    _grid((1, 32, 64, 95, 96, 97, 192, 256), (1, 32, 64, 95, 96, 97, 192, 256)),
    ({"s1": 256, "s0": 32}, {"s1": 64, "s0": 256}, {"s1": 96, "s0": 32},
     {"s1": 128, "s0": 96}))
PROGRAMS = {p.name: p for p in (FLOORDIV, MAXMIN)}


class BranchFirst(jaxmem.Scheduler):
    """Runs every node of one branch (by named scope) as early as the dependencies allow."""

    def __init__(self, first: str) -> None:
        self.first = first

    def order(self, graph: ScheduleGraph) -> list[int]:
        return branch_order(graph, self.first)


def branch_order(graph: ScheduleGraph | Any, first: str) -> list[int]:
    """A topological order of ``graph`` (a ScheduleGraph or a Graph) that runs the nodes
    whose scope starts with ``first`` first, then the other branch, then the join."""
    nodes, producers = graph.nodes, getattr(graph, "graph", graph).producers
    deps = {n.index: {producers[v] for v in n.inputs if v in producers} for n in nodes}
    users: dict[int, list[int]] = collections.defaultdict(list)
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)

    def key(n: int) -> tuple[int, int]:
        scope = nodes[n].scope
        return (0 if scope.startswith(first) else 1 if scope.startswith("branch") else 2, n)

    ready = [key(n) for n, ds in deps.items() if not ds]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            deps[u].discard(n)
            if not deps[u]:
                heapq.heappush(ready, key(u))
    return out


def _first_branch(graph: Any, order: Sequence[int] | None) -> str:
    """Which branch's first wide op (its first dot) runs first under ``order``."""
    order = list(range(len(graph.nodes))) if order is None else list(order)
    dots = [graph.nodes[i].scope for i in order if graph.nodes[i].primitive == "dot_general"]
    seq = [s.removeprefix("branch_") for s in dots]
    done_first = seq[:2] in (["a", "a"], ["b", "b"])
    return ("ab" if seq[0] == "a" else "ba") if done_first else "interleaved"


def symbolic_decisions(prog: Falsifier) -> dict[str, Any]:
    """What jaxmem's comparisons decide about the program, once, over the whole domain."""
    f = prog.jit(MemoryAware(reorder=True))
    analysis = f.analysis(*prog.args(prog.quick[0]))
    graph, dom = analysis.graph, analysis.domain
    dots = {s: next(graph.values[n.outputs[0]].nbytes for n in graph.nodes
                    if n.primitive == "dot_general" and n.scope == f"branch_{s}") for s in "ab"}
    transient = compare(dots["a"], dots["b"], dom)
    tally: dict[str, int] = {}
    greedy = memory_order(graph, dom, tally)
    peaks = {o: memory_model(graph, dom, order=branch_order(graph, f"branch_{o[0]}")).peak_bytes
             for o in ("ab", "ba")}
    peak_cmp = compare(peaks["ab"], peaks["ba"], dom)
    lower: collections.Counter[str] = collections.Counter()
    greedy_peak = memory_model(graph, dom, order=greedy).peak_bytes
    proposed = analysis.orders[0] is not None
    lowers_somewhere(greedy_peak, memory_model(graph, dom).peak_bytes, dom, True, lower)
    return {"domain": list(prog.constraints),
            "transient_bytes": {k: str(v) for k, v in dots.items()},
            "transient_compare": {"result": transient.result.value, "split": str(transient.split),
                                  "decided_by": transient.decided_by},
            "greedy_order": _first_branch(graph, greedy), "greedy_tally": tally,
            "proposed": proposed, "proposal_check": dict(lower),
            "model_peak_compare": {"result": peak_cmp.result.value,
                                   "decided_by": peak_cmp.decided_by},
            "report_comparisons": dict(jaxmem.analyze(prog.fn(None), *_specs(prog)).comparisons),
            "_peaks": peaks}


def _specs(prog: Falsifier) -> tuple[Any, ...]:
    s1, s0 = jax.export.symbolic_shape("s1, s0", constraints=prog.constraints)
    dims = {"s1": s1, "s0": s0}
    shapes = [tuple(dims.get(t.strip(), None) or int(t) for t in spec.split(","))
              for spec in prog.shapes]
    return (_weights(prog.h_b), *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))


def _hand_peak(prog: Falsifier, order: str | None, args: tuple[Any, ...]) -> int:
    """XLA's peak of the program written in ``order`` (None: jax.jit of the interleaved text)."""
    options = compiler_options() if order else {}
    return jaxmem.xla_peak_bytes(jax.jit(prog.fn(order)).lower(*args).compile(options))


def measure_shape(prog: Falsifier, dims: dict[str, int], jitted: dict[str, jaxmem.Jitted],
                  model_peaks: dict[str, Any]) -> dict[str, Any]:
    """Every order's XLA peak at ``dims``, jaxmem's choice, and what the optimum was."""
    args = prog.args(dims)
    rows_a, rows_b = prog.rows(dims)
    row: dict[str, Any] = {"dims": dict(dims), "rows_a": rows_a, "rows_b": rows_b,
                           "transient_a": 4 * H * rows_a, "transient_b": 4 * prog.h_b * rows_b,
                           "ab": _hand_peak(prog, "ab", args), "ba": _hand_peak(prog, "ba", args),
                           "xla": _hand_peak(prog, None, args)}
    plan = jitted["jaxmem"].plan_for(*args)
    row.update(jaxmem=plan.peak_bytes, order_kept=plan.order_enforced)
    for name in ("jx_ab", "jx_ba"):
        if name in jitted:
            row[name] = jitted[name].plan_for(*args).peak_bytes
    at = {sym(k): v for k, v in dims.items()}
    model = {o: int(e.subs(at)) for o, e in model_peaks.items()}
    row["model_ab"], row["model_ba"] = model["ab"], model["ba"]
    row["best_order"] = _argmin(row["ab"], row["ba"])
    row["model_order"] = _argmin(model["ab"], model["ba"])
    row["optimum"] = min(row["ab"], row["ba"], row["xla"])
    return row


def _argmin(ab: int, ba: int) -> str:
    return "tie" if ab == ba else ("ab" if ab < ba else "ba")


#: A peak within this factor of another counts as reaching it: jaxmem's pinned order
#: carries a few scalar barrier operands (about 0.2 KiB here) that one hand-written
#: barrier does not.
NEAR = 1.001


def judge(rows: Sequence[dict[str, Any]], proposed: str) -> dict[str, Any]:
    """Counts of shapes where jaxmem's proposed order (and its final plan) were optimal."""
    def count(pred: Callable[[dict[str, Any]], bool]) -> int:
        return sum(1 for r in rows if pred(r))

    def best(r: dict[str, Any]) -> int:
        return min(r["ab"], r["ba"])

    excess = sorted(100 * (r["jaxmem"] / best(r) - 1) for r in rows)
    xla_excess = sorted(100 * (r["xla"] / best(r) - 1) for r in rows)
    return {"shapes": len(rows),
            "proposed_order": proposed,
            "proposed_is_best_order": count(lambda r: r["best_order"] in (proposed, "tie")),
            "model_picks_best_order": count(lambda r: r["best_order"] in (r["model_order"], "tie")),
            "order_kept": count(lambda r: r["order_kept"]),
            "jaxmem_at_best_order": count(lambda r: r["jaxmem"] <= NEAR * best(r)),
            "jaxmem_at_or_below_xla": count(lambda r: r["jaxmem"] <= r["xla"]),
            "xla_at_best_order": count(lambda r: r["xla"] <= NEAR * best(r)),
            "jaxmem_over_best_pct": {"median": excess[len(excess) // 2], "max": excess[-1]},
            "xla_over_best_pct": {"median": xla_excess[len(xla_excess) // 2],
                                  "max": xla_excess[-1]},
            "best_order_counts": dict(collections.Counter(r["best_order"] for r in rows))}


def run_program(prog: Falsifier, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """The symbolic decisions and every shape's measurements for one program."""
    decisions = symbolic_decisions(prog)
    model_peaks = decisions.pop("_peaks")
    jitted = {"jaxmem": prog.jit(MemoryAware(reorder=True))}
    if not quick:
        jitted.update(jx_ab=prog.jit(BranchFirst("branch_a")),
                      jx_ba=prog.jit(BranchFirst("branch_b")))
    log(f"\n{prog.name}: A {decisions['transient_bytes']['a']} B, "
        f"B {decisions['transient_bytes']['b']} B over {', '.join(prog.constraints)}")
    log(f"  compare(A, B): {decisions['transient_compare']['result']} "
        f"({decisions['transient_compare']['decided_by']}); greedy order "
        f"{decisions['greedy_order']} {decisions['greedy_tally']}; model peaks ab vs ba: "
        f"{decisions['model_peak_compare']['result']} "
        f"({decisions['model_peak_compare']['decided_by']})")
    log(f"  {'dims':<16} {'rows A/B':>9} {'ab KiB':>8} {'ba KiB':>8} {'xla KiB':>8} "
        f"{'jaxmem':>8} kept best model")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        for dims in (prog.quick if quick else prog.full):
            r = measure_shape(prog, dims, jitted, model_peaks)
            rows.append(r)
            shape = " ".join(f"{k}={v}" for k, v in dims.items())
            log(f"  {shape:<16} {r['rows_a']:>4}/{r['rows_b']:<4} {r['ab'] / 1024:>8.1f} "
                f"{r['ba'] / 1024:>8.1f} {r['xla'] / 1024:>8.1f} {r['jaxmem'] / 1024:>8.1f} "
                f"{'yes ' if r['order_kept'] else 'no  '} {r['best_order']:<4} {r['model_order']}")
    summary = judge(rows, decisions["greedy_order"] if decisions["proposed"] else "none")
    log(f"  summary: {summary}")
    return {"program": prog.name, "decisions": decisions, "rows": rows, "summary": summary}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="four shapes per program")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated subset")
    add_output_arguments(parser, "falsifier.json")
    args = parser.parse_args(argv)
    log = TextTable()
    log(f"jax {jax.__version__}, backend {jax.default_backend()}; peaks are XLA's "
        "argument + output - alias + temp")
    results = [run_program(PROGRAMS[n], args.quick, log) for n in args.programs.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "backend": jax.default_backend(),
                       "quick": args.quick, "programs": results}, f, indent=1)
    log.save(args, "falsifier.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
