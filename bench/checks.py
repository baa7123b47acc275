"""Coverage of symbolic decisions and the comparison's must-show checks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

import jaxmem
from bench.methods import Methods
from bench.regions import verdict
from bench.workload import Workload


def _counts(pairs: Any) -> dict[str, int]:
    counts = {"symbolic": 0, "fallback": 0}
    counts.update(dict(pairs))
    return counts


def plan_set_comparisons(step: jaxmem.Jitted, *args: Any) -> dict[str, int]:
    """How the comparisons behind ``step``'s plan set for ``args`` were decided."""
    return _counts(step.plans(*args).comparisons)


def coverage(w: Workload, m: Methods, rows: Sequence[dict[str, Any]], max_b: int,
             max_s: int, run_analyze: bool = True) -> tuple[dict[str, Any], Any]:
    """Symbolic vs fallback decisions of ``jaxmem.analyze`` and the plan sets, and where
    the fallback-only ablation planned differently from symbolic jaxmem.

    Returns:
        ``(coverage, report)``: the JSON-ready counts and the symbolic
        :class:`jaxmem.Report` (None when ``run_analyze`` is False).
    """
    b, s = jax.export.symbolic_shape("b, s", constraints=(f"b <= {max_b}", f"s <= {max_s}",
                                                          *w.constraints))
    specs = {k: jax.ShapeDtypeStruct((b, s), v.dtype) for k, v in w.batch(1, 1).items()}
    out: dict[str, Any] = {"workload": w.name}
    reports = {}
    for name, symbolic in (("analyze", True), ("analyze_fallback_only", False))[
            : 2 if run_analyze else 0]:
        t0 = time.perf_counter()
        reports[name] = jaxmem.analyze(w.train_step, w.state, specs, symbolic=symbolic)
        out[name] = {"comparisons": reports[name].comparisons,
                     "seconds": round(time.perf_counter() - t0, 2)}
    args, ran = (w.state, w.batch(1, 1)), {r["method"] for r in rows}
    out["plan_set"] = {name: plan_set_comparisons(step, *args) if name in ran else None
                       for name, step in (("jaxmem", m.jaxmem),
                                          ("jaxmem-fallback-only", m.fallback))}
    out["ablation_shapes"] = _ablation_shapes(rows)
    return out, reports.get("analyze")


def _ablation_shapes(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["b"], r["s"], r["method"]): r for r in rows}
    diffs = []
    for (b, s, method), sym in sorted(by.items()):
        fb = by.get((b, s, "jaxmem-fallback-only"))
        if method != "jaxmem" or fb is None:
            continue
        entry = {"b": b, "s": s, "symbolic_level": sym["level"], "fallback_level": fb["level"],
                 "symbolic_peak_bytes": sym["peak_bytes"], "fallback_peak_bytes": fb["peak_bytes"],
                 "fallback_fits_budget": fb["fits_budget"],
                 "differs": sym["level"] != fb["level"]
                 or (sym["fits_budget"] and not fb["fits_budget"])}
        diffs.append(entry)
    return diffs


def _row(rows: Sequence[dict[str, Any]], b: int, s: int, method: str) -> dict[str, Any] | None:
    return next((r for r in rows if (r["b"], r["s"], r["method"]) == (b, s, method)), None)


#: the 2-D domain's must-show line (issue #14), present where a workload ran the
#: region cross-check: "2-D domain: >= 2 regions whose plans differ and each beats the
#: other's at its shapes"
REGIONS_CHECK = "2d_domain_2_regions_each_beats_the_others_plan"
#: checks reached where any workload reaches them (the others: where all do)
ANY_WORKLOAD = ("xla_over_jaxmem_fits", "ablation_contribution")


