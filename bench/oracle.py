"""The oracle: at each shape, the fastest candidate that fits the budget by XLA's figure.

Candidates at a shape are every level of jaxmem's plan set (``Jitted.plans`` /
``Jitted.compile_level``) and the uniform policies: plain ``jax.jit`` (save all),
per-layer ``nothing_saveable`` (``xla+full_remat``) and ``dots_saveable``
(``xla+dots``). Each is compiled; those whose ``jaxmem.xla_peak_bytes`` fits the
budget are timed, the ones the grid already timed (plain XLA, the two policies,
jaxmem's own level) reuse its timings. Times are per-repeat ratios to plain XLA
at the same shape, each candidate alternating with it as the grid's rows do
(:func:`bench.methods.time_round`), so ratios of any two candidates are paired
through that baseline; the oracle picks the lowest median.

``jaxmem_over_oracle``: jaxmem's per-repeat ratio over the oracle's, with its
min / median / max (exactly 1 where the oracle chose jaxmem's own executable).
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.methods import Methods, spread, time_round

#: grid methods that are oracle candidates as they are (the uniform policies)
UNIFORM = ("xla", "xla+full_remat", "xla+dots")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One executable the oracle considers at a shape.

    Attributes:
        name: ``xla``, ``xla+full_remat``, ``xla+dots`` or ``jaxmem level k``.
        peak_bytes: XLA's peak of the executable.
        call: runs one step.
        fingerprint: a hash of the executable's HLO text (equal: the same program).
        level: the jaxmem level, or None.
        times: per-repeat seconds (empty: not timed yet).
        ratios: per-repeat step time / plain XLA's, paired.
        timed: ``grid`` (reused from the grid's row), ``oracle`` or None.
    """

    name: str
    peak_bytes: int
    call: Callable[[], Any]
    fingerprint: str
    level: int | None = None
    times: tuple[float, ...] = ()
    ratios: tuple[float, ...] = ()
    timed: str | None = None

    def summary(self, budget: int | None) -> dict[str, Any]:
        """JSON-ready: name, peak, fit, median time and ratio, where the times came from."""
        return {"name": self.name, "peak_bytes": self.peak_bytes,
                "fits_budget": budget is None or self.peak_bytes <= budget,
                "step_s": statistics.median(self.times) if self.times else None,
                "step_ratio": statistics.median(self.ratios) if self.ratios else None,
                "timed": self.timed}


def fingerprint(compiled: Any) -> str:
    """A short hash of an executable's HLO text."""
    return hashlib.sha1(compiled.as_text().encode()).hexdigest()[:16]


def _from_row(row: dict[str, Any] | None) -> dict[str, Any]:
    """Timings a grid row already holds (plain XLA's own row: ratios of 1)."""
    if row is None or not row.get("step_s_repeats"):
        return {}
    times = tuple(row["step_s_repeats"])
    ratios = tuple(row["step_ratio_repeats"]) or (1.0,) * len(times)
    return {"times": times, "ratios": ratios, "timed": "grid"}


def candidates(m: Methods, rows: dict[str, dict[str, Any]], b: int, s: int
               ) -> tuple[list[Candidate], float]:
    """Every candidate at ``(b, s)``, compiled, with the grid's timings where it has them.

    Returns:
        ``(candidates, seconds spent compiling the ones the grid had not)``.
    """
    t0 = time.perf_counter()
    out: list[Candidate] = []
    for method in UNIFORM:
        p = m.prepare(method, b, s)
        c, _ = m.compiled(method, b, s)
        out.append(Candidate(method, p.peak_bytes, p.call, fingerprint(c),
                             **_from_row(rows.get(method))))
    state, batch = m.w.state, m.batch(b, s)
    j = rows.get("jaxmem")
    chosen = j.get("level") if j is not None and j.get("step_s_repeats") else None
    for k in range(len(m.jaxmem.plans(state, batch).levels)):
        if k == chosen:
            plan = m.jaxmem.plan_for(state, batch)
            run, reuse = (lambda: m.jaxmem(state, batch)), _from_row(j)
        else:
            plan = m.level_plan(k, b, s)
            run, reuse = (lambda plan=plan: plan.run(state, batch)), {}
        out.append(Candidate(f"jaxmem level {k}", int(plan.peak_bytes), run,
                             fingerprint(plan.compiled), k, **reuse))
    return out, time.perf_counter() - t0


def time_fitting(cands: Sequence[Candidate], base: Callable[[], Any], budget: int | None,
                 repeats: int) -> list[Candidate]:
    """Times the fitting candidates not timed yet, each alternating with ``base`` (plain
    XLA) exactly as the grid's rows are timed, so reused and new ratios compare; one
    whose program another candidate already has reuses that one's timings."""
    fits = [budget is None or c.peak_bytes <= budget for c in cands]
    by_print = {c.fingerprint: c for c in cands if c.times}
    todo = [i for i, c in enumerate(cands)
            if fits[i] and not c.times and c.fingerprint not in by_print]
    out = list(cands)
    for i in todo:
        if cands[i].fingerprint in by_print:
            continue
        ts, xs = time_round([cands[i].call, base], repeats)  # as bench.methods.measure does
        ratios = tuple(t / x for t, x in zip(ts, xs, strict=True))
        out[i] = dataclasses.replace(cands[i], times=tuple(ts), ratios=ratios, timed="oracle")
        by_print[cands[i].fingerprint] = out[i]
    for i, c in enumerate(out):
        if fits[i] and not c.times and c.fingerprint in by_print:
            same = by_print[c.fingerprint]
            out[i] = dataclasses.replace(c, times=same.times, ratios=same.ratios,
                                         timed=f"same executable as {same.name}")
    return out


