"""jaxmem's analysis and plan derivation against one XLA compile, at Llama-2-1B widths.

Issue #12: analysis and plan derivation of a 22-layer train step with Llama-2-1B
widths (d 2048, MLP 5632, 32 heads with 4 key/value heads, vocab 32000), unrolled
and scanned, timed on CPU (nothing runs) against one XLA compile of the same
step at one shape; the target is 10 % of the compile. Cases:

* ``llama-f32``, ``llama-bf16``: the Flax NNX Llama of :mod:`models.llama` (the
  ``1b`` preset; f32 compute, and the preset's bf16 compute), unrolled (a Python
  loop over layers), under AdamW (:func:`bench.programs.llama_program`).
* ``gpt-scan``: the NNX Llama has no scanned form, so the scanned twin is the
  plain-JAX GPT of :func:`bench.programs.gpt_scan_program` (``lax.scan`` over
  stacked layers) at the same widths (32 heads of 64, no grouped key/values).

For each case, in a fresh process per repeat (so that no cache of jaxmem's or
JAX's is warm): (a) ``jaxmem.analyze`` (trace, graph, memory model) over
``b <= 8, s <= 512``; (b) the plan derivation ``jaxmem.jit`` runs after tracing
(:func:`jaxmem.plan.analysis.derive_plans`: the levels, each with its memory
model, and the scheduler's orders), with the state donated as in training; (c)
``jax.jit(step).lower(...)`` and ``.compile()`` at ``(b, s) = (8, 512)``, nothing
executed; (d) the symbolic trace alone (``jaxmem.trace.trace``, again, warm): JAX's own
tracing of the step, part of (a), which ``jax.jit``'s lower pays too, at one shape. State
and batch are ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``:
no 1B parameters (16 GB with Adam's moments in f32) are materialised. Each figure
is the minimum over the repeats.

Usage::

    python -m bench.scale [--quick] [--repeats 3] [--cases llama-f32,...] [--out scale.json]

``--quick``: 2 layers, one repeat, in this process (for the test). Prints a table
and writes ``{"cases": {name: {...}}, "layers", "shape", "repeats"}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

import jaxmem
from bench.outputs import TextTable, add_output_arguments
from bench.programs import Program, gpt_scan_program, llama_program

SHAPE = {"b": 8, "s": 512}
LAYERS = 22
QUICK_LAYERS = 2
TARGET = 0.10  # analysis + plans as a fraction of one XLA compile (issue #12)
PHASES = ("analyze", "plans", "lower", "compile", "trace")


def llama_case(layers: int, dtype: str) -> Program:
    """The ``1b`` NNX Llama with ``layers`` blocks and compute dtype ``dtype``."""
    return llama_program("1b", max_b=SHAPE["b"], max_s=SHAPE["s"], n_layers=layers,
                         dtype=dtype)


def scan_case(layers: int) -> Program:
    """The plain-JAX scanned GPT at the ``1b`` preset's widths."""
    return gpt_scan_program(layers, d=2048, heads=32, vocab=32000, max_b=SHAPE["b"],
                            max_s=SHAPE["s"], d_ff=5632)


CASES: dict[str, Callable[[int], Program]] = {
    "llama-f32": lambda n: llama_case(n, "float32"),
    "llama-bf16": lambda n: llama_case(n, "bf16"),
    "gpt-scan": scan_case,
}


