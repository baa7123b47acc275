"""jaxmem vs XLA's default scheduler, uniform remat, static planning and padding.

Usage::

    python -m bench.compare [--quick] [--model tiny|small|1b] [--budget 512MiB] \
        --out results.json [--results-dir DIR]

Workloads (``--workloads``, :mod:`bench.suite`): the project's Llama train step
(:mod:`bench.workload`), a plain-JAX decoder with a Python loop over layers and no
named scopes, and its ``lax.scan`` twin (:mod:`bench.decoders`). Shapes: per workload a
grid of ``(b, s)`` whose lengths are quantiles of the per-batch longest length that the
training loop's length-grouped batcher produces on the built-in data. Budget, per
workload: ``--budget`` (the Llama only), else ``--budget-fraction`` of plain XLA's peak
at its largest shape (printed). Every method is measured at every shape
(:mod:`bench.methods`), then the oracle (:mod:`bench.oracle`: every jaxmem level and
uniform policy compiled, the fastest that fits); then the epoch figure
(:mod:`bench.compare_epoch`), symbolic-vs-fallback coverage, the must-show checks, a
Markdown table (``compare.md``) and figures under ``--results-dir`` (default: the
directory of ``--out``; :mod:`bench.outputs`). Every time ratio comes with its min /
median / max over the paired repeats, all in one process.

Writes docs/design.md §2's JSON to ``--out``: ``{"budget_bytes", "rows", "epoch",
"budgets", "workloads", "summary", ...}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench.checks import coverage, must_show
from bench.compare_epoch import EPOCH_METHODS, epoch_batches, epoch_figure
from bench.decoders import program_workload
from bench.figures import markdown, plot_peaks, plot_predicted
from bench.methods import METHODS, Methods, measure
from bench.oracle import oracle_rows, summary
from bench.outputs import add_output_arguments, results_dir
from bench.processes import second_process_peaks
from bench.regions import region_check
from bench.suite import WORKLOADS, merge, program_grid
from bench.timeline import timeline_figure
from bench.tokens import token_setup
from bench.workload import Workload, build_workload
from train.config import parse_bytes

MIB = 2**20


def shape_grid(lengths: np.ndarray, batch_sizes: Sequence[int], quantiles: Sequence[float],
               seed: int = 0) -> list[tuple[int, int]]:
    """``(b, s)`` with ``s`` at quantiles of the batcher's per-batch longest length.

    Example:
        >>> shape_grid(np.arange(1, 101), [4], [0.5, 1.0])
        [(4, 52), (4, 100)]
    """
    grid: set[tuple[int, int]] = set()
    for b in batch_sizes:
        maxima = np.asarray([lengths[i].max() for i in epoch_batches(lengths, b, None, seed)])
        for q in quantiles:
            grid.add((b, int(np.quantile(maxima, q, method="higher"))))
    return sorted(grid, key=lambda bs: (bs[1], bs[0]))


def choose_budget(methods: Methods, shapes: Sequence[tuple[int, int]], fraction: float,
                  log: Any) -> int:
    """``fraction`` of plain XLA's smallest peak over ``shapes`` (usually just the largest
    shape), rounded down to a MiB (KiB for peaks under 64 MiB)."""
    p = min((methods.prepare("xla", b, s) for b, s in shapes), key=lambda p: p.peak_bytes)
    unit = MIB if p.peak_bytes >= 64 * MIB else 1024
    budget = max(unit, int(fraction * p.peak_bytes) // unit * unit)
    log(f"budget: {fraction:.2f} x xla peak at (b={p.b}, s={p.s}) = {p.peak_bytes / MIB:.1f} "
        f"MiB{' (the least of ' + str(list(shapes)) + ')' if len(shapes) > 1 else ''} "
        f"-> {budget / MIB:.1f} MiB ({budget} bytes)")
    return budget


def run_grid(methods: Methods, grid: Sequence[tuple[int, int]], which: Sequence[str],
             repeats: int, log: Any, save: Any = None) -> list[dict[str, Any]]:
    """Every method at every shape; ``xla`` first at each shape (the ratio's baseline)."""
    rows: list[dict[str, Any]] = []
    order = ["xla"] + [m for m in which if m != "xla"]
    for b, s in grid:
        xla_s: float | None = None
        xla_call = None
        for method in order:
            t0 = time.perf_counter()
            try:
                row, prepared = measure(methods, method, b, s, repeats, xla_s, xla_call)
            except Exception as e:  # one broken method must not lose the others' rows
                if method == "xla":
                    raise
                rows.append(_error_row(methods, method, b, s, e))
                log(f"  (b={b:>2}, s={s:>4}) {method:<21} FAILED: {type(e).__name__}: {e}")
                continue
            if method == "xla":
                xla_s, xla_call = row["step_s"], prepared.call
                row["step_ratio"] = 1.0
                if "xla" not in which:
                    continue
            rows.append(row)
            step = "—" if row["step_s"] is None else f"{1e3 * row['step_s']:.1f} ms"
            log(f"  (b={b:>2}, s={s:>4}) {method:<21} peak {row['peak_bytes'] / MIB:8.1f} MiB"
                f"  step {step:>10}  fits={row['fits_budget']!s:<5} level={row['level']}"
                f"  [{time.perf_counter() - t0:.1f}s]")
        if save is not None:
            save(rows)
    return rows


def _error_row(methods: Methods, method: str, b: int, s: int, e: Exception) -> dict[str, Any]:
    """A row for a method that raised (not a budget verdict: ``error`` says what broke)."""
    return {"workload": methods.w.name, "b": b, "s": s, "method": method, "peak_bytes": None,
            "predicted_peak_bytes": None, "step_s": None, "step_ratio": None,
            "fits_budget": False, "run_s": s, "compile_s": None, "level": None,
            "error": f"{type(e).__name__}: {e}"[:500]}


def run_comparison(workload: Workload, grid: Sequence[tuple[int, int]], *,
                   budget_bytes: int | None = None, budget_fraction: float = 0.95,
                   methods: Sequence[str] = METHODS, repeats: int = 3,
                   epoch_batches_n: int | None = 8, epoch_b: int | None = None,
                   results_dir: Path | None = None, timeline: bool = True,
                   analyze_coverage: bool = True, fresh_epoch: bool = True,
                   oracle: bool = True, budget_shapes: Sequence[tuple[int, int]] | None = None,
                   regions: bool = False, second_process: bool = False,
                   log: Any = print, save: Any = None) -> dict[str, Any]:
    """The whole comparison as a JSON-ready dict (figures and ``compare.md`` written to
    ``results_dir``; None: no files written).

    ``oracle``: add an ``oracle`` row per shape (:mod:`bench.oracle`: every jaxmem level
    and uniform policy compiled, the fastest that fits timed) and ``summary``.
    ``budget_shapes``: the budget is ``budget_fraction`` of plain XLA's least peak over
    them (None: the last grid shape). ``regions``: the region cross-check
    (:mod:`bench.regions`) under ``regions``. ``second_process``: jaxmem's executables
    recompiled in a fresh process, both peaks under ``processes`` (:mod:`bench.processes`).

    ``fresh_epoch=False`` lets the epoch reuse the grid's executables (tests only: its
    compile seconds then undercount). ``save(result)`` is called after each stage with
    the partial result, so a run cut short still leaves its measurements.
    """
    save = save or (lambda r: None)
    t_start = time.perf_counter()
    max_b = max(b for b, _ in grid)
    max_s = workload.max_len
    budget_methods = Methods(workload, None, max_b, max_s)
    if budget_bytes is None:
        budget_bytes = choose_budget(budget_methods, budget_shapes or grid[-1:],
                                     budget_fraction, log)
    m = Methods(workload, budget_bytes, max_b, max_s)
    m.share_compiled(budget_methods)  # plain executables do not depend on the budget
    log(f"grid: {list(grid)}; methods: {list(methods)}; repeats {repeats}")
    result: dict[str, Any] = {"budget_bytes": budget_bytes, "rows": [], "epoch": {},
                              "workload": workload.name,
                              "config": _config(workload, grid, repeats, budget_fraction)}
    rows = run_grid(m, grid, methods, repeats, log, lambda r: save({**result, "rows": r}))
    if oracle:
        log("oracle: every jaxmem level and uniform policy, the fastest that fits")
        rows += oracle_rows(m, rows, grid, repeats, log)
    result["rows"] = rows
    result["summary"] = summary(rows)
    if regions:
        log("regions: each region's plan against the other regions' at its shapes")
        result["regions"] = region_check(m, rows, repeats, log)
    save(result)
    if epoch_batches_n != 0:
        eb = epoch_b or max_b
        batches = epoch_batches(workload.lengths, eb, epoch_batches_n)
        log(f"epoch: {len(batches)} batches of b={eb} "
            f"(of {len(workload.lengths) // eb} in a full pass)")
        fresh = Methods(workload, budget_bytes, max(max_b, eb), max_s) if fresh_epoch else m
        if fresh_epoch and max(max_b, eb) == max_b:
            fresh.share_analysis(m)  # its one-time cost is still counted in compile_s
        which = tuple(x for x in EPOCH_METHODS if x in methods)
        epoch, detail = epoch_figure(fresh, batches, which, log)
        result["epoch"] = epoch
        result["epoch_detail"] = {"batches": len(batches), "batch_size": eb,
                                  "full_pass_batches": len(workload.lengths) // eb,
                                  "note": "compile_s: XLA compiles from empty caches, plus for "
                                          "jaxmem its one-time symbolic analysis (analysis_s) "
                                          "and per-shape planning; tokens are real (non-pad)",
                                  "methods": detail}
        save(result)
    t0 = time.perf_counter()
    result["coverage"], report = coverage(workload, m, rows, max_b, max_s, analyze_coverage)
    log(f"coverage: {result['coverage'].get('analyze')}, plan sets "
        f"{result['coverage']['plan_set']} [{time.perf_counter() - t0:.1f}s]")
    if second_process:
        result["processes"] = second_process_peaks(workload, m, rows, log)
    result["checks"] = must_show(result)
    if jax.default_backend() == "gpu":
        stats = jax.devices()[0].memory_stats() or {}
        result["config"]["device_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    save(result)
    if results_dir is not None:
        result["figures"] = _write_figures(result, workload, m, grid, results_dir,
                                           timeline, log, report)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def _config(w: Workload, grid: Sequence[tuple[int, int]], repeats: int,
            fraction: float) -> dict[str, Any]:
    c = w.config
    model = c if isinstance(c, dict) else {
        "d_model": c.d_model, "n_layers": c.n_layers, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "d_ff": c.d_ff, "vocab": c.vocab_size, "dtype": c.dtype,
        "param_dtype": c.param_dtype}
    return {"model": model, "processes": 1,
            "grid": [list(x) for x in grid], "repeats": repeats, "budget_fraction": fraction,
            "examples": len(w.lengths), "max_len": w.max_len,
            "length_percentiles": {f"p{q}": int(np.percentile(w.lengths, q))
                                   for q in (10, 50, 90, 100)},
            "backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "device": str(jax.devices()[0])}


def _write_figures(result: dict[str, Any], w: Workload, m: Methods,
                   grid: Sequence[tuple[int, int]], out: Path, timeline: bool,
                   log: Any, report: Any = None) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    tag = w.name
    figs: dict[str, str] = {}
    try:
        figs["peaks"] = str(plot_peaks(result["rows"], result["budget_bytes"],
                                       out / f"peaks_{tag}.png"))
        figs["predicted"] = str(plot_predicted(result["rows"], out / f"predicted_{tag}.png"))
    except ImportError as e:
        log(f"figures skipped (no matplotlib): {e}")
        timeline = False
    if timeline:
        try:
            path = timeline_figure(w, m, *grid[-1], out / f"timeline_{tag}.png", report)
            if path is not None:
                figs["timeline"] = str(path)
        except Exception as e:  # the figure is optional; never lose the results over it
            log(f"timeline figure skipped: {type(e).__name__}: {e}")
    md = out / "compare.md"
    md.write_text(markdown(result))
    figs["markdown"] = str(md)
    return figs


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small grid, 2 repeats, data subset")
    p.add_argument("--model", default="tiny", choices=("tiny", "small", "1b", "7b"))
    p.add_argument("--budget", default=None, help="e.g. 512MiB; default: a fraction of xla's "
                   "peak at the largest shape")
    p.add_argument("--budget-fraction", type=float, default=0.95)
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes of the grid")
    p.add_argument("--quantiles", type=float, nargs="+", default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--epoch-batches", type=int, default=None, help="0: no epoch; -1: full pass")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--no-timeline", action="store_true")
    p.add_argument("--no-analyze", action="store_true",
                   help="skip the jaxmem.analyze coverage counts (plan-set counts are kept)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's n_layers")
    p.add_argument("--no-oracle", action="store_true",
                   help="skip the oracle rows (every jaxmem level compiled per shape)")
    p.add_argument("--no-second-process", action="store_true",
                   help="skip recompiling jaxmem's executables in a fresh process")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   help="the Llama's grid follows --batch/--quantiles/--max-len; the "
                        "decoders' grids are bench.suite.program_grid's")
    add_output_arguments(p, "results.json", required=True)
    a = p.parse_args(argv)
    side = results_dir(a)
    warnings.filterwarnings("ignore", message=".*unknown primitive.*")
    t0 = time.perf_counter()
    quick = a.quick
    epoch_n = a.epoch_batches if a.epoch_batches is not None else (3 if quick else -1)
    runs = (lambda name=name: _setup(name, a, quick, epoch_n) for name in a.workloads)
    result = run_workloads(
        runs, side, log=lambda *x: print(*x, flush=True),
        save=lambda r: _save(a.out, r, quick, partial=True, md=side),
        budget_fraction=a.budget_fraction, methods=tuple(a.methods), oracle=not a.no_oracle,
        second_process=not a.no_second_process)
    _save(a.out, result, quick)
    print(markdown(result))
    print(f"wrote {a.out} [{time.perf_counter() - t0:.1f}s total]")
    return 0


def run_workloads(runs: Iterable[Callable[[], tuple[Workload, Sequence[tuple[int, int]],
                                                    dict[str, Any]]]],
                  results_dir: Path | None = None, log: Any = print, save: Any = None,
                  **common: Any) -> dict[str, Any]:
    """:func:`run_comparison` per workload, merged (:func:`bench.suite.merge`).

    Args:
        runs: each builds ``(workload, grid, run_comparison options)`` when called (so a
            workload's data and state exist only while it runs).
        results_dir: where figures and the merged ``compare.md`` go (None: nowhere).
        log, save: as for :func:`run_comparison`; ``save`` gets the merged result so far.
        **common: options for every workload (``budget_fraction``, ``methods``...); a
            workload's own options override them.
    """
    save = save or (lambda r: None)
    done: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for build in runs:
        w, grid, kw = build()
        log(f"workload {w.name}: {len(w.lengths)} examples, lengths p50 "
            f"{int(np.median(w.lengths))}, max {int(w.lengths.max())}; grid {list(grid)} "
            f"[{time.perf_counter() - t0:.1f}s]")
        done.append(run_comparison(w, grid, results_dir=results_dir, log=log,
                                   save=lambda r: save(merge([*done, r])), **{**common, **kw}))
    result = merge(done)
    if results_dir is not None:
        result["figures"] = {**result.get("figures", {}),
                             "markdown": str(results_dir / "compare.md")}
        (results_dir / "compare.md").write_text(markdown(result))
    return result


def _setup(name: str, a: argparse.Namespace, quick: bool, epoch_n: int
           ) -> tuple[Workload, list[tuple[int, int]], dict[str, Any]]:
    """Workload ``name``, its grid and its ``run_comparison`` options from the CLI."""
    epoch = None if epoch_n < 0 else epoch_n
    if name == "gpt-tokens":
        return token_setup(quick, tuple(a.methods), a.repeats, not a.no_analyze)
    if name == "llama":
        overrides = {"n_layers": a.layers} if a.layers else {}
        w = build_workload(a.model, max_len=a.max_len, max_records=2000 if quick else None,
                           **overrides)
        if a.layers:
            w.name = f"{w.name}-L{a.layers}"
        batch = a.batch or ([8] if quick else [4, 8])
        quantiles = a.quantiles or ([0.5, 0.9, 1.0] if quick else [0.25, 0.5, 0.75, 0.9, 1.0])
        return w, shape_grid(w.lengths, batch, quantiles), {
            "budget_bytes": parse_bytes(a.budget) if a.budget else None,
            "repeats": a.repeats or (2 if quick else 5), "epoch_batches_n": epoch,
            "timeline": not a.no_timeline, "analyze_coverage": not a.no_analyze}
    g = program_grid(quick)
    w = program_workload(name, g.layers, g.d, g.max_len, 2000 if quick else None)
    return w, shape_grid(w.lengths, g.batch, g.quantiles), {
        "repeats": a.repeats or g.repeats, "epoch_batches_n": 0 if quick else epoch,
        "timeline": False, "analyze_coverage": not (quick or a.no_analyze)}


def _save(path: str, result: dict[str, Any], quick: bool, partial: bool = False,
          md: Path | None = None) -> None:
    """Writes ``result`` as JSON (``"partial": true`` until the run completes), and the
    Markdown table so far to ``md/compare.md`` when ``md`` is given."""
    out = {**result, "partial": partial}
    out["config"] = {**out.get("config", {}), "quick": quick}
    Path(path).write_text(json.dumps(out, indent=1, default=_json_default))
    if md is not None:
        md.mkdir(parents=True, exist_ok=True)
        (md / "compare.md").write_text(markdown(out) + "\n(partial run)\n")


def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
