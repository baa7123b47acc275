"""The comparison's Markdown table and matplotlib figures (Agg backend, files only).

matplotlib is imported only when a figure is drawn, so the table and the JSON need no
matplotlib (the GPU machine may lack it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIB = 2**20


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MIB:.1f}"


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    """Per workload the rows as a Markdown table, then jaxmem vs the oracle, the epoch
    figure and the must-show checks."""
    budgets = result.get("budgets") or {result.get("workload", ""): result["budget_bytes"]}
    names = list(dict.fromkeys(r["workload"] for r in result["rows"])) or list(budgets)
    lines = [f"# jaxmem vs baselines — {', '.join(names)}", "",
             "Peaks are XLA's `argument + output - alias + temp` of the executable run. "
             "ratio = median over alternating runs of step time / xla's step time at the "
             "same shape, [min, max] over the paired repeats, one process (run s: the "
             "length actually run; padding methods pad up). oracle: the fastest of every "
             "jaxmem level and uniform policy that fits the budget."]
    for name in names:
        budget = budgets.get(name, result["budget_bytes"])
        lines += ["", f"## {name}", "", f"Budget: {_mib(budget)} MiB ({budget} bytes).", "",
                  "| b | s | method | run s | peak MiB | predicted MiB | step ms | ratio "
                  "[min, max] | fits | level / choice |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_table_row(r) for r in result["rows"] if r["workload"] == name]
        lines += _sections(result.get("workloads", {}).get(name)
                           or (result if result.get("workload") == name else {}))
    over = result.get("summary", {}).get("jaxmem_over_oracle", [])
    if over:
        lines += ["", "## jaxmem / oracle step time", "",
                  "| workload | b | s | oracle's choice | jaxmem level | median | min | max |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in over:
            sp = e["ratio"] or {}
            lines.append(f"| {e['workload']} | {e['b']} | {e['s']} | {e['oracle_choice']} | "
                         f"{'—' if e['jaxmem_level'] is None else e['jaxmem_level']} | "
                         + " | ".join(_fmt(sp.get(k), ".3f") for k in ("median", "min", "max"))
                         + " |")
    lines += ["", f"## Epoch (real tokens/s) — {result.get('workload', '')}", "",
              "| method | tok/s run-only | tok/s incl. compile | compile s | executables | "
              "max peak MiB | fits |", "|---|---|---|---|---|---|---|"]
    for m, d in result.get("epoch_detail", {}).get("methods", {}).items():
        lines.append(f"| {m} | {d['tokens_per_s']:.0f} | {d['tokens_per_s_incl_compile']:.0f} | "
                     f"{d['compile_s']:.1f} | {d['executables']} | {_mib(d['max_peak_bytes'])} "
                     f"| {'yes' if d['fits_budget'] else 'NO'} |")
    checks = result.get("checks", {})
    if checks:
        lines += ["", "## Must-show checks", ""]
        lines += [f"- **{k}**: {'reached' if v['ok'] else 'NOT reached'} — {v['detail']}"
                  for k, v in checks.items()]
    return "\n".join(lines) + "\n"


def _sections(sec: dict[str, Any]) -> list[str]:
    """A workload's region cross-check table and its two-process peak line, if it has them."""
    lines: list[str] = []
    reg = sec.get("regions")
    if reg:
        lines += ["", f"Regions (jaxmem's plan against another region's at this shape): "
                  f"{reg.get('detail', '')}", "",
                  "| b | s | own plan | other plan | own MiB | other MiB | other fits | "
                  "own / other time [min, max] | own beats |", "|---" * 9 + "|"]
        for e in reg["cross"]:
            sp = e["own_over_other"]
            t = "same executable" if e["same_executable"] else (
                "—" if not sp else f"{sp['median']:.3f} [{sp['min']:.3f}, {sp['max']:.3f}]")
            lines.append(f"| {e['b']} | {e['s']} | {e['own_plan']} | {e['other_plan']} | "
                         f"{_mib(e['own']['peak_bytes'])} | {_mib(e['other']['peak_bytes'])} | "
                         f"{'yes' if e['other']['fits_budget'] else 'NO'} | {t} | "
                         f"{'yes' if e['own_beats'] else 'no'} |")
    pr = sec.get("processes")
    if pr and pr.get("shapes"):
        diff = pr["max_rel_diff"]
        lines += ["", f"Peaks from {pr['processes']} processes: max relative difference "
                  f"{'—' if diff is None else f'{diff:.2e}'}, same levels {pr['same_levels']} "
                  f"over {len(pr['shapes'])} shape(s)."]
    return lines


