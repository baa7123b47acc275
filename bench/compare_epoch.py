"""The epoch figure: real (non-pad) tokens per second over one pass of the data.

Batches come from the training loop's own length-grouped batcher
(:class:`train.batching.LengthGroupedBatcher`), so every batch has the lengths the
fine-tune would see. Per method, each batch runs at the length that method needs:

* ``xla``: the batch's own longest length (a new exact shape recompiles),
* ``jaxmem``: the same exact shape (planned once, one executable per shape),
* ``pad-max``: the longest length of the data set (one executable),
* ``buckets``: the power-of-two bucket of the batch's longest length.

Compile time (planning included) is counted separately from run time; tokens/s
is reported both excluding and including it.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from bench.methods import Methods
from train.batching import LengthGroupedBatcher

EPOCH_METHODS = ("jaxmem", "pad-max", "buckets", "xla")


def epoch_batches(lengths: np.ndarray, batch_size: int, n_batches: int | None,
                  seed: int = 0) -> list[np.ndarray]:
    """Example indices of the first ``n_batches`` batches of epoch 0 (None: all)."""
    batcher = LengthGroupedBatcher(lengths, batch_size, seed)
    batches = list(batcher.epoch(0))
    return batches if n_batches is None else batches[:n_batches]


def _run_method(methods: Methods, method: str, batches: list[np.ndarray]) -> dict[str, Any]:
    w = methods.w
    compile_s = run_s = 0.0
    tokens = 0
    peaks: list[int] = []
    shapes: set[tuple[int, int]] = set()
    skipped = 0
    for idx in batches:
        b, s = len(idx), int(w.lengths[idx].max())
        p = methods.prepare(method, b, s)
        compile_s += p.compile_s
        peaks.append(p.peak_bytes)
        if p.call is None:  # jaxmem found no plan within the budget: the batch is lost
            skipped += 1
            continue
        shapes.add((b, p.run_s))
        batch = w.batch(b, p.run_s, idx)
        compiled_call = _runner(methods, method, b, s, p.run_s)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled_call(w.state, batch))
        run_s += time.perf_counter() - t0
        tokens += int(w.lengths[idx].sum())
    budget = methods.budget_bytes
    analysis_s = methods.analysis_s.get(id(methods.jaxmem), 0.0) if method == "jaxmem" else 0.0
    compile_s += analysis_s
    return {
        "analysis_s": round(analysis_s, 3),
        "tokens": tokens, "batches": len(batches), "skipped_batches": skipped,
        "run_s": round(run_s, 4), "compile_s": round(compile_s, 3),
        "executables": len(shapes),
        "tokens_per_s": tokens / run_s if run_s else 0.0,
        "tokens_per_s_incl_compile": tokens / (run_s + compile_s) if run_s else 0.0,
        "max_peak_bytes": max(peaks) if peaks else 0,
        "fits_budget": budget is None or (not skipped and max(peaks) <= budget),
    }


def _runner(methods: Methods, method: str, b: int, s: int, run_s: int) -> Any:
    """What runs a real batch: the cached executable (plain) or the jaxmem dispatcher."""
    if method == "jaxmem":
        return methods.jaxmem
    compiled, _ = methods.compiled("xla", b, run_s)
    return compiled


def epoch_figure(methods: Methods, batches: list[np.ndarray],
                 which: tuple[str, ...] = EPOCH_METHODS, log: Any = print
                 ) -> tuple[dict[str, float], dict[str, Any]]:
    """Runs every method over ``batches`` once (after the grid has warmed caches).

    Returns:
        ``(epoch, detail)``: tokens/s excluding compile per method, and per method the
        tokens, run and compile seconds, tokens/s including compile, executables used,
        largest peak and whether it stayed within the budget.
    """
    epoch: dict[str, float] = {}
    detail: dict[str, Any] = {}
    for method in which:
        t0 = time.perf_counter()
        d = _run_method(methods, method, batches)
        epoch[method] = d["tokens_per_s"]
        detail[method] = d
        log(f"  epoch {method:<8} {d['tokens_per_s']:9.0f} tok/s run-only, "
            f"{d['tokens_per_s_incl_compile']:9.0f} tok/s incl. compile "
            f"({d['executables']} executables, compile {d['compile_s']:.1f}s, "
            f"{time.perf_counter() - t0:.1f}s wall)")
    return epoch, detail
