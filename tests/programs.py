"""Shared test programs: small train steps, XLA's peak as the oracle, and the error bounds.

The programs themselves live in :mod:`bench.programs` (the accuracy benchmark runs
the same steps at larger sizes); this module picks sizes that compile in about a
second on two CPU cores and states the accuracy jaxmem documents for them.

Error bounds (relative error of ``Report.peak_bytes_at`` against XLA's
``argument + output - alias + temp``), the targets of issue 2, measured by
``python -m bench.accuracy``:

* ``MEDIAN_BOUND``: the median over a program's shapes is at most 10 %;
* ``WORST_BOUND``: every shape is within 25 %.

Issue 12 tightens these to ``ISSUE_MEDIAN_BOUND`` (3 %) and ``ISSUE_WORST_BOUND``
(10 %) over all programs, scanned and bf16-compute ones included; ``MET_BOUNDS``
says, per program, the (median, worst) each one meets today where that is looser.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from bench.accuracy import polymorphic_shapes
from bench.programs import (
    Program,
    attention_program,
    gpt_program,
    gpt_scan_program,
    llama_program,
    mlp_program,
    reshape_program,
    xla_peak,
)

MEDIAN_BOUND = 0.10
WORST_BOUND = 0.25
ISSUE_MEDIAN_BOUND = 0.03
ISSUE_WORST_BOUND = 0.10
#: (median, worst) met where the issue's bounds are not (measured, see README): the
#: scanned GPT misses the median (4.0 %). (The bf16 GPT meets them since session 38.)
MET_BOUNDS = {"gpt_scan": (0.07, ISSUE_WORST_BOUND)}

__all__ = ["MEDIAN_BOUND", "WORST_BOUND", "Program", "attention_program", "bf16_attention_args",
           "bf16_attention_step", "errors_against_xla",
           "gpt_program", "llama_program", "mlp_program", "reshape_program", "relative_error",
           "small_attention", "small_gpt", "small_gpt_bf16", "small_gpt_scan",
           "small_llama_bf16", "small_mlp", "small_reshape", "xla_peak"]


def small_mlp() -> Program:
    """A 2-hidden-layer MLP step (AdamW), dims ``b``."""
    return mlp_program(d_in=128, hidden=256, layers=2, classes=10, max_b=2048)


def small_attention() -> Program:
    """One attention block with an ``s x s`` score tensor (AdamW), dims ``b, s``."""
    return attention_program(d=64, heads=2, vocab=64, max_b=8, max_s=256)


def small_reshape() -> Program:
    """``f32[b, 2*s]`` viewed as ``[b*s, 2]`` plus a ``floordiv(s + 1, 2)`` slice (Adam)."""
    return reshape_program(width=64, max_b=32, max_s=512)


def small_gpt() -> Program:
    """A 2-layer GPT-like LM step (LayerNorm, attention, GELU MLP, optax CE, AdamW)."""
    return gpt_program(layers=2, d=64, heads=2, vocab=64, max_b=8, max_s=256)


def small_gpt_bf16() -> Program:
    """:func:`small_gpt` with bf16 compute (float32 parameters and AdamW state)."""
    return gpt_program(layers=2, d=64, heads=2, vocab=64, max_b=8, max_s=256,
                       dtype=jnp.bfloat16)


def small_gpt_scan() -> Program:
    """:func:`small_gpt` with ``lax.scan`` over stacked layer parameters."""
    return gpt_scan_program(layers=2, d=64, heads=2, vocab=64, max_b=8, max_s=256)


def small_gpt_scan_bf16() -> Program:
    """:func:`small_gpt_scan` with bf16 compute (float32 parameters and AdamW state)."""
    return gpt_scan_program(layers=2, d=64, heads=2, vocab=64, max_b=8, max_s=256,
                            dtype=jnp.bfloat16)


def small_linen_bf16() -> Program:
    """A 2-layer Flax linen decoder with ``dtype=bfloat16`` modules (its softmax in bf16)."""
    from bench.linen_programs import linen_bf16_program

    return linen_bf16_program(layers=2, d=64, heads=4, vocab=128, max_b=8, max_s=256)


def small_llama_bf16() -> Program:
    """The ``tiny`` Flax NNX Llama with bf16 compute, as the ``1b`` preset trains."""
    return llama_program("tiny", max_b=8, max_s=256, dtype="bf16")


def bf16_attention_step(params: Any, tokens: jax.Array) -> Any:
    """A 2-layer decoder's loss and gradient in bfloat16, parameters too: heads indexed
    off one q/k/v projection, einsums with their batch dims inside (XLA copies the heads
    transposed), a float32 softmax. Its arguments: :func:`bf16_attention_args`."""
    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["emb"][tokens]
        for lp in p["layers"]:
            h = (x @ lp["qkv"]).reshape(*x.shape[:2], 3, 4, -1)
            scores = jnp.einsum("bqhd,bkhd->bhqk", h[:, :, 0], h[:, :, 1])
            probs = jax.nn.softmax(scores.astype(jnp.float32)).astype(jnp.bfloat16)
            a = jnp.einsum("bhqk,bkhd->bqhd", probs, h[:, :, 2])
            x = x + a.reshape(x.shape) @ lp["o"]
        return jnp.mean((x @ p["emb"].T).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss)(params, tokens)


def bf16_attention_args(b: int, s: int) -> tuple[Any, jax.Array]:
    """:func:`bf16_attention_step`'s parameters (width 64, 4 heads) and ``[b, s]`` tokens."""
    keys = iter(jax.random.split(jax.random.key(0), 5))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.bfloat16)  # noqa: E731
    params = {"emb": normal(128, 64),
              "layers": [{"qkv": normal(64, 192), "o": normal(64, 64)} for _ in range(2)]}
    return params, jnp.zeros((b, s), jnp.int32)