def must_show(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets of issues 5 and 12, each ``{"ok": bool, "detail": str}`` (never asserted).

    Per workload of ``result["rows"]``, then combined: ``ok`` where every workload
    reaches it (any, for :data:`ANY_WORKLOAD`), ``detail`` per workload.
    """
    names = list(dict.fromkeys(r["workload"] for r in result["rows"]))
    per = {w: _checks_one([r for r in result["rows"] if r["workload"] == w],
                          _coverage_of(result, w)) for w in names}
    checks: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(k for c in per.values() for k in c):
        got = {w: c[key] for w, c in per.items() if key in c}
        ok = (any if key in ANY_WORKLOAD else all)(v["ok"] for v in got.values())
        detail = (next(iter(got.values()))["detail"] if len(got) == 1 else
                  "; ".join(f"{w}: {v['detail']}" for w, v in got.items()))
        checks[key] = {"ok": bool(ok), "detail": detail}
    regions = {w: sec for w in names if (sec := _section_of(result, w, "regions"))}
    if regions:  # recomputed from the cross entries' numbers, never the stored verdict
        got = {w: verdict(sec) for w, sec in regions.items()}
        checks[REGIONS_CHECK] = {"ok": any(v["ok"] for v in got.values()),
                                 "detail": "; ".join(f"{w}: {v['detail']}"
                                                     for w, v in got.items())}
    ep = result.get("epoch", {})
    det = result.get("epoch_detail", {}).get("methods", {})
    if {"jaxmem", "pad-max", "buckets"} <= set(ep):
        incl = {k: v["tokens_per_s_incl_compile"] for k, v in det.items()}
        checks["epoch_jaxmem_above_pad_max_and_buckets"] = {
            "ok": ep["jaxmem"] > max(ep["pad-max"], ep["buckets"]),
            "detail": f"{result.get('workload')}: run-only tok/s "
                      + ", ".join(f"{k} {v:.0f}" for k, v in ep.items())
                      + "; incl. compile " + ", ".join(f"{k} {v:.0f}" for k, v in incl.items())}
    return checks


def _coverage_of(result: dict[str, Any], workload: str) -> dict[str, Any]:
    """One workload's coverage section (a single-workload result holds it at the top)."""
    return _section_of(result, workload, "coverage")


def _section_of(result: dict[str, Any], workload: str, key: str) -> dict[str, Any]:
    """One workload's ``key`` section (a single-workload result holds it at the top)."""
    own = result.get("workloads", {}).get(workload, {}).get(key)
    if own is not None:
        return own
    return result.get(key, {}) if result.get("workload") in (workload, None) else {}


def _spread_text(sp: dict[str, Any] | None) -> str:
    return "" if not sp else f" [{sp['min']:.3f}, {sp['max']:.3f}]"


def _checks_one(rows: Sequence[dict[str, Any]], cov: dict[str, Any]
                ) -> dict[str, dict[str, Any]]:
    """The per-workload checks over one workload's rows and coverage."""
    shapes = sorted({(r["b"], r["s"]) for r in rows})
    checks: dict[str, dict[str, Any]] = {}

    ratios = []
    for b, s in shapes:
        j, st = _row(rows, b, s, "jaxmem"), _row(rows, b, s, "jaxmem-static")
        if j and st and j["peak_bytes"] and st["peak_bytes"]:  # infeasible: min_peak_bytes
            ratios.append((b, s, j["peak_bytes"] / st["peak_bytes"]))
    checks["jaxmem_peak_le_1.02x_static"] = {
        "ok": bool(ratios) and all(r <= 1.02 for *_, r in ratios),
        "detail": ", ".join(f"({b},{s}): {r:.3f}" for b, s, r in ratios) or "no data"}

    jm = [r for r in rows if r["method"] == "jaxmem"]
    checks["jaxmem_fits_budget_everywhere"] = {
        "ok": bool(jm) and all(r["fits_budget"] for r in jm),
        "detail": ", ".join(f"({r['b']},{r['s']}): {(r['peak_bytes'] or 0) / 2**20:.1f} MiB "
                            f"{'fits' if r['fits_budget'] else r.get('error', 'OVER')}"
                            for r in jm)}

    wins = [(b, s) for b, s in shapes
            if (x := _row(rows, b, s, "xla")) and (j := _row(rows, b, s, "jaxmem"))
            and not x["fits_budget"] and j["fits_budget"]]
    checks["xla_over_jaxmem_fits"] = {"ok": bool(wins),
                                      "detail": f"shapes {wins}" if wins else "none"}

    both = [(b, s, j["step_ratio"], j.get("step_ratio_spread")) for b, s in shapes
            if (x := _row(rows, b, s, "xla")) and (j := _row(rows, b, s, "jaxmem"))
            and x["fits_budget"] and j["fits_budget"] and j["step_ratio"] is not None]
    checks["jaxmem_within_5pct_of_xla_where_both_fit"] = {
        "ok": bool(both) and all(r <= 1.05 for _, _, r, _ in both),
        "detail": ", ".join(f"({b},{s}): {r:.3f}{_spread_text(sp)}" for b, s, r, sp in both)
                  or "no shape where both fit"}

    over = [(r["b"], r["s"], r["jaxmem_over_oracle"]) for r in rows
            if r["method"] == "oracle" and r.get("jaxmem_over_oracle")]
    if any(r["method"] == "oracle" for r in rows):
        checks["jaxmem_within_5pct_of_oracle"] = {
            "ok": bool(over) and all(sp["median"] <= 1.05 for *_, sp in over),
            "detail": ", ".join(f"({b},{s}): {sp['median']:.3f}{_spread_text(sp)}"
                                for b, s, sp in over) or "no shape where jaxmem fits"}

    abl = cov.get("ablation_shapes", [])
    checks["ablation_contribution"] = {
        "ok": any(a["differs"] for a in abl),
        "detail": f"analyze comparisons symbolic/fallback: "
                  f"{cov.get('analyze', {}).get('comparisons')} vs fallback-only "
                  f"{cov.get('analyze_fallback_only', {}).get('comparisons')}; plan sets "
                  f"{cov.get('plan_set')}; shapes where the ablation planned differently or "
                  f"exceeded the budget: {[(a['b'], a['s']) for a in abl if a['differs']]}"}
    return checks
