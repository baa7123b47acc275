"""Host offload levels against saving and recomputing, by XLA's own figures.

A train step of ``LAYERS`` blocks ``tanh((x @ w) @ w)``: the inner product is a
residual that only a matmul can rebuild, which is where offload can beat
recomputation. jaxmem plans it with ``offload=True``; every level is compiled at
one shape and reported with its predicted peak, XLA's peak (``argument + output -
alias + temp``), XLA's host temp bytes, the step time as a ratio to level 0, and
the largest difference of its outputs from ``jax.jit``'s.

Usage::

    python -m bench.offload [--quick] [--out offload.json] [--results-dir DIR]

The JSON goes to ``--out``, the printed table to ``<results dir>/<stem of --out>.txt``
(:mod:`bench.outputs`).

On CPU the figures show the gap docs/design.md §4 describes (a ``pinned_host`` array
is compiled into the same memory there; JAX's CPU lowering drops the transfers), so
offload levels do not lower XLA's peak. On a GPU (``bench/gpu.sh``) they should,
and the JSON says by how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from bench.outputs import TextTable, add_output_arguments
from jaxmem.units import human_bytes


def _step(ws: list[jax.Array], x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    def loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = jnp.tanh((x @ w) @ w)
        return (x.astype(jnp.float32) ** 2).mean()

    value, grads = jax.value_and_grad(loss)(ws, x)
    return value, [w - 0.01 * g for w, g in zip(ws, grads, strict=True)]


def median_s(fn: Any, args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn(*args)`` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(layers: int, d: int, b: int, repeats: int) -> dict[str, Any]:
    """Compiles every level at batch ``b`` and measures it."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    ws = [(jnp.eye(d) * 0.5 + 0.001 * i).astype(dtype) for i in range(layers)]
    x = jnp.linspace(-1, 1, b * d).reshape(b, d).astype(dtype)
    step = jaxmem.jit(_step, polymorphic_shapes=(None, f"b, {d}"),
                      constraints=(f"b <= {4 * b}",), offload=True)
    analysis = step.analysis(ws, x)
    want = jax.tree_util.tree_leaves(jax.jit(_step)(ws, x))
    rows, base_s = [], None
    for k, level in enumerate(analysis.plans.levels):
        plan = step.compile_level(k, ws, x)
        got = jax.tree_util.tree_leaves(plan.run(ws, x))
        diff = max(float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max())
                   for g, w in zip(got, want, strict=True))
        step_s = median_s(plan.run, (ws, x), repeats)
        base_s = base_s or step_s
        m = plan.compiled.memory_analysis()
        rows.append({"level": k, "recompute": list(level.recompute),
                     "offload": list(level.offload),
                     "predicted_peak_bytes": plan.predicted_peak_bytes,
                     "peak_bytes": plan.peak_bytes,
                     "host_temp_bytes": int(getattr(m, "host_temp_size_in_bytes", 0)),
                     "step_ratio": step_s / base_s, "max_abs_diff": diff})
    return {"backend": jax.default_backend(), "jax": jax.__version__, "layers": layers,
            "d": d, "b": b, "dtype": str(jnp.dtype(dtype)), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small shape (CI)")
    add_output_arguments(parser, "offload.json")
    args = parser.parse_args(argv)
    # Quick: 4 layers. With 2, XLA's breadth-first CPU order (the memory model's, on
    # CPU) leaves no point where an offloaded residual lowers the peak: no offload level.
    layers, d, b, repeats = (4, 64, 128, 2) if args.quick else (4, 1024, 16384, 5)
    res = run(layers, d, b, repeats)
    log = TextTable()
    log(f"backend {res['backend']}, {layers} layers, d={d}, b={b}, {res['dtype']}")
    log(f"{'level':>5}  {'predicted':>10}  {'XLA peak':>10}  {'host temp':>10}  "
        f"{'time':>5}  {'diff':>8}  plan")
    for r in res["rows"]:
        what = ", ".join([f"recompute {g}" for g in r["recompute"]]
                         + [f"offload {g}" for g in r["offload"]]) or "save all"
        log(f"{r['level']:>5}  {human_bytes(r['predicted_peak_bytes']):>10}  "
            f"{human_bytes(r['peak_bytes']):>10}  {human_bytes(r['host_temp_bytes']):>10}  "
            f"{r['step_ratio']:>5.2f}  {r['max_abs_diff']:>8.1e}  {what}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    log.save(args, "offload.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
