"""The memory model on the simplest training code there is: residual MLPs.

``x + act(x @ w1 [+ b1]) @ w2``, three layers on ``[8, 128, 64]`` tokens (hidden 256),
the gradient of ``mean(x ** 2)`` under plain ``jax.grad``: nine activations, each with
and without biases. For each step, XLA's peak of ``jax.jit(step)`` (``argument + output
- alias + temp``) against the memory model's prediction for the order XLA's CPU
scheduler picks (no plan: what every level starts from).

    python -m bench.residual_mlps [--quick] --out bench/results/residual_mlps.json

``--quick``: ReLU and tanh only (the test). Prints a table and writes ``{"rows": [...]}``
(``activation``, ``bias``, ``xla_peak_bytes``, ``predicted_peak_bytes``, ``error``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from bench.outputs import TextTable, add_output_arguments
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.symbolic import ShapeDomain

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh, "gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu,
    "sin": jnp.sin, "exp": jnp.exp, "abs": jnp.abs, "leaky_relu": jax.nn.leaky_relu,
    "sigmoid": jax.nn.sigmoid,
}
QUICK = ("relu", "tanh")


def residual_mlp(act: Callable[[jax.Array], jax.Array], bias: bool
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(grad step, argument specs)`` of the three-layer residual MLP with ``act``.

    Example:
        >>> step, specs = residual_mlp(jax.nn.relu, True)
        >>> [p.shape for p in specs[0][0]], specs[1].shape
        ([(64, 256), (256,), (256, 64)], (8, 128, 64))
    """
    def loss(ps: Any, x: jax.Array) -> jax.Array:
        for w1, b1, w2 in ps:
            pre = x @ w1
            x = x + act(pre + b1 if bias else pre) @ w2
        return jnp.mean(x ** 2)

    spec = jax.ShapeDtypeStruct
    layer = (spec((64, 256), jnp.float32), spec((256,), jnp.float32),
             spec((256, 64), jnp.float32))
    return jax.grad(loss), ([layer] * 3, spec((8, 128, 64), jnp.float32))


def against_xla(step: Callable[..., Any], args: Sequence[Any]) -> dict[str, Any]:
    """XLA's peak of ``jax.jit(step)`` at ``args`` and the memory model's for the order
    XLA's scheduler picks (no plan), with the relative error."""
    xla = jaxmem.xla_peak_bytes(jax.jit(step).lower(*args).compile())
    graph = build_graph(jax.make_jaxpr(step)(*args))
    dom = ShapeDomain.from_constraints((), ())
    predicted = int(memory_model(graph, dom, backend=jax.default_backend()).peak_bytes)
    return {"xla_peak_bytes": xla, "predicted_peak_bytes": predicted,
            "error": (predicted - xla) / xla}


def peak_columns(row: dict[str, Any]) -> str:
    """A row's XLA peak, predicted peak (MiB) and error, as table columns."""
    return (f"{row['xla_peak_bytes'] / 2**20:8.2f} {row['predicted_peak_bytes'] / 2**20:14.2f} "
            f"{row['error']:+7.1%}")


def finish(log: TextTable, args: argparse.Namespace, rows: Sequence[dict[str, Any]],
           noun: str, table: str) -> None:
    """Logs the summary line (median and worst |error|, how many within 6 %), saves the
    table as ``table`` and the rows as ``--out``."""
    errors = [abs(r["error"]) for r in rows]
    log(f"{len(rows)} {noun}: median |error| {statistics.median(errors):.1%}, worst "
        f"{max(errors):.1%}, {sum(e <= 0.06 for e in errors)} within 6 %")
    log.save(args, table)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": list(rows)}, indent=1))


def measure(name: str, bias: bool) -> dict[str, Any]:
    """XLA's peak and the model's for one activation, with or without biases."""
    return {"activation": name, "bias": bias,
            **against_xla(*residual_mlp(ACTIVATIONS[name], bias))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    add_output_arguments(parser, "residual_mlps.json")
    args = parser.parse_args(argv)
    log = TextTable()
    log("activation  bias   xla MiB  predicted MiB   error")
    rows = []
    for name in QUICK if args.quick else ACTIVATIONS:
        for bias in (False, True):
            row = measure(name, bias)
            rows.append(row)
            log(f"{name:11s} {'yes' if bias else 'no':4s} {peak_columns(row)}")
    finish(log, args, rows, "steps", "residual_mlps.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
