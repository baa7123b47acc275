"""Analyses of a compiled, scheduled XLA executable (``jax.stages.Compiled``).

* ``buffer_timeline``: XLA's memory timeline over the ENTRY schedule, from XLA's
  own buffer assignment when the executable exposes it (the HLO text otherwise);
  its ``peak_bytes`` reconstructs ``xla_peak_bytes`` (docs/design.md §2).
* ``order_survival``: whether a requested op order survived XLA's scheduler.
* ``format_timeline``: an ASCII plot of a timeline, for logs and debugging.

On CPU, compile with ``compiler_options={"xla_disable_hlo_passes":
"cse_barrier_expander"}`` so that optimization barriers (and with them remat and
requested orders) reach the scheduled HLO at all.
"""

from hlo_passes.hlo_text import HloModuleText, parse_hlo_module
from hlo_passes.order import OrderSurvival, marker_positions, order_survival
from hlo_passes.timeline import (
    HloBuffer,
    HloTimeline,
    buffer_timeline,
    format_timeline,
    human_bytes,
    xla_peak_bytes,
)

__all__ = [
    "HloBuffer",
    "HloModuleText",
    "HloTimeline",
    "OrderSurvival",
    "buffer_timeline",
    "format_timeline",
    "human_bytes",
    "marker_positions",
    "order_survival",
    "parse_hlo_module",
    "xla_peak_bytes",
]