def oracle_row(m: Methods, rows: dict[str, dict[str, Any]], b: int, s: int,
               repeats: int) -> dict[str, Any]:
    """The ``oracle`` row at ``(b, s)`` (``rows``: the grid's rows there, by method)."""
    cands, compile_s = candidates(m, rows, b, s)
    budget = m.budget_bytes
    cands = time_fitting(cands, m.prepare("xla", b, s).call, budget, repeats)
    fitting = [c for c in cands if c.ratios and (budget is None or c.peak_bytes <= budget)]
    best = min(fitting, key=lambda c: statistics.median(c.ratios), default=None)
    row: dict[str, Any] = {
        "workload": m.w.name, "b": b, "s": s, "method": "oracle",
        "peak_bytes": best.peak_bytes if best else min(c.peak_bytes for c in cands),
        "predicted_peak_bytes": None,
        "step_s": statistics.median(best.times) if best else None,
        "step_ratio": statistics.median(best.ratios) if best else None,
        "step_ratio_spread": spread(best.ratios) if best else None,
        "step_s_repeats": list(best.times) if best else [],
        "step_ratio_repeats": list(best.ratios) if best else [],
        "fits_budget": best is not None, "run_s": s, "compile_s": round(compile_s, 3),
        "level": best.level if best else None, "choice": best.name if best else None,
        "candidates": [c.summary(budget) for c in cands]}
    j = rows.get("jaxmem")
    over = None
    if best is not None and j is not None and j["fits_budget"] and j.get("step_ratio_repeats"):
        mine = next(c for c in cands if c.level == j["level"])
        over = ([1.0] * len(best.ratios) if mine.fingerprint == best.fingerprint else
                [x / y for x, y in zip(j["step_ratio_repeats"], best.ratios, strict=True)])
    row["jaxmem_over_oracle_repeats"] = over or []
    row["jaxmem_over_oracle"] = spread(over) if over else None
    return row


def oracle_rows(m: Methods, rows: Sequence[dict[str, Any]], grid: Sequence[tuple[int, int]],
                repeats: int, log: Any = print) -> list[dict[str, Any]]:
    """The oracle row at every shape of ``grid``."""
    out = []
    for b, s in grid:
        t0 = time.perf_counter()
        here = {r["method"]: r for r in rows if (r["b"], r["s"]) == (b, s) and "error" not in r}
        row = oracle_row(m, here, b, s, repeats)
        out.append(row)
        over = row["jaxmem_over_oracle"]
        log(f"  (b={b:>2}, s={s:>4}) oracle: {row['choice']} of {len(row['candidates'])} "
            f"candidates; jaxmem/oracle "
            + (f"{over['median']:.3f} [{over['min']:.3f}, {over['max']:.3f}]" if over else "—")
            + f"  [{time.perf_counter() - t0:.1f}s]")
    return out


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``jaxmem_over_oracle`` per workload and shape (median, min, max over paired repeats)."""
    entries = []
    for r in rows:
        if r["method"] != "oracle":
            continue
        j = next((x for x in rows if x["method"] == "jaxmem" and x["workload"] == r["workload"]
                  and (x["b"], x["s"]) == (r["b"], r["s"])), None)
        entries.append({"workload": r["workload"], "b": r["b"], "s": r["s"],
                        "oracle_choice": r["choice"],
                        "jaxmem_level": None if j is None else j["level"],
                        "jaxmem_fits_budget": None if j is None else j["fits_budget"],
                        "ratio": r["jaxmem_over_oracle"]})
    by: dict[str, dict[str, Any]] = {}
    for e in entries:
        d = by.setdefault(e["workload"], {"shapes": 0, "jaxmem_fits": 0, "medians": []})
        d["shapes"] += 1
        d["jaxmem_fits"] += bool(e["jaxmem_fits_budget"])
        if e["ratio"]:
            d["medians"].append(e["ratio"]["median"])
    by_workload = {w: {"shapes": d["shapes"], "jaxmem_fits": d["jaxmem_fits"],
                       "best_median": min(d["medians"], default=None),
                       "worst_median": max(d["medians"], default=None)}
                   for w, d in by.items()}
    return {"jaxmem_over_oracle": entries, "by_workload": by_workload,
            "note": "ratio: jaxmem's step time over the oracle's, per paired repeat (both "
                    "as ratios to plain XLA timed alternately with them), its min / median "
                    "/ max; from one process (processes: 1)"}
