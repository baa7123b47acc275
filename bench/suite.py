"""Several workloads in one ``bench.compare`` run: which ones, their grids, one merged result.

Workloads: ``llama`` (the project's Llama, :mod:`bench.workload`), ``gpt`` (the
plain-JAX decoder with a Python loop over layers and no named scopes) and
``gpt-scan`` (its ``lax.scan`` twin; both :mod:`bench.decoders`) and ``gpt-tokens``
(the plain GPT on the 2-D token-budget domain ``b*s <= T``, :mod:`bench.tokens`). Each has its own
budget (``--budget-fraction`` of plain XLA's peak at its largest shape; ``--budget``
applies to the Llama only) and its own shape grid.

The merged result keeps docs/design.md §2's keys for the first workload (``budget_bytes``,
``epoch``, ``coverage``, ``workload``), holds every workload's rows in ``rows`` (each
row names its ``workload``), each workload's own figures under ``workloads``, its
budget under ``budgets``, and ``summary`` and ``checks`` over all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from bench.checks import must_show
from bench.oracle import summary

#: workload names accepted by ``--workloads``
WORKLOADS = ("llama", "gpt", "gpt-scan", "gpt-tokens")


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """How one program workload is sized and sampled.

    Attributes:
        layers, d: the decoder's depth and width.
        max_len: longest sequence kept from the data.
        batch: batch sizes of the grid.
        quantiles: quantiles of the batcher's per-batch longest length.
        repeats: timed repeats (the programs are small: more repeats cost little).
    """

    layers: int
    d: int
    max_len: int
    batch: tuple[int, ...]
    quantiles: tuple[float, ...]
    repeats: int


def program_grid(quick: bool) -> GridSpec:
    """The decoders' size and grid: small in ``--quick`` (about a minute each on 2 cores)."""
    if quick:
        return GridSpec(3, 128, 256, (4,), (0.5, 1.0), 5)
    return GridSpec(4, 256, 512, (4, 8), (0.25, 0.5, 0.75, 0.9, 1.0), 7)


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from per-workload ones (the first is the primary workload)."""
    if not results:
        return {"budget_bytes": None, "rows": [], "epoch": {}}
    first = results[0]
    keep = ("budget_bytes", "epoch", "epoch_detail", "coverage", "config", "figures", "wall_s",
            "regions", "processes")
    out: dict[str, Any] = {**first}
    out["rows"] = [r for res in results for r in res.get("rows", [])]
    out["budgets"] = {res["workload"]: res["budget_bytes"] for res in results}
    out["workloads"] = {res["workload"]: {k: res[k] for k in keep if k in res}
                        for res in results}
    out["summary"] = summary(out["rows"])
    out["checks"] = must_show(out)
    if len(results) > 1:
        out["wall_s"] = round(sum(res.get("wall_s", 0.0) for res in results), 1)
    return out
