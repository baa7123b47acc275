"""How close jaxmem's predicted peak comes to XLA's, at every level of every plan set.

For each train step of :data:`SUITE` and each shape, every level of the step's plan
set (``jaxmem.jit(...).plans``) is compiled at that exact shape
(``Jitted.compile_level``) and XLA's peak of that executable (``argument + output -
alias + temp`` of ``memory_analysis()``, the contract's definition) is compared with
the level's own prediction (``Plan.predicted_peak_bytes``, the level's ``peak_fn`` at
those dims), derived once per program without compiling. Also times
``jaxmem.analyze`` on a 4-layer Llama-sized train step.

Programs: an MLP; the plain-JAX GPT (a Python loop over unnamed layers) and its
``lax.scan`` twin; a Flax linen decoder (:func:`bench.reach.linen_case`); the Flax NNX
Llama of ``models/``; bf16-compute variants of the GPT, of its scanned twin and of
the Llama (float32 parameters and optimizer state, activations and matmuls in bfloat16,
as the Llama's ``1b`` preset trains); and a Flax linen decoder with ``dtype=bfloat16``
modules, unrolled and under ``nn.scan`` (:mod:`bench.linen_programs`: its softmax in
bfloat16 too).

Usage::

    python -m bench.accuracy [--quick [--every-level]] [--programs gpt,llama-bf16]
        [--out accuracy.json] [--results-dir DIR]

Prints a table (program, level, shape, xla, predicted, error) and the median and
worst absolute relative error per program, for level 0 and for the deeper levels,
and overall, and writes all of it as JSON to ``--out``: ``{"rows": [...],
"summary": {...}, "analyze_timing": {...}}``; each row carries ``program``,
``level``, ``shape``, ``xla``, ``predicted``, ``error`` (signed, relative to XLA).
The printed table goes to ``<results dir>/<stem of --out>.txt`` (:mod:`bench.outputs`).

Targets (issue 12): median error <= 3 %, worst <= 10 %. Figures: README, "Memory
prediction accuracy".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from bench.linen_programs import linen_bf16_program
from bench.outputs import TextTable, add_output_arguments
from bench.programs import Program, gpt_program, gpt_scan_program, llama_program, mlp_program

MIB = 2**20

# Every level is compiled at every shape (a few seconds each on two CPU cores): three
# shapes keep the full run within about ten minutes; --quick compiles three levels of
# each program at one shape, within about two.
LM_FULL = [{"b": 1, "s": 32}, {"b": 4, "s": 128}, {"b": 8, "s": 512}]
LM_QUICK = [{"b": 4, "s": 128}]


def linen_program(layers: int = 4, d: int = 256, max_b: int = 16, max_s: int = 512) -> Program:
    """The Flax linen decoder of :func:`bench.reach.linen_case` as a :class:`Program`
    (its parameters do not depend on the shape it is initialised at)."""
    from bench.reach import linen_case

    case = linen_case(1, 8, layers, d)
    state = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                   case["args"][0])

    def batch(dd: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((dd["b"], dd["s"]), jnp.int32),)

    return Program(f"linen{layers}x{d}", case["step"], state, batch, ("b", "s"),
                   (f"b <= {max_b}", f"s <= {max_s}"))


# name -> (program factory taking the layer count, full shape grid, quick subset).
# Shapes span the range where the activations are small next to the parameters and
# optimizer state up to where they dominate, which is where XLA's buffer assignment
# behaves differently. --quick also halves the layers (4 -> 2): compiles dominate.
SUITE: dict[str, tuple[Callable[[int], Program], list[dict[str, int]], list[dict[str, int]]]] = {
    "mlp": (lambda n: mlp_program(layers=n - 1),
            [{"b": b} for b in (16, 1024, 4096)], [{"b": 1024}]),
    "gpt": (lambda n: gpt_program(layers=n, d=256), LM_FULL, LM_QUICK),
    "gpt-scan": (lambda n: gpt_scan_program(layers=n, d=256), LM_FULL, LM_QUICK),
    "linen": (lambda n: linen_program(layers=n, d=256), LM_FULL, LM_QUICK),
    "llama": (lambda n: llama_program("small", n_layers=n), LM_FULL, LM_QUICK),
    "gpt-bf16": (lambda n: gpt_program(layers=n, d=256, dtype=jnp.bfloat16), LM_FULL, LM_QUICK),
    "llama-bf16": (lambda n: llama_program("small", n_layers=n, dtype="bf16"), LM_FULL,
                   LM_QUICK),
    "gpt-scan-bf16": (lambda n: gpt_scan_program(layers=n, d=256, dtype=jnp.bfloat16),
                      LM_FULL, LM_QUICK),
    "linen-bf16": (lambda n: linen_bf16_program(layers=n), LM_FULL, LM_QUICK),
    "linen-scan-bf16": (lambda n: linen_bf16_program(layers=n, scan=True), LM_FULL, LM_QUICK),
}


def relative_error(predicted: int, actual: int) -> float:
    """Signed relative error of a prediction (positive: over-predicted)."""
    return (predicted - actual) / actual


def polymorphic_shapes(program: Program) -> tuple[str | None, ...]:
    """``jaxmem.jit``'s ``polymorphic_shapes`` for a program: state fixed, batch symbolic."""
    _, *batch = program.symbolic_args()
    return (None, *(", ".join(str(d) for d in spec.shape) for spec in batch))


