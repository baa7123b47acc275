"""A compact ASCII plot of an ``HloTimeline`` (``format_timeline``).

The plot lives in :mod:`hlo_passes.timeline`, next to the data it draws (so that
``str(timeline)`` needs no import back here); this module re-exports it.
"""

from __future__ import annotations

from hlo_passes.timeline import format_timeline
from jaxmem.units import human_bytes

__all__ = ["format_timeline", "human_bytes"]
