"""A compact ASCII plot of an ``HloTimeline``."""

from __future__ import annotations

from hlo_passes.timeline import HloTimeline
from jaxmem._units import human_bytes


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def format_timeline(timeline: HloTimeline, width: int = 60, height: int = 8, top: int = 8) -> str:
    """Render live bytes over program points, mark the peak, list what is live there.

    Each column is the maximum over the program points it covers; the baseline is
    the resident bytes (arguments + outputs - aliases), so the rising part is temp.

    Args:
        timeline: from ``buffer_timeline``.
        width: number of columns of the plot.
        height: number of rows of the plot.
        top: how many of the largest buffers live at the peak to list.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from hlo_passes.timeline import buffer_timeline
        >>> c = jax.jit(lambda x: jnp.sin(x @ x.T).sum()).lower(jnp.ones((64, 8))).compile()
        >>> print(format_timeline(buffer_timeline(c), width=20).splitlines()[0][:11])
        HloTimeline
    """
    curve = timeline.timeline_bytes
    n = len(curve)
    width = max(1, width)
    # Column c covers points [c*n//width, (c+1)*n//width), at least one point; with
    # fewer points than columns a point spans several columns.
    spans = [(c * n // width, max((c + 1) * n // width, c * n // width + 1)) for c in range(width)]
    cols = [max(curve[a:b]) for a, b in spans]
    lo, hi = timeline.resident_bytes, max(curve)
    span = max(hi - lo, 1)
    xla = "" if timeline.xla_peak_bytes is None else (
        f"  xla {human_bytes(timeline.xla_peak_bytes)}"
        + (f" ({timeline.relative_error:+.2%})" if timeline.relative_error is not None else ""))
    lines = [
        f"HloTimeline {timeline.module} [{timeline.source}] peak {human_bytes(timeline.peak_bytes)}"
        f" at #{timeline.peak_index} {timeline.peak_instruction}{xla}",
        f"  args {human_bytes(timeline.argument_bytes)} + outputs "
        f"{human_bytes(timeline.output_bytes)} - alias {human_bytes(timeline.alias_bytes)}"
        f" + temp {human_bytes(timeline.temp_bytes)}  (plot baseline: resident bytes)",
    ]
    for row in range(height, 0, -1):
        level = lo + span * (row - 0.5) / height
        bar = "".join("#" if v >= level else " " for v in cols)
        label = human_bytes(lo + span * row / height) if row in (height, 1) else ""
        lines.append(f"{label:>10} |{bar}")
    peak_col = next(c for c, (a, b) in enumerate(spans) if a <= timeline.peak_index < b)
    lines.append(f"{human_bytes(lo):>10} +{'-' * width}")
    lines.append(f"{'':>10}  {' ' * peak_col}^ peak (#{timeline.peak_index} of {n})")
    lines.append(f"  live at peak (largest {min(top, len(timeline.live_at_peak))} of "
                 f"{len(timeline.live_at_peak)}):")
    for b in timeline.live_at_peak[:top]:
        lines.append(f"    {human_bytes(b.size_bytes):>10}  {b.accounted_as:<8} "
                     f"{_clip(b.name, 28):<28} {_clip(b.shape, 24):<24} {_clip(b.op_name, 70)}")
    return "\n".join(lines)
