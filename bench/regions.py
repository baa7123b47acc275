"""The region cross-check: where jaxmem's chosen plans differ over a shape domain, does each
region's own plan beat the other region's plan at the region's shapes, by XLA's figure?

A *region* is the set of grid shapes at which jaxmem chose the same plan (its level and
microbatch count; the row's ``recompute`` says what that level re-runs). At every shape
of every region, each other region's plan is compiled at this shape
(:meth:`bench.methods.Methods.level_plan`, the oracle's cached compile) and judged
against jaxmem's own: its XLA peak, whether it fits the budget, and, where it fits, its
step time timed alternately with jaxmem's (:func:`bench.methods.time_round`), the
per-round ratio own / other with its min / median / max. The own plan *beats* the
other's there when the other does not fit, or fits and is slower by the paired median
(an identical executable beats nothing). Two regions *each beat the other* when the own
plan beats the other's at every shape of both.

Example:
    >>> rows = [{"method": "jaxmem", "b": 64, "s": 16, "level": 2, "fits_budget": True},
    ...         {"method": "jaxmem", "b": 4, "s": 256, "level": 6, "fits_budget": True}]
    >>> [(g["name"], g["shapes"]) for g in plan_groups(rows)]
    [('level 2', [[64, 16]]), ('level 6', [[4, 256]])]
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.methods import Methods, spread, time_round
from bench.oracle import fingerprint


def _name(level: int, microbatches: int) -> str:
    return f"level {level}" + (f" x{microbatches} microbatches" if microbatches > 1 else "")


def plan_groups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The grid shapes grouped by jaxmem's chosen plan, in level order (shapes where no
    plan fits belong to no region)."""
    by: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        if r["method"] != "jaxmem" or not r["fits_budget"] or r.get("level") is None:
            continue
        key = (r["level"], r.get("microbatches") or 1)
        g = by.setdefault(key, {"name": _name(*key), "level": key[0], "microbatches": key[1],
                                "recompute": list(r.get("recompute") or []), "shapes": []})
        g["shapes"].append([r["b"], r["s"]])
    return [by[k] for k in sorted(by)]


def beats(entry: dict[str, Any]) -> bool:
    """Whether the own plan beats the other's in one cross entry, from its numbers."""
    if not entry["other"]["fits_budget"]:
        return True
    ratio = entry.get("own_over_other")
    return not entry["same_executable"] and ratio is not None and ratio["median"] < 1.0


def cross_entry(m: Methods, b: int, s: int, own: dict[str, Any], other: dict[str, Any],
                repeats: int) -> dict[str, Any]:
    """At ``(b, s)`` (a shape of region ``own``): region ``other``'s plan against jaxmem's."""
    state, batch = m.w.state, m.batch(b, s)
    mine = m.prepare("jaxmem", b, s)
    plan = m.level_plan(other["level"], b, s, other["microbatches"])
    own_print = fingerprint(m.jaxmem.plan_for(state, batch).compiled)
    budget = m.budget_bytes
    fits = budget is None or plan.peak_bytes <= budget
    entry: dict[str, Any] = {
        "b": b, "s": s, "own_plan": own["name"], "other_plan": other["name"],
        "own": {"peak_bytes": mine.peak_bytes, "fits_budget": True, "step_s": None},
        "other": {"peak_bytes": int(plan.peak_bytes), "fits_budget": bool(fits), "step_s": None},
        "same_executable": fingerprint(plan.compiled) == own_print, "own_over_other": None,
        "own_over_other_repeats": []}
    if fits and not entry["same_executable"] and mine.call is not None:
        a, o = time_round([mine.call, lambda: plan.run(state, batch)], repeats)
        ratios = [x / y for x, y in zip(a, o, strict=True)]
        entry["own"]["step_s"] = statistics.median(a)
        entry["other"]["step_s"] = statistics.median(o)
        entry["own_over_other"], entry["own_over_other_repeats"] = spread(ratios), ratios
    entry["own_beats"] = beats(entry)
    return entry


def pair_verdicts(groups: Sequence[dict[str, Any]], cross: Sequence[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """Per pair of regions: per pair of their shapes, whether each own plan beats the other
    region's there, and whether that holds at every shape of both (``each_beats``)."""
    at = {(e["own_plan"], e["other_plan"], e["b"], e["s"]): beats(e) for e in cross}
    out = []
    for ga, gb in itertools.combinations(groups, 2):
        a = {tuple(x): at.get((ga["name"], gb["name"], *x)) for x in ga["shapes"]}
        b = {tuple(y): at.get((gb["name"], ga["name"], *y)) for y in gb["shapes"]}
        pairs = [{"shapes": [list(x), list(y)], "first_beats": a[x], "second_beats": b[y]}
                 for x in a for y in b]
        out.append({"regions": [ga["name"], gb["name"]], "pairs": pairs,
                    "first_beats_at": sum(bool(v) for v in a.values()),
                    "second_beats_at": sum(bool(v) for v in b.values()),
                    "each_beats": all(v is True for v in (*a.values(), *b.values()))})
    return out


def verdict(section: dict[str, Any]) -> dict[str, Any]:
    """The must-show line from a region section's numbers (its ``cross`` entries, never its
    stored verdict): at least two regions whose plans differ and each beats the other's
    at its shapes."""
    groups = section.get("groups", [])
    size = {g["name"]: len(g["shapes"]) for g in groups}
    pairs = pair_verdicts(groups, section.get("cross", []))
    where = ", ".join(f"{g['name']} at {[tuple(x) for x in g['shapes']]}" for g in groups)
    said = "; ".join(f"{a} beats {b} at {p['first_beats_at']}/{size[a]} of its shapes, "
                     f"{b} beats {a} at {p['second_beats_at']}/{size[b]}"
                     for p in pairs for a, b in [p["regions"]])
    return {"ok": any(p["each_beats"] for p in pairs),
            "detail": f"{len(groups)} region(s): {where or 'none'}; "
                      f"{said or 'no pair of regions'}"}


def region_check(m: Methods, rows: Sequence[dict[str, Any]], repeats: int,
                 log: Any = print) -> dict[str, Any]:
    """The cross-check over one workload's grid rows (JSON-ready): ``groups`` (regions),
    ``cross`` (one entry per shape and other region), ``pairs`` and the verdict."""
    t0 = time.perf_counter()
    groups = plan_groups([r for r in rows if r["workload"] == m.w.name])
    cross = []
    for own, other in itertools.permutations(groups, 2):
        for b, s in own["shapes"]:
            e = cross_entry(m, b, s, own, other, repeats)
            cross.append(e)
            sp = e["own_over_other"]
            log(f"  (b={b:>2}, s={s:>4}) own {own['name']} {e['own']['peak_bytes'] / 2**20:.1f}"
                f" MiB vs {other['name']} {e['other']['peak_bytes'] / 2**20:.1f} MiB "
                f"fits={e['other']['fits_budget']}; own/other time "
                + (f"{sp['median']:.3f} [{sp['min']:.3f}, {sp['max']:.3f}]" if sp else "—")
                + f"{' (same executable)' if e['same_executable'] else ''}; "
                f"own beats: {e['own_beats']}")
    section = {"groups": groups, "cross": cross, "pairs": pair_verdicts(groups, cross),
               "budget_bytes": m.budget_bytes, "seconds": round(time.perf_counter() - t0, 1)}
    section.update(verdict(section))
    log(f"regions: {section['detail']} -> each beats the other: {section['ok']}")
    return section