def _table_row(r: dict[str, Any]) -> str:
    """One result row of the per-workload table."""
    step_ms = None if r["step_s"] is None else 1e3 * r["step_s"]
    sp = r.get("step_ratio_spread")
    ratio = _fmt(r.get("step_ratio"), ".3f") + (
        f" [{sp['min']:.3f}, {sp['max']:.3f}]" if sp and sp["n"] > 1 else "")
    what = r.get("choice") or ("—" if r.get("level") is None else r["level"])
    return (f"| {r['b']} | {r['s']} | {r['method']} | {r.get('run_s', r['s'])} | "
            f"{_mib(r['peak_bytes'])} | {_mib(r['predicted_peak_bytes'])} | "
            f"{_fmt(step_ms, '.1f')} | {ratio} | {'yes' if r['fits_budget'] else 'NO'} | "
            f"{what} |")


def plot_peaks(rows: Sequence[dict[str, Any]], budget: int, path: Path) -> Path:
    """Peak memory vs sequence length, one line per method (and b), with the budget."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["method"], r["b"]) for r in rows})
    for method, b in keys:
        pts = sorted((r["s"], r["peak_bytes"] / MIB) for r in rows
                     if r["method"] == method and r["b"] == b and r["peak_bytes"] is not None)
        if not pts:
            continue
        style = "-o" if method.startswith("jaxmem") else "--x"
        ax.plot(*zip(*pts, strict=True), style, label=f"{method} (b={b})")
    ax.axhline(budget / MIB, color="red", lw=2, label="budget")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("peak MiB (XLA memory_analysis)")
    return _save(fig, ax, path, legend_size=7)


def plot_predicted(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """jaxmem's predicted peak vs XLA's actual peak, per jaxmem method and shape."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    pts = [(r["peak_bytes"] / MIB, r["predicted_peak_bytes"] / MIB, r["method"]) for r in rows
           if r["predicted_peak_bytes"] is not None and r["peak_bytes"]]
    for method in sorted({m for _, _, m in pts}):
        xs = [(a, p) for a, p, m in pts if m == method]
        ax.scatter(*zip(*xs, strict=True), label=method)
    if pts:
        hi = max(max(a, p) for a, p, _ in pts) * 1.05
        ax.plot([0, hi], [0, hi], "k:", label="exact")
        ax.legend(fontsize=8)
    ax.set_xlabel("actual peak MiB (XLA)")
    ax.set_ylabel("predicted peak MiB (jaxmem)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_timelines(xla_curve: Sequence[int], jaxmem_curve: Sequence[int], label: str,
                   path: Path, budget: int | None = None) -> Path:
    """XLA's memory timeline (scheduled HLO) vs jaxmem's model, x normalised to [0, 1]."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for curve, name in ((xla_curve, "XLA buffer timeline (hlo_passes)"),
                        (jaxmem_curve, "jaxmem model (analyze.timeline_at)")):
        if curve:
            n = max(len(curve) - 1, 1)
            ax.plot([i / n for i in range(len(curve))], [c / MIB for c in curve], label=name)
    top = max([*xla_curve, *jaxmem_curve, 1])
    if budget is not None and budget <= 1.5 * top:
        ax.axhline(budget / MIB, color="red", lw=1.5, label="budget")
    ax.set_xlabel("program position (fraction of schedule)")
    ax.set_ylabel("live MiB")
    ax.set_title(label)
    return _save(fig, ax, path, legend_size=8)


def _save(fig: Any, ax: Any, path: Path, legend_size: int) -> Path:
    """Legend, grid, tight layout, write the PNG and free the figure."""
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path