def quick_levels(n_levels: int) -> list[int]:
    """The levels ``--quick`` compiles: the first, the middle and the deepest (the full
    form compiles every level at every shape)."""
    return sorted({0, n_levels // 2, n_levels - 1})


def run_program(name: str, program: Program, shapes: Sequence[dict[str, int]],
                log: Callable[[str], None], quick: bool = False) -> list[dict[str, Any]]:
    """Every level (``quick``: :func:`quick_levels`) of ``program``'s plan set against
    XLA at every shape (one analysis)."""
    f = jaxmem.jit(program.step, polymorphic_shapes=polymorphic_shapes(program),
                   constraints=program.constraints)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        n_levels = len(f.plans(*program.concrete_args(shapes[0])).levels)
    analyze_s = time.perf_counter() - t0
    rows = []
    for dims in shapes:
        args = program.concrete_args(dims)
        for level in quick_levels(n_levels) if quick else range(n_levels):
            t1 = time.perf_counter()
            plan = f.compile_level(level, *args)
            row = {"program": name, "model": program.name, "level": level,
                   "levels": n_levels, "shape": dict(dims), "xla": int(plan.peak_bytes),
                   "predicted": int(plan.predicted_peak_bytes),
                   "error": relative_error(plan.predicted_peak_bytes, plan.peak_bytes),
                   "analyze_s": analyze_s, "compile_s": time.perf_counter() - t1}
            rows.append(row)
            log(_fmt_row(row))
    return rows


def _fmt_row(row: dict[str, Any]) -> str:
    shape = ",".join(f"{k}={v}" for k, v in row["shape"].items())
    return (f"{row['program']:<11} {row['level']:>2}/{row['levels']:<2} {shape:<12} "
            f"{row['xla'] / MIB:>10.2f} {row['predicted'] / MIB:>10.2f} "
            f"{100 * row['error']:>+8.1f}%")


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and worst absolute relative error per program (all levels; level 0; the
    deeper levels) and overall."""
    groups: dict[str, list[float]] = {}
    for prefix in [*dict.fromkeys(r["program"] for r in rows), "overall"]:
        for part in ("", " level 0", " deeper"):
            groups[prefix + part] = []
    for r in rows:
        part = " level 0" if r["level"] == 0 else " deeper"
        for key in (r["program"], r["program"] + part, "overall" + part, "overall"):
            groups[key].append(abs(r["error"]))
    return {k: {"n": len(v), "median": statistics.median(v), "worst": max(v)}
            for k, v in groups.items() if v}


def time_analyze(repeats: int = 3) -> dict[str, Any]:
    """Wall time of ``jaxmem.analyze`` on a 4-layer train step with Llama-1B layer sizes."""
    program = llama_program("1b", n_layers=4, max_b=16, max_s=2048)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
            report = jaxmem.analyze(program.step, *program.symbolic_args())
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(1000):
        report.peak_bytes_at(b=8, s=1024)
    return {"program": program.name, "nodes": len(report.graph.nodes),
            "analyze_s": min(times), "analyze_s_all": times,
            "peak_bytes_at_us": (time.perf_counter() - t0) * 1e3,
            "comparisons": report.comparisons}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one shape per program, 2-layer models, first / middle / "
                             "deepest level")
    add_output_arguments(parser, "accuracy.json")
    parser.add_argument("--every-level", action="store_true",
                        help="with --quick: compile every level, not three")
    parser.add_argument("--programs", default=",".join(SUITE), help="comma-separated subset")
    parser.add_argument("--no-timing", action="store_true",
                        help="skip timing jaxmem.analyze on the Llama-1B-sized step")
    args = parser.parse_args(argv)
    log = TextTable()
    log(f"{'program':<11} {'level':<5} {'shape':<12} {'xla MiB':>10} {'pred MiB':>10} "
        f"{'error':>9}")
    rows: list[dict[str, Any]] = []
    for name in args.programs.split(","):
        factory, full, quick = SUITE[name]
        rows += run_program(name, factory(2 if args.quick else 4),
                            quick if args.quick else full, log,
                            args.quick and not args.every_level)
    summary = summarize(rows)
    for k, v in summary.items():
        log(f"{k:<20} n={v['n']:<3} median |error| {100 * v['median']:5.1f}%   "
            f"worst {100 * v['worst']:5.1f}%")
    timing = None if args.no_timing else time_analyze(1 if args.quick else 3)
    if timing:
        log(f"analyze on {timing['program']} ({timing['nodes']} ops): "
            f"{timing['analyze_s']:.2f} s; peak_bytes_at {timing['peak_bytes_at_us']:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary, "analyze_timing": timing}, f, indent=1)
    log.save(args, "accuracy.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