def deepest_level_lowers_and_matches(f: jaxmem.Jitted, args: Sequence[Any],
                                     step: Callable[..., Any]) -> None:
    """Asserts that ``f``'s deepest level has a lower XLA peak than its level 0 and computes
    ``jax.jit(step)``'s outputs (``f`` then runs that level for ``args``' shapes)."""
    levels = f.plans(*args).levels
    deepest = f.compile_level(len(levels) - 1, *args)
    assert deepest.peak_bytes < f.compile_level(0, *args).peak_bytes
    f.use_plan(deepest, *args)
    for x, y in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(jax.jit(step)(*args)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def relative_error(predicted: int, actual: int) -> float:
    """Signed relative error (positive: jaxmem over-predicts)."""
    return (predicted - actual) / actual


def analyze_program(program: Program) -> jaxmem.Report:
    """``jaxmem.analyze`` on a program's symbolic specs (warnings about unknown ops muted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        return jaxmem.analyze(program.step, *program.symbolic_args())


def errors_against_xla(program: Program, shapes: Sequence[Mapping[str, int]]
                       ) -> list[tuple[dict[str, int], int, int, float]]:
    """(shape, xla_peak, predicted, relative error) for each shape, one analysis for all."""
    report = analyze_program(program)
    rows = []
    for dims in shapes:
        actual = xla_peak(program, dims)
        predicted = report.peak_bytes_at(**dims)
        rows.append((dict(dims), actual, predicted, relative_error(predicted, actual)))
    return rows


def level_error(program: Program, level: int, dims: Mapping[str, int]) -> float:
    """Relative error of ``jaxmem.jit``'s prediction for plan level ``level`` at ``dims``
    against XLA's peak of that level's executable (the batch symbolic, the state not)."""
    f = jaxmem.jit(program.step, polymorphic_shapes=polymorphic_shapes(program),
                   constraints=program.constraints)
    plan = f.compile_level(level, *program.concrete_args(dims))
    return relative_error(plan.predicted_peak_bytes, plan.peak_bytes)


def within_bounds(rows: Sequence[tuple[dict[str, int], int, int, float]]) -> str | None:
    """None when the rows meet the documented bounds, else a message with the table."""
    errs = [abs(r[3]) for r in rows]
    if statistics.median(errs) <= MEDIAN_BOUND and max(errs) <= WORST_BOUND:
        return None
    table = "\n".join(f"  {d}: xla={a} predicted={p} error={100 * e:+.1f}%" for d, a, p, e in rows)
    return (f"median |error| {100 * statistics.median(errs):.1f}% (bound "
            f"{100 * MEDIAN_BOUND:.0f}%), worst {100 * max(errs):.1f}% (bound "
            f"{100 * WORST_BOUND:.0f}%):\n{table}")
