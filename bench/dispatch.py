"""Per-call dispatch overhead of ``jaxmem.jit`` against ``jax.jit`` on cached shapes.

Both wrappers run the same function on the same arguments; the executable is
cached, so what is timed is what each adds around it: jaxmem reads the shapes of
the symbolic leaves, finds the plan and calls the executable's C++ entry point;
``jax.jit`` runs its own C++ fast path. Rounds alternate between the two and the
figure is the median over rounds of the per-round ratio, which cancels most of
the drift of a shared machine.

Usage::

    python -m bench.dispatch [--quick] [--out dispatch.json] [--results-dir DIR]

Cases: a two-argument elementwise function, and a train-step-shaped call (a
parameter pytree of 64 leaves plus a ``(b, s)`` token batch). Target: ratio <= 1.2.
The JSON goes to ``--out``, the printed table to ``<results dir>/<stem of --out>.txt``
(:mod:`bench.outputs`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from bench.outputs import TextTable, add_output_arguments


def _elementwise() -> tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...]]:
    def f(x, y):
        return x * 2 + y

    x = jnp.ones((8, 8))
    return f, (x, x), ("b, 8", "b, 8")


def _train_step_shaped() -> tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...]]:
    params = {f"layer_{i}": {"w": jnp.ones((4, 4)), "b": jnp.zeros((4,))} for i in range(32)}

    def step(params, tokens):
        scale = tokens.astype(jnp.float32).mean()
        return jax.tree_util.tree_map(lambda p: p - 1e-3 * scale * p, params)

    return step, (params, jnp.ones((2, 16), jnp.int32)), (None, "b, s")


CASES = {"elementwise": _elementwise, "train_step_shaped": _train_step_shaped}


def _per_call_s(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / (calls + 1)


def measure(case: str, rounds: int, calls: int) -> dict[str, Any]:
    """Median per-call time of both wrappers and the median per-round ratio."""
    fun, args, shapes = CASES[case]()
    plain = jax.jit(fun)
    mine = jaxmem.jit(fun, polymorphic_shapes=shapes)
    for f in (plain, mine, plain, mine):  # compile, then fill both fast paths
        jax.block_until_ready(f(*args))
    plain_s, mine_s = [], []
    for _ in range(rounds):
        plain_s.append(_per_call_s(plain, args, calls))
        mine_s.append(_per_call_s(mine, args, calls))
    ratios = [m / p for m, p in zip(mine_s, plain_s, strict=True)]
    return {"case": case, "leaves": len(jax.tree_util.tree_leaves(args)),
            "jax_jit_us": statistics.median(plain_s) * 1e6,
            "jaxmem_us": statistics.median(mine_s) * 1e6,
            "ratio": statistics.median(ratios), "rounds": rounds, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (CI)")
    add_output_arguments(parser, "dispatch.json")
    args = parser.parse_args(argv)
    rounds, calls = (5, 500) if args.quick else (41, 5000)
    rows = []
    log = TextTable()
    log(f"{'case':<20}{'leaves':>7}{'jax.jit us':>12}{'jaxmem us':>11}{'ratio':>8}")
    for case in CASES:
        row = measure(case, rounds, calls)
        rows.append(row)
        log(f"{case:<20}{row['leaves']:>7}{row['jax_jit_us']:>12.2f}{row['jaxmem_us']:>11.2f}"
            f"{row['ratio']:>8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "target_ratio": 1.2, "jax": jax.__version__,
                       "backend": jax.default_backend()}, f, indent=2)
    log.save(args, "dispatch.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
