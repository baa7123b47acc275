"""The end-to-end epoch: real tokens per second of wall time, compiles and analysis counted.

Every method is a fresh ``python -m train.finetune`` process on the same tiny
Llama, data, budget and number of optimizer steps, with its own persistent
compilation cache under ``--cache-dir`` (``DIR/<method>``):

* ``jaxmem``: ``jaxmem.jit``, which picks the shapes to compile and pads the rest
  (``--compile-plan cost``);
* ``xla-exact``: plain ``jax.jit``, one executable per batch shape, compiled ahead on
  two threads;
* ``pad-max``: every batch padded to the longest sequence of the data;
* ``buckets``: lengths rounded up to a power of two (the last bucket ``--max-len``);
* ``pad-64``: lengths rounded up to a multiple of 64;
* ``packing``: several examples per row of ``--max-len`` positions (segment ids);
* ``jaxmem-packing``: ``jaxmem.jit`` on the same packed rows (one shape, so no
  compile plan: jaxmem's part is the level that fits the budget instead of full remat).

A baseline whose plain step does not fit the budget at its largest shape runs with
per-layer full remat (``--remat``), as its user would. The cache is "cold" when DIR
was empty at the start and "warm" otherwise (run the command twice on one DIR).

Usage::

    python -m bench.epoch [--quick] [--steps N] --cache-dir DIR --out epoch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METHOD_FLAGS: dict[str, tuple[str, ...]] = {
    "jaxmem": ("--scheduler", "jaxmem"),
    "xla-exact": ("--scheduler", "xla"),
    "pad-max": ("--scheduler", "xla", "--pad-multiple", "{longest}"),
    "buckets": ("--scheduler", "xla", "--pad-buckets"),
    "pad-64": ("--scheduler", "xla", "--pad-multiple", "64"),
    "packing": ("--scheduler", "xla", "--packing"),
    "jaxmem-packing": ("--scheduler", "jaxmem", "--packing"),
}
BASELINES = tuple(m for m in METHOD_FLAGS if not m.startswith("jaxmem"))


def plain_peak_bytes(setup: Any, batch_size: int, length: int, packed: bool) -> int:
    """XLA's peak of the plain step (``jax.jit``, no remat) at ``(batch_size, length)``."""
    from jaxmem import xla_peak_bytes
    from train.runner import XlaRunner, batch_spec
    from train.step import make_train_step

    runner = XlaRunner(make_train_step(setup.graphdef, setup.tx), setup.state_spec,
                       packed=packed)
    spec = batch_spec((batch_size, length), None, packed)
    return xla_peak_bytes(runner.jitted.lower(runner.state_spec, spec).compile())


def run_method(method: str, steps: int, budget: str, cache_dir: Path, longest: int,
               remat: bool, log: Any = print) -> dict[str, Any]:
    """One fine-tune process for ``method``; its summary, reduced to the epoch figures."""
    flags = [f.format(longest=longest) for f in METHOD_FLAGS[method]]
    out = cache_dir / f"{method}-summary.json"
    cmd = [sys.executable, "-m", "train.finetune", "--model", "tiny", "--steps", str(steps),
           "--budget", budget, "--no-progress", "--cache-dir", str(cache_dir / method),
           "--out", str(out), *flags, *(["--remat"] if remat else [])]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{method}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    s = json.loads(out.read_text())
    run_s = s["loop_s"] - s["compile_wait_s"]
    row = {
        "tokens_per_s": s["real_tokens_this_run"] / s["wall_s"],
        "run_tokens_per_s": s["real_tokens_this_run"] / run_s if run_s > 0 else 0.0,
        "wall_s": s["wall_s"], "compiles": s["xla_compiles"], "compile_s": s["compile_s"],
        "analysis_s": s.get("analysis_s", 0.0), "pad_fraction": s["pad_fraction"],
        "peak_bytes_max": s["peak_bytes_max"], "fits_budget": s["fits_budget"],
        "remat": remat, "executables": s["compiles"], "cache_hits": s["cache_hits"],
        "loop_s": s["loop_s"], "process_s": process_s, "final_loss": s["final_loss"],
        "real_tokens": s["real_tokens_this_run"],
    }
    if method.startswith("jaxmem"):
        row["analyses_loaded"] = s.get("analyses_loaded", 0)
    if method == "jaxmem":
        row["predicted_s"] = s["compile_plan_predicted_s"]
        row["measured_s"] = s["compile_plan_measured_s"]
        row["compile_plans"] = s["compile_plans"]
    log(f"  {method:<10} {row['tokens_per_s']:8.0f} tok/s end to end "
        f"({row['run_tokens_per_s']:6.0f} run-only), wall {row['wall_s']:6.1f} s, "
        f"{row['compiles']:3d} compiles, pad {row['pad_fraction']:.1%}, "
        f"peak {row['peak_bytes_max'] / 2**20:.0f} MiB" + (" (remat)" if remat else ""))
    return row


