"""Host offload levels against saving and recomputing, by XLA's own figures.

A train step of ``LAYERS`` blocks ``tanh((x @ w) @ w)``: the inner product is a
residual that only a matmul can rebuild, which is where offload can beat
recomputation. jaxmem plans it with ``offload=True``; every level is compiled at
one shape and reported with its predicted peak, XLA's peak (``argument + output -
alias + temp``), XLA's host temp bytes, the step time as a ratio to level 0, and
the largest difference of its outputs from ``jax.jit``'s.

Usage::

    python -m bench.offload [--quick] [--slow-flops] [--out offload.json] [--results-dir DIR]

The JSON goes to ``--out``, the printed table to ``<results dir>/<stem of --out>.txt``
(:mod:`bench.outputs`).

On CPU the figures show the gap docs/design.md §4 describes (a ``pinned_host`` array
is compiled into the same memory there; JAX's CPU lowering drops the transfers), so
offload levels do not lower XLA's peak. On a GPU (``bench/gpu.sh``) they should,
and the JSON says by how much.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import jaxmem
from bench.outputs import TextTable, add_output_arguments
from jaxmem.lower import compiler_options
from jaxmem.plan.offload import Costs, costs_for
from jaxmem.units import human_bytes


def _step(ws: list[jax.Array], x: jax.Array, policy: Any = None
          ) -> tuple[jax.Array, list[jax.Array]]:
    """One step; with ``policy``, each layer under ``jax.checkpoint(policy=policy)``, its
    two matmul outputs named ``inner`` and ``outer`` for name-based policies."""
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        h = checkpoint_name(x @ w, "inner")
        return jnp.tanh(checkpoint_name(h @ w, "outer"))

    def loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = layer(w, x) if policy is None else jax.checkpoint(layer, policy=policy)(w, x)
        return (x.astype(jnp.float32) ** 2).mean()

    value, grads = jax.value_and_grad(loss)(ws, x)
    return value, [w - 0.01 * g for w, g in zip(ws, grads, strict=True)]


#: JAX's own per-layer policies, the reference for jaxmem's levels: offloading both
#: matmul outputs (what ``jax.checkpoint`` users write for host offload), and saving none
REFERENCE_POLICIES = {
    "jax.checkpoint offload inner+outer": lambda: jax.checkpoint_policies
    .save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["inner", "outer"],
        offload_src="device", offload_dst="pinned_host"),
    "jax.checkpoint nothing_saveable": lambda: jax.checkpoint_policies.nothing_saveable,
}


def _measure(compiled: Any, run: Any, args: tuple[Any, ...], want: list[jax.Array],
             repeats: int) -> dict[str, Any]:
    """XLA's figures, the step's median seconds and its largest output difference."""
    got = jax.tree_util.tree_leaves(run(*args))
    diff = max(float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max())
               for g, w in zip(got, want, strict=True))
    m = compiled.memory_analysis()
    return {"peak_bytes": jaxmem.xla_peak_bytes(compiled),
            "host_temp_bytes": int(getattr(m, "host_temp_size_in_bytes", 0)),
            "step_s": median_s(run, args, repeats), "max_abs_diff": diff}


def _dump(hlo_dir: str | None, label: str, compiled: Any) -> None:
    """The optimized HLO of ``compiled`` to ``<hlo_dir>/<label>.hlo.txt``, if asked."""
    if hlo_dir:
        path = Path(hlo_dir) / (label.replace(" ", "_").replace("+", "_") + ".hlo.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(compiled.as_text())


def median_s(fn: Any, args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn(*args)`` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(layers: int, d: int, b: int, repeats: int, costs: Costs | None = None,
        hlo_dir: str | None = None) -> dict[str, Any]:
    """Compiles every level at batch ``b`` and measures it, then JAX's own per-layer
    policies (:data:`REFERENCE_POLICIES`) on the same step. ``costs``: the device rates
    the planner weighs recomputation against transfers with (default: the backend's);
    ``hlo_dir``: where to write each executable's optimized HLO."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    ws = [(jnp.eye(d) * 0.5 + 0.001 * i).astype(dtype) for i in range(layers)]
    x = jnp.linspace(-1, 1, b * d).reshape(b, d).astype(dtype)
    step = jaxmem.jit(_step, polymorphic_shapes=(None, f"b, {d}"),
                      constraints=(f"b <= {4 * b}",), offload=True, offload_costs=costs)
    analysis = step.analysis(ws, x)
    want = jax.tree_util.tree_leaves(jax.jit(_step)(ws, x))
    rows = []
    for k, level in enumerate(analysis.plans.levels):
        plan = step.compile_level(k, ws, x)
        _dump(hlo_dir, f"level{k}", plan.compiled)
        rows.append({"level": k, "recompute": list(level.recompute),
                     "offload": list(level.offload),
                     "predicted_peak_bytes": plan.predicted_peak_bytes,
                     **_measure(plan.compiled, plan.run, (ws, x), want, repeats)})
    references = []
    for name, policy in REFERENCE_POLICIES.items():
        fn = functools.partial(_step, policy=policy())
        compiled = jax.jit(fn).lower(ws, x).compile(compiler_options())
        _dump(hlo_dir, name, compiled)
        references.append({"policy": name, **_measure(compiled, compiled, (ws, x), want,
                                                       repeats)})
    for r in rows + references:
        r["step_ratio"] = r["step_s"] / rows[0]["step_s"]
    return {"backend": jax.default_backend(), "jax": jax.__version__, "layers": layers,
            "d": d, "b": b, "dtype": str(jnp.dtype(dtype)),
            "costs": dataclasses.asdict(costs) if costs else None, "rows": rows,
            "references": references}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small shape (CI)")
    parser.add_argument("--slow-flops", action="store_true",
                        help="plan with recomputation priced 1000x dearer than the backend's "
                             "rate, so that offload levels appear where recomputation "
                             "would win (an H200 re-runs these matmuls faster than it "
                             "moves their results to the host and back)")
    parser.add_argument("--hlo-dir", default=None,
                        help="write each executable's optimized HLO there")
    add_output_arguments(parser, "offload.json")
    args = parser.parse_args(argv)
    # Quick: 4 layers. With 2, XLA's breadth-first CPU order (the memory model's, on
    # CPU) leaves no point where an offloaded residual lowers the peak: no offload level.
    layers, d, b, repeats = (4, 64, 128, 2) if args.quick else (4, 1024, 16384, 5)
    costs = None
    if args.slow_flops:
        rates = costs_for(jax.default_backend())
        costs = dataclasses.replace(rates, flops_per_s=rates.flops_per_s / 1000)
    res = run(layers, d, b, repeats, costs, args.hlo_dir)
    log = TextTable()
    log(f"backend {res['backend']}, {layers} layers, d={d}, b={b}, {res['dtype']}"
        + (f", recompute priced at {costs.flops_per_s:.0e} FLOP/s" if costs else ""))
    log(f"{'level':>5}  {'predicted':>10}  {'XLA peak':>10}  {'host temp':>10}  "
        f"{'time':>5}  {'diff':>8}  plan")
    for r in res["rows"] + res["references"]:
        what = r.get("policy") or ", ".join(
            [f"recompute {g}" for g in r["recompute"]]
            + [f"offload {g}" for g in r["offload"]]) or "save all"
        predicted = human_bytes(r["predicted_peak_bytes"]) if "level" in r else "-"
        log(f"{r.get('level', '-'):>5}  {predicted:>10}  "
            f"{human_bytes(r['peak_bytes']):>10}  {human_bytes(r['host_temp_bytes']):>10}  "
            f"{r['step_ratio']:>5.2f}  {r['max_abs_diff']:>8.1e}  {what}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    log.save(args, "offload.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
