"""Microbatching with each level's plan inside the chunks, by XLA's own figures.

A plain-JAX GPT (``bench.programs.gpt_program``, no named scopes) whose gradient is
taken with ``jaxmem.value_and_grad``, so ``Microbatch`` may split it. Level 0 (save
everything) and the plan's lowest level are compiled at one shape, whole and split
into k accumulation steps; each row gives jaxmem's predicted peak (of a split step: the
memory model of the split trace at that shape), XLA's peak (``argument + output - alias +
temp``), the step time as a ratio to level 0 whole, and the largest difference of its
outputs from ``jax.jit``'s.

Usage::

    python -m bench.microbatch [--quick] [--out microbatch.json] [--results-dir DIR]

The JSON goes to ``--out``, the printed table to ``<results dir>/<stem of --out>.txt``
(:mod:`bench.outputs`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from bench.offload import median_s
from bench.outputs import TextTable, add_output_arguments
from bench.programs import concrete, gpt_program
from jaxmem.units import human_bytes


def run(layers: int, d: int, b: int, s: int, chunks: tuple[int, ...],
        repeats: int) -> dict[str, Any]:
    """Compiles level 0 and the lowest level at ``(b, s)``, whole and in ``chunks`` steps."""
    sizes = {"layers": layers, "d": d, "heads": 4, "vocab": 256, "max_b": b, "max_s": s}
    program = gpt_program(**sizes, value_and_grad=jaxmem.value_and_grad)
    step = jaxmem.jit(program.step, polymorphic_shapes=(None, "b, s"),
                      constraints=program.constraints)
    state = concrete(program.state, 0)
    tokens = jax.random.randint(jax.random.key(1), (b, s), 0, sizes["vocab"])
    levels = step.plans(state, tokens).levels
    lowest = min(range(len(levels)), key=lambda k: levels[k].peak_fn({"b": b, "s": s}))
    want = jax.tree_util.tree_leaves(jax.jit(gpt_program(**sizes).step)(state, tokens))
    rows, base_s = [], None
    for k in sorted({0, lowest}):
        for n in (1, *chunks):
            plan = step.compile_level(k, state, tokens, microbatches=n)
            got = jax.tree_util.tree_leaves(plan.compiled(state, tokens))
            diff = max(float(jnp.abs(g - w).max()) for g, w in zip(got, want, strict=True))
            step_s = median_s(plan.compiled, (state, tokens), repeats)
            base_s = base_s or step_s
            rows.append({"level": k, "what": _what(levels[k]),
                         "microbatches": n, "predicted_peak_bytes": plan.predicted_peak_bytes,
                         "peak_bytes": plan.peak_bytes, "step_ratio": step_s / base_s,
                         "max_abs_diff": diff})
    return {"backend": jax.default_backend(), "jax": jax.__version__, "layers": layers,
            "d": d, "b": b, "s": s, "rows": rows}


def _what(level: Any) -> str:
    if not level.recompute:
        return "save all"
    kind = "re-run segments" if level.segments is not None else "recompute groups"
    return f"{kind}: {len(level.recompute)} residual groups"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small shape (CI)")
    add_output_arguments(parser, "microbatch.json")
    args = parser.parse_args(argv)
    layers, d, b, s, chunks, repeats = ((2, 32, 4, 32, (2,), 1) if args.quick
                                        else (4, 128, 8, 256, (2, 4), 5))
    res = run(layers, d, b, s, chunks, repeats)
    log = TextTable()
    log(f"backend {res['backend']}, plain-JAX GPT, {layers} layers, d={d}, (b, s)=({b}, {s})")
    log(f"{'level':>5}  {'chunks':>6}  {'predicted':>10}  {'XLA peak':>10}  {'time':>5}  "
        f"{'diff':>8}  plan")
    for r in res["rows"]:
        log(f"{r['level']:>5}  {r['microbatches']:>6}  "
            f"{human_bytes(r['predicted_peak_bytes']):>10}  {human_bytes(r['peak_bytes']):>10}  "
            f"{r['step_ratio']:>5.2f}  {r['max_abs_diff']:>8.1e}  {r['what']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    log.save(args, "microbatch.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