def epoch_report(steps: int, budget: str, cache_dir: Path,
                 methods: Sequence[str] = tuple(METHOD_FLAGS), log: Any = print
                 ) -> dict[str, Any]:
    """Runs every method once on ``cache_dir`` and returns the ``epoch.json`` object."""
    from train.config import parse_args, parse_bytes
    from train.loop import build

    cache = "warm" if cache_dir.exists() and any(cache_dir.iterdir()) else "cold"
    cache_dir.mkdir(parents=True, exist_ok=True)
    budget_bytes = parse_bytes(budget, "--budget")
    cfg = parse_args(["--model", "tiny", "--no-progress"])
    setup = build(cfg)
    longest = int(setup.dataset.lengths.max())
    fits = {packed: plain_peak_bytes(setup, cfg.batch_size, cfg.max_len if packed else longest,
                                     packed) <= budget_bytes for packed in (False, True)}
    log(f"epoch: {steps} steps, budget {budget}, cache {cache} ({cache_dir}); plain step "
        f"fits at its largest shape: rows {fits[False]}, packed {fits[True]}")
    rows = {m: run_method(m, steps, budget, cache_dir, longest,
                          remat=m in BASELINES and not fits[m == "packing"], log=log)
            for m in methods}
    report = {"steps": steps, "budget_bytes": budget_bytes, "cache": cache, "methods": rows}
    if "jaxmem" in rows:
        jm = rows["jaxmem"]
        jm["predicted_over_measured"] = (jm["predicted_s"] / jm["measured_s"]
                                         if jm["measured_s"] > 0 else 0.0)
    report.update(ratios(rows))
    return report


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """jaxmem's tokens/s over the best baseline: of all (packing included), of the
    padding ones (``xla-exact``, ``pad-max``, ``buckets``, ``pad-64``), and over packing."""
    groups = {"best_baseline": BASELINES,
              "best_padding_baseline": tuple(m for m in BASELINES if m != "packing"),
              "packing": ("packing",)}
    out = {}
    for name in ("jaxmem", "jaxmem-packing"):
        for label, members in groups.items():
            best = max((rows[m]["tokens_per_s"] for m in rows if m in members), default=0.0)
            if name in rows and best:
                out[f"{name}_over_{label}"] = rows[name]["tokens_per_s"] / best
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.epoch",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 steps (cold + warm < 15 min)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    ap.add_argument("--budget", default="512MiB")
    ap.add_argument("--methods", default=",".join(METHOD_FLAGS))
    ap.add_argument("--cache-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ns = ap.parse_args(argv)
    methods = [m for m in ns.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHOD_FLAGS]
    if unknown:
        ap.error(f"unknown --methods {unknown}; choose from {list(METHOD_FLAGS)}")
    steps = ns.steps or (30 if ns.quick else 100)
    if steps < 2:
        ap.error(f"--steps must be >= 2, got {steps}")
    report = epoch_report(steps, ns.budget, ns.cache_dir, methods)
    report["machine"] = f"{os.cpu_count()} CPU cores"
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