def time_case(program: Program, shape: dict[str, int]) -> dict[str, Any]:
    """Seconds of (a) ``jaxmem.analyze``, (b) plan derivation, (c) XLA's lower and compile,
    (d) the symbolic trace that (a) starts with, run again.

    Example:
        >>> from bench.programs import mlp_program
        >>> t = time_case(mlp_program(hidden=16, layers=1, max_b=8), {"b": 8})
        >>> sorted(k for k in t if k.endswith("_s") and not k.endswith("cpu_s"))
        ['analyze_s', 'compile_s', 'lower_s', 'plans_s', 'trace_s']
    """
    from jaxmem.plan.analysis import PlanInputs, derive_plans
    from jaxmem.plan.offload import costs_for, offload_by_default
    from jaxmem.trace import trace

    clock: list[tuple[float, float]] = []

    def tick() -> None:
        clock.append((time.perf_counter(), time.process_time()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        tick()
        report = jaxmem.analyze(program.step, *program.symbolic_args())
        tick()
        backend = jax.default_backend()
        donated = tuple(range(len(jax.tree_util.tree_leaves(program.state))))
        plans, _ = derive_plans(PlanInputs(
            report.traced, report.graph, report.domain, donated, True,
            offload_by_default(backend), costs_for(backend), jaxmem.schedulers.MemoryAware()))
        tick()
    lowered = jax.jit(program.step, donate_argnums=(0,)).lower(*program.concrete_args(shape))
    tick()
    compiled = lowered.compile()
    tick()
    trace(program.step, *program.symbolic_args())
    tick()
    out = {"program": program.name, "nodes": len(report.graph.nodes), "levels": len(plans.levels),
           # Level 0 under the donation the compile has: the analysis report's peak
           # counts the updated state as new buffers (nothing donated).
           "predicted_peak_bytes": int(plans.levels[0].peak_fn(shape)),
           "undonated_peak_bytes": report.peak_bytes_at(**shape),
           "xla_peak_bytes": jaxmem.xla_peak_bytes(compiled)}
    for k, name in enumerate(PHASES):
        out[f"{name}_s"] = clock[k + 1][0] - clock[k][0]
        out[f"{name}_cpu_s"] = clock[k + 1][1] - clock[k][1]
    return out


def _fresh(case: str, layers: int) -> dict[str, Any]:
    """:func:`time_case` of ``case`` in a new Python process (every cache cold)."""
    out = subprocess.run([sys.executable, "-m", "bench.scale", "--child", case,
                          "--layers", str(layers)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Minimum of each time over the repeats, and the ratios to one XLA compile.

    Wall times (``*_s``) and process CPU times (``*_cpu_s``: all threads, XLA's
    compile uses several); on a busy machine the CPU times are the steadier figure.
    """
    best = dict(runs[0])
    for name in PHASES:
        for key in (f"{name}_s", f"{name}_cpu_s"):
            best[key] = min(r[key] for r in runs)
            best[key + "_all"] = [r[key] for r in runs]
    for unit in ("s", "cpu_s"):
        xla = best[f"lower_{unit}"] + best[f"compile_{unit}"]
        tag = "" if unit == "s" else "_cpu"
        best[f"xla_{unit}"] = xla
        best[f"analysis_ratio{tag}"] = best[f"analyze_{unit}"] / xla
        best[f"plans_ratio{tag}"] = best[f"plans_{unit}"] / xla
        best[f"total_ratio{tag}"] = (best[f"analyze_{unit}"] + best[f"plans_{unit}"]) / xla
        best[f"trace_ratio{tag}"] = best[f"trace_{unit}"] / xla
    best["meets_target"] = best["total_ratio"] <= TARGET
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_LAYERS} layers, one repeat, in this process")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_output_arguments(parser, "scale.json")
    args = parser.parse_args(argv)
    layers = args.layers or (QUICK_LAYERS if args.quick else LAYERS)
    if args.child:
        print(json.dumps(time_case(CASES[args.child](layers), SHAPE)))
        return 0
    log = TextTable()
    at = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    upto = ", ".join(f"{k} <= {v}" for k, v in SHAPE.items())
    log(f"{layers} layers at {at} (domain {upto}); min of "
        f"{1 if args.quick else args.repeats} run(s)")
    log(f"{'case':<11} {'ops':>6} {'lv':>3} {'analyze':>8} {'plans':>8} {'xla':>8} "
        f"{'analyze/xla':>11} {'plans/xla':>9} {'both/xla':>8} {'(cpu)':>6} {'trace/xla':>9}")
    results = {}
    for case in args.cases.split(","):
        runs = ([time_case(CASES[case](layers), SHAPE)] if args.quick
                else [_fresh(case, layers) for _ in range(args.repeats)])
        r = results[case] = summarize(runs)
        log(f"{case:<11} {r['nodes']:>6} {r['levels']:>3} {r['analyze_s']:>7.2f}s "
            f"{r['plans_s']:>7.2f}s {r['xla_s']:>7.2f}s {100 * r['analysis_ratio']:>10.0f}% "
            f"{100 * r['plans_ratio']:>8.0f}% {100 * r['total_ratio']:>7.0f}% "
            f"{100 * r['total_ratio_cpu']:>5.0f}% {100 * r['trace_ratio_cpu']:>8.0f}%")
    log(f"wall seconds; xla = lower + compile of jax.jit(step); target: analyze + plans <= "
        f"{100 * TARGET:.0f} % of it; (cpu): the same ratio in process CPU seconds; "
        "trace/xla (cpu): JAX's symbolic trace of the step alone, warm, which analyze "
        "starts with")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cases": results, "layers": layers, "shape": SHAPE,
                       "repeats": 1 if args.quick else args.repeats}, f, indent=1)
    log.save(args, "scale.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
