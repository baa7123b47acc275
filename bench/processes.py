"""XLA's peaks of jaxmem's chosen executables from a second, fresh Python process.

The first process is the ``bench.compare`` run itself; the second is
``python -m bench.processes``, started once per workload after its timings. It rebuilds
the workload from its recipe (:attr:`bench.workload.Workload.recipe`), builds the same
``jaxmem.jit`` (:class:`bench.methods.Methods`: same constraints and budget), runs the
symbolic analysis again, and at each grid shape plans and compiles (JAX's persistent
compilation cache off, so XLA compiles anew) and reports the chosen level and
``jaxmem.xla_peak_bytes``. The parent records both processes' figures per shape and
their largest relative difference.

The child reads its spec as JSON on stdin and prints its result as one JSON line last:

    echo '{"recipe": ..., "budget_bytes": ..., "max_b": 4, "max_s": 64, "shapes": [[4, 64]]}' \\
        | python -m bench.processes
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.methods import Methods
from bench.workload import Workload

ROOT = Path(__file__).resolve().parent.parent


def rebuild(recipe: dict[str, Any]) -> Workload:
    """The workload a recipe describes (``builder``: ``llama`` or ``program``), on one
    short record: the data never reaches the step, its state or its shapes."""
    from bench.decoders import program_workload
    from bench.workload import build_workload
    from train.data import Record

    kw = {k: v for k, v in recipe.items() if k != "builder"}
    kw["records"] = [Record("rebuilt", "", "for bench.processes")]
    if recipe["builder"] == "llama":
        return build_workload(**kw)
    if recipe["builder"] == "program":
        return program_workload(**{**kw, "constraints": tuple(kw.get("constraints", ()))})
    raise ValueError(f"unknown workload builder {recipe['builder']!r}: llama or program")


def child_peaks(spec: dict[str, Any]) -> dict[str, Any]:
    """In this process: jaxmem's chosen level and XLA's peak at each shape of ``spec``."""
    t0 = time.perf_counter()
    w = rebuild(spec["recipe"])
    m = Methods(w, spec["budget_bytes"], spec["max_b"], spec["max_s"])
    out = []
    for b, s in spec["shapes"]:
        p = m.prepare("jaxmem", b, s)
        out.append({"b": b, "s": s, "level": p.level, "peak_bytes": int(p.peak_bytes),
                    "fits_budget": p.call is not None})
    return {"shapes": out, "pid": os.getpid(), "seconds": round(time.perf_counter() - t0, 1)}


def compare_peaks(first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]]
                  ) -> dict[str, Any]:
    """Both processes' figures per shape and their largest relative peak difference.

    Example:
        >>> a = [{"b": 1, "s": 8, "level": 0, "peak_bytes": 100}]
        >>> round(compare_peaks(a, [{**a[0], "peak_bytes": 110}])["max_rel_diff"], 3)
        0.091
    """
    theirs = {(r["b"], r["s"]): r for r in second}
    shapes = []
    for r in first:
        o = theirs.get((r["b"], r["s"]))
        peaks = [r["peak_bytes"], None if o is None else o["peak_bytes"]]
        diff = (None if None in peaks else
                abs(peaks[0] - peaks[1]) / max(peaks[0], peaks[1], 1))
        shapes.append({"b": r["b"], "s": r["s"], "peak_bytes": peaks,
                       "level": [r["level"], None if o is None else o["level"]],
                       "rel_diff": diff})
    diffs = [x["rel_diff"] for x in shapes if x["rel_diff"] is not None]
    return {"processes": 2, "shapes": shapes,
            "max_rel_diff": max(diffs) if len(diffs) == len(shapes) and diffs else None,
            "same_levels": all(x["level"][0] == x["level"][1] for x in shapes)}


def second_process_peaks(w: Workload, m: Methods, rows: Sequence[dict[str, Any]],
                         log: Any = print, timeout_s: float = 900) -> dict[str, Any]:
    """Recompiles jaxmem's chosen executable at every shape of ``rows`` in one fresh
    process and compares its XLA peaks with this process's (the ``jaxmem`` rows')."""
    mine = [{"b": r["b"], "s": r["s"], "level": r["level"], "peak_bytes": r["peak_bytes"]}
            for r in rows if r["method"] == "jaxmem" and r["workload"] == w.name
            and r["peak_bytes"] is not None]
    if w.recipe is None or not mine:
        return {"processes": 1, "shapes": [], "max_rel_diff": None,
                "note": "no recipe to rebuild the workload" if w.recipe is None else "no rows"}
    spec = {"recipe": w.recipe, "budget_bytes": m.budget_bytes, "max_b": m.max_b,
            "max_s": m.max_s, "shapes": [[x["b"], x["s"]] for x in mine]}
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "bench.processes"], input=json.dumps(spec),
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.processes exited {proc.returncode}: {proc.stderr[-2000:]}")
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {**compare_peaks(mine, child["shapes"]), "child_pid": child["pid"],
           "parent_pid": os.getpid(), "child_s": round(time.perf_counter() - t0, 1)}
    log(f"peaks from 2 processes: max relative difference {out['max_rel_diff']}, same levels "
        f"{out['same_levels']} over {len(mine)} shape(s) [{out['child_s']:.1f}s]")
    return out


def main() -> int:
    """Child entry point: spec on stdin, one JSON line on stdout."""
    import jax

    warnings.filterwarnings("ignore", message=".*unknown primitive.*")
    jax.config.update("jax_enable_compilation_cache", False)  # compile, do not load
    print(json.dumps(child_peaks(json.loads(sys.stdin.read()))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
