"""The planner's reach on code it has never seen, against the hand-placed ``jax.checkpoint``.

For each program at one shape: XLA's peak and step time of plain ``jax.jit``, of the
same step with per-layer ``jax.checkpoint(nothing_saveable)`` and ``dots_saveable``
(the one line a user would write), jaxmem's lowest level, and ``jaxmem.jit`` under
two budgets: 1.1x the per-layer checkpoint's peak (it must fit, at no more than
1.05x that policy's time) and halfway between that and plain's peak (it should run
faster than the checkpoint). Times are medians of paired, alternating runs in one
process, as ratios to the per-layer checkpoint.

    python -m bench.reach [--quick] [--repeats N] --out bench/results/reach.json

Programs: ``gpt``, the plain-JAX GPT of :mod:`bench.programs` (Python loop over
layers, no named scopes), and ``llama``, the project's Flax NNX tiny Llama.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from bench.methods import REMAT_POLICIES, time_paired
from bench.outputs import TextTable, add_output_arguments
from bench.programs import gpt_program
from jaxmem.lower import compiler_options
from jaxmem.units import human_bytes

POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "dots_saveable": jax.checkpoint_policies.dots_saveable}


def _concrete(tree: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda t: jnp.asarray(rng.standard_normal(t.shape).astype(t.dtype) * 0.02), tree)


def gpt_case(b: int, s: int, layers: int, d: int) -> dict[str, Any]:
    """The plain-JAX GPT: its step, per-layer checkpointed twins, arguments and constraints."""
    make = lambda policy=None: gpt_program(layers, d, max(1, d // 64), 256, b, s,  # noqa: E731
                                           remat_policy=policy)
    p = make()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (b, s)), jnp.int32)
    return {"name": f"gpt{layers}x{d} (plain JAX loop, no scopes)", "step": p.step,
            "hand": {k: make(v).step for k, v in POLICIES.items()},
            "args": (_concrete(p.state, 0), tokens), "constraints": p.constraints,
            "poly": (None, "b, s")}


def llama_case(b: int, s: int) -> dict[str, Any]:
    """The project's Flax NNX tiny Llama on the built-in data."""
    from bench.workload import build_workload

    w = build_workload("tiny", max_len=max(s, 800))
    hand = {"nothing_saveable": w.remat_step(REMAT_POLICIES["xla+full_remat"]),
            "dots_saveable": w.remat_step(REMAT_POLICIES["xla+dots"])}
    return {"name": "llama tiny (Flax NNX)", "step": w.train_step, "hand": hand,
            "args": (w.state, w.batch(b, s)), "constraints": (f"b <= {b}", f"s <= {s}"),
            "poly": (None, "b, s")}


def _compiled(step: Callable[..., Any], args: Sequence[Any]) -> Any:
    return jax.jit(step).lower(*args).compile(compiler_options=compiler_options())


def measure(case: dict[str, Any], repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every figure of one program (see the module docstring)."""
    args = case["args"]
    plain = _compiled(case["step"], args)
    hand = {k: _compiled(v, args) for k, v in case["hand"].items()}
    ns = hand["nothing_saveable"]
    ns_peak = jaxmem.xla_peak_bytes(ns)
    f = jaxmem.jit(case["step"], polymorphic_shapes=case["poly"],
                   constraints=case["constraints"])
    t0 = time.perf_counter()
    plans = f.plans(*args)
    analysis_s = time.perf_counter() - t0
    lowest = min((f.compile_level(k, *args) for k in range(len(plans.levels))),
                 key=lambda p: p.peak_bytes)
    row: dict[str, Any] = {
        "program": case["name"], "levels": len(plans.levels), "analysis_s": analysis_s,
        "plain_peak_bytes": jaxmem.xla_peak_bytes(plain),
        "checkpoint_peak_bytes": {k: jaxmem.xla_peak_bytes(c) for k, c in hand.items()},
        "lowest_level": lowest.level, "lowest_peak_bytes": lowest.peak_bytes,
        "lowest_predicted_bytes": lowest.predicted_peak_bytes,
        "lowest_vs_checkpoint": lowest.peak_bytes / ns_peak,
        "plain_time_vs_checkpoint": time_paired(lambda: plain(*args), lambda: ns(*args),
                                                repeats)[2],
    }
    budgets = {"1.1x checkpoint": int(1.1 * ns_peak),
               "halfway": (ns_peak + row["plain_peak_bytes"]) // 2}
    row["budgets"] = {}
    for label, budget in budgets.items():
        g = f.with_budget(budget)
        try:
            plan = g.plan_for(*args)
        except jaxmem.BudgetInfeasibleError as e:
            row["budgets"][label] = {"budget_bytes": budget, "fits": False,
                                     "min_peak_bytes": e.min_peak_bytes}
            continue
        ratio = time_paired(lambda g=g: g(*args), lambda: ns(*args), repeats)[2]
        row["budgets"][label] = {"budget_bytes": budget, "fits": plan.peak_bytes <= budget,
                                 "level": plan.level, "peak_bytes": plan.peak_bytes,
                                 "predicted_peak_bytes": plan.predicted_peak_bytes,
                                 "time_vs_checkpoint": ratio}
    log(_format(row))
    return row


def _format(row: dict[str, Any]) -> str:
    hb = human_bytes
    lines = [f"{row['program']}: {row['levels']} levels, analysis {row['analysis_s']:.1f} s",
             f"  plain {hb(row['plain_peak_bytes'])} (time {row['plain_time_vs_checkpoint']:.2f}"
             " x checkpoint); per-layer checkpoint "
             + ", ".join(f"{k} {hb(v)}" for k, v in row["checkpoint_peak_bytes"].items()),
             f"  jaxmem lowest level {row['lowest_level']}: {hb(row['lowest_peak_bytes'])} "
             f"({row['lowest_vs_checkpoint']:.3f} x nothing_saveable; predicted "
             f"{hb(row['lowest_predicted_bytes'])})"]
    for label, r in row["budgets"].items():
        if not r["fits"] or "level" not in r:
            lines.append(f"  budget {label} {hb(r['budget_bytes'])}: does NOT fit")
            continue
        lines.append(f"  budget {label} {hb(r['budget_bytes'])}: level {r['level']}, "
                     f"{hb(r['peak_bytes'])}, time {r['time_vs_checkpoint']:.2f} x checkpoint")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (CI-sized)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--programs", default="gpt,llama")
    add_output_arguments(ap, "reach.json")
    a = ap.parse_args(argv)
    cases = {"gpt": lambda: gpt_case(*((2, 64, 3, 64) if a.quick else (4, 256, 4, 256))),
             "llama": lambda: llama_case(*((2, 64) if a.quick else (8, 512)))}
    log = TextTable()
    rows = [measure(cases[name](), a.repeats, log) for name in a.programs.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "backend": jax.default_backend(), "quick": a.quick}, f,
                      indent=1)
    log.save(a, "reach.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
