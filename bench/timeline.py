"""XLA's memory timeline vs jaxmem's model of it, for one shape (optional figure).

XLA's side comes from ``hlo_passes.buffer_timeline`` on the plain ``jax.jit``
executable; jaxmem's from ``jaxmem.analyze(...).timeline_at(b=..., s=...)`` (temp
bytes per program point) plus its resident argument and output bytes, so both
curves are in docs/design.md §2 terms. Returns None where ``hlo_passes`` is missing.
"""

from __future__ import annotations

from pathlib import Path

import jax
import sympy

import jaxmem
from bench.figures import plot_timelines
from bench.methods import Methods
from bench.workload import Workload


def jaxmem_curve(w: Workload, b: int, s: int, max_b: int, max_s: int,
                 report: jaxmem.Report | None = None) -> list[int]:
    """jaxmem's predicted live bytes (resident + temp) per program point at ``(b, s)``.

    ``report``: a symbolic ``jaxmem.analyze`` report of the step over ``b, s`` to reuse.
    """
    if report is None:
        bs, ss = jax.export.symbolic_shape("b, s",
                                           constraints=(f"b <= {max_b}", f"s <= {max_s}"))
        specs = {k: jax.ShapeDtypeStruct((bs, ss), v.dtype) for k, v in w.batch(1, 1).items()}
        report = jaxmem.analyze(w.train_step, w.state, specs)
    mem = report.memory
    point = {"b": b, "s": s}
    expr = sympy.sympify(mem.argument_bytes + mem.output_bytes - mem.alias_bytes)
    resident = int(expr.subs({x: point[str(x)] for x in expr.free_symbols}))
    return [resident + t for t in report.timeline_at(**point)]


def timeline_figure(w: Workload, m: Methods, b: int, s: int, path: Path,
                    report: jaxmem.Report | None = None) -> Path | None:
    """Writes the figure for ``(b, s)``; None when ``hlo_passes.buffer_timeline`` is absent."""
    try:
        from hlo_passes import buffer_timeline
    except ImportError:
        return None
    compiled, _ = m.compiled("xla", b, s)
    xla = buffer_timeline(compiled)
    ours = jaxmem_curve(w, b, s, m.max_b, m.max_s, report)
    label = (f"{w.name} (b={b}, s={s}): XLA peak {xla.peak_bytes / 2**20:.0f} MiB, "
             f"jaxmem model peak {max(ours) / 2**20:.0f} MiB")
    return plot_timelines(list(xla.timeline_bytes), ours, label, path, m.budget_bytes)
