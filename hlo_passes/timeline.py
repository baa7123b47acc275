"""XLA's memory timeline of a compiled, scheduled executable.

``buffer_timeline`` reads the ENTRY computation of the scheduled HLO (its
printed order is the execution order) and places every buffer on it:

* ``source="buffer_assignment"`` (preferred, used whenever available): the
  allocations, offsets and logical buffers XLA itself assigned, decoded from
  ``memory_analysis().serialized_buffer_assignment_proto``. Argument, output and
  alias bytes are then exact; temp bytes at a program point are the bytes of the
  temp allocation(s) covered by live buffers (buffers sharing bytes counted once).
* ``source="hlo_text"`` (fallback, works on any HLO text): the same timeline with
  XLA's buffer assignment emulated (see ``hlo_passes.fallback``).

Peak bytes follow docs/design.md §2: ``argument + output - alias + temp``, with
temp reconstructed as the maximum over program points of live temp bytes. XLA's own
temp size is its packed heap, which adds alignment padding and fragmentation on
top of that maximum, so the reconstruction is a (usually tight) lower bound.
``format_timeline`` (also ``str(timeline)``) draws a timeline as ASCII.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hlo_passes.fallback import emulate_assignment, sub_computation_peaks
from hlo_passes.hlo_text import (
    ArrayShape,
    HloModuleText,
    Shape,
    TupleShape,
    parse_hlo_module,
    subshape,
)
from hlo_passes.liveness import Liveness, analyze, caller_positions
from hlo_passes.xla_proto import BufferAssignment, read_buffer_assignment
from jaxmem import xla_peak_bytes
from jaxmem.units import human_bytes

Source = Literal["auto", "buffer_assignment", "hlo_text"]


@dataclass(frozen=True)
class HloBuffer:
    """One buffer on the timeline.

    Attributes:
        name: ``instruction`` or ``instruction[i,...]`` for a tuple element.
        instruction: the defining HLO instruction.
        computation: where it is defined (ENTRY, or a while body / branch / callee,
            whose buffers are placed at the ENTRY instruction running it).
        shape_index: index inside the instruction's (tuple) output.
        shape: printed shape with layout, e.g. ``f32[8,32]{1,0}``.
        dtype: element type, or ``"tuple"`` for a tuple's pointer table.
        dims: dimensions (a tuple table: its element count).
        size_bytes: bytes the buffer occupies.
        kind: role in the program: parameter, output, temp or constant.
        start: first ENTRY position it is live at (inclusive).
        end: last ENTRY position it is live at (inclusive).
        op_name: ``metadata.op_name`` of the defining instruction (JAX's name stack).
        accounted_as: where memory_analysis counts its bytes: argument, output, temp,
            constant, thread_local or host. A temp that XLA stored inside an output
            allocation is ``kind="temp"`` but ``accounted_as="output"``.
        allocation: XLA's allocation index (buffer-assignment source only).
        offset: byte offset inside that allocation (buffer-assignment source only).
    """

    name: str
    instruction: str
    computation: str
    shape_index: tuple[int, ...]
    shape: str
    dtype: str
    dims: tuple[int, ...]
    size_bytes: int
    kind: str
    start: int
    end: int
    op_name: str
    accounted_as: str
    allocation: int | None = None
    offset: int | None = None

    def live_at(self, position: int) -> bool:
        return self.start <= position <= self.end


@dataclass(frozen=True, repr=False)
class HloTimeline:
    """Live bytes of an executable over its ENTRY program points.

    ``timeline_bytes[t] = argument_bytes + output_bytes - alias_bytes + live temp
    bytes at t``: arguments and outputs are allocated for the whole run, as
    memory_analysis counts them. ``peak_bytes`` is its maximum.
    """

    module: str
    source: str
    instructions: tuple[str, ...]
    op_names: tuple[str, ...]
    buffers: tuple[HloBuffer, ...]
    timeline_bytes: tuple[int, ...]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    peak_index: int
    live_at_peak: tuple[HloBuffer, ...]
    xla_peak_bytes: int | None = None
    xla_temp_bytes: int | None = None

    @property
    def resident_bytes(self) -> int:
        """Bytes held for the whole run: arguments + outputs - donated aliases."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def peak_instruction(self) -> str:
        return self.instructions[self.peak_index] if self.instructions else ""

    @property
    def relative_error(self) -> float | None:
        """(peak_bytes - xla_peak_bytes) / xla_peak_bytes, when XLA's peak is known."""
        if not self.xla_peak_bytes:
            return None
        return (self.peak_bytes - self.xla_peak_bytes) / self.xla_peak_bytes

    def __repr__(self) -> str:
        xla = "?" if self.xla_peak_bytes is None else f"{self.xla_peak_bytes:,}"
        return (f"HloTimeline({self.module!r}, source={self.source!r}, "
                f"points={len(self.instructions)}, buffers={len(self.buffers)}, "
                f"peak_bytes={self.peak_bytes:,} at {self.peak_instruction!r}, "
                f"xla_peak_bytes={xla})")

    def __str__(self) -> str:
        return format_timeline(self)


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


def _shape_fields(shape: Shape) -> tuple[str, str, tuple[int, ...]]:
    if isinstance(shape, TupleShape):
        return str(shape), "tuple", (len(shape.elements),)
    assert isinstance(shape, ArrayShape)
    return str(shape), shape.dtype, shape.dims


def _accounted_as(alloc: Any) -> str:
    if alloc.on_host:
        return "host"
    if alloc.is_parameter:
        return "argument"
    if alloc.maybe_live_out:
        return "output"
    if alloc.is_constant:
        return "constant"
    return "thread_local" if alloc.is_thread_local else "temp"


Slice = tuple[Hashable, int, int]  # (group, offset, size): same group = same memory


def _exact_buffers(
    module: HloModuleText, live: Liveness, assignment: BufferAssignment,
    names: dict[int, tuple[str, str]],
) -> tuple[list[tuple[HloBuffer, Slice]], tuple[int, int, int]]:
    n = live.length
    values = {v.id: v for v in live.values}
    callers = caller_positions(module)
    lookups = {name: comp.by_name() for name, comp in module.computations.items()}
    aliased = {(a.parameter, a.parameter_index) for a in module.input_output_alias}
    out: list[tuple[HloBuffer, Slice]] = []
    arg = output = alias = 0
    for alloc in assignment.allocations:
        where = _accounted_as(alloc)
        arg += alloc.size if where == "argument" else 0
        output += alloc.size if alloc.maybe_live_out and not alloc.on_host else 0
        if where == "argument" and (alloc.parameter_number, alloc.parameter_index) in aliased:
            alias += alloc.size
        for buffer_id, offset, size in alloc.assigned:
            logical = assignment.buffers.get(buffer_id)
            comp, instr = names.get(logical.instruction_id, ("", "")) if logical else ("", "")
            index = logical.shape_index if logical else ()
            ins = lookups.get(comp, {}).get(instr)
            start, end, kind = 0, n - 1, "temp"
            if comp == module.entry_name and instr in live.trees:
                vid = live.trees[instr].get(index)
                if vid is not None:
                    v = values[vid]
                    start, end, kind = v.start, v.end, v.kind
            elif comp in callers and callers[comp] >= 0:
                start = end = callers[comp]
            if ins is not None:
                shape, dtype, dims = _shape_fields(subshape(ins.shape, index))
                kind = "constant" if ins.opcode == "constant" else kind
                if ins.opcode == "parameter" and comp == module.entry_name:
                    kind = "parameter"
            else:
                shape, dtype, dims = "?", "?", ()
            label = (instr or f"<buffer {buffer_id}>") + (
                str(list(index)).replace(" ", "") if index else "")
            buffer = HloBuffer(label, instr, comp, index, shape, dtype, dims, size, kind, start,
                               end, ins.op_name if ins else "", where, alloc.index, offset)
            out.append((buffer, (alloc.index, offset, size)))
    return out, (arg, output, alias)


def _fallback_buffers(
    module: HloModuleText, live: Liveness,
) -> tuple[list[tuple[HloBuffer, Slice]], tuple[int, int, int]]:
    placements = emulate_assignment(module, live)
    by_name = module.entry.by_name()
    aliased = {(a.parameter, a.parameter_index) for a in module.input_output_alias}
    out: list[tuple[HloBuffer, Slice]] = []
    slot_sizes: dict[tuple[str, int], int] = {}
    arg = alias = 0
    for v in live.values:
        p = placements[v.id]
        shape, dtype, dims = _shape_fields(v.shape)
        if v.kind == "parameter" and p.accounted_as == "argument":
            arg += v.size_bytes
            if (by_name[v.instruction].parameter_number, v.index) in aliased:
                alias += v.size_bytes
                slot_sizes[("output", p.slot)] = v.size_bytes
        elif p.accounted_as == "output":
            key = ("output", p.slot)
            slot_sizes[key] = max(slot_sizes.get(key, 0), v.size_bytes)
        buffer = HloBuffer(v.name, v.instruction, module.entry_name, v.index, shape, dtype, dims,
                           v.size_bytes, v.kind, v.start, v.end, v.op_name, p.accounted_as)
        out.append((buffer, (("slot", p.slot), 0, v.size_bytes)))
    for pos, comp, peak in sub_computation_peaks(module):
        caller = module.entry.instructions[pos]
        buffer = HloBuffer(f"{caller.name}/{comp}", caller.name, comp, (), "", "", (), peak,
                           "temp", pos, pos, caller.op_name, "temp")
        out.append((buffer, (("sub", pos, comp), 0, peak)))
    return out, (arg, sum(slot_sizes.values()), alias)


def _union(slices: Counter[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for offset, size in sorted(k for k, c in slices.items() if c > 0):
        lo, hi = max(offset, reach), offset + size
        if hi > lo:
            total += hi - lo
        reach = max(reach, hi)
    return total


def temp_curve(entries: Sequence[tuple[HloBuffer, Slice]], length: int) -> list[int]:
    """Live temp bytes at each position; slices of one group that overlap count once."""
    starts: dict[int, list[Slice]] = defaultdict(list)
    ends: dict[int, list[Slice]] = defaultdict(list)
    for buffer, piece in entries:
        if buffer.accounted_as == "temp" and piece[2] > 0:
            starts[max(0, min(buffer.start, length - 1))].append(piece)
            ends[max(0, min(buffer.end, length - 1))].append(piece)
    live: dict[Hashable, Counter[tuple[int, int]]] = defaultdict(Counter)
    group_bytes: dict[Hashable, int] = {}
    curve, total = [], 0

    def update(changed: set[Hashable]) -> None:
        nonlocal total
        for group in changed:
            new = _union(live[group])
            total += new - group_bytes.get(group, 0)
            group_bytes[group] = new

    for t in range(length):
        for group, offset, size in starts.get(t, ()):
            live[group][(offset, size)] += 1
        update({g for g, _, _ in starts.get(t, ())})
        curve.append(total)
        for group, offset, size in ends.get(t, ()):
            live[group][(offset, size)] -= 1
        update({g for g, _, _ in ends.get(t, ())})
    return curve


def buffer_timeline(compiled: Any, *, source: Source = "auto") -> HloTimeline:
    """Reconstruct XLA's memory timeline of a compiled executable.

    Args:
        compiled: a ``jax.stages.Compiled``, or the text of a scheduled HLO module
            (then only ``source="hlo_text"`` is possible and XLA's peak is unknown).
        source: ``"auto"`` uses XLA's buffer assignment when the executable exposes
            it and the HLO text otherwise; the other values force one source.

    Returns:
        The timeline; ``peak_bytes`` is comparable to ``xla_peak_bytes(compiled)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
        >>> c = f.lower(jnp.ones((64, 32))).compile()
        >>> tl = buffer_timeline(c)
        >>> tl.source, tl.peak_bytes <= xla_peak_bytes(c)
        ('buffer_assignment', True)
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    module = parse_hlo_module(text)
    live = analyze(module, module.entry)
    exact = None
    if not isinstance(compiled, str) and source != "hlo_text":
        exact = read_buffer_assignment(compiled)
    if exact is None and source == "buffer_assignment":
        raise ValueError("this executable does not expose its buffer assignment")
    if exact is not None:
        entries, (arg, out, alias) = _exact_buffers(module, live, *exact)
        unresolved = sum(b.shape == "?" for b, _ in entries)
        if unresolved > 0.1 * len(entries) and source == "auto":
            exact = None  # ids do not match this module's text: do not trust the mapping
    if exact is None:
        entries, (arg, out, alias) = _fallback_buffers(module, live)
    n = max(live.length, 1)
    temps = temp_curve(entries, n)
    resident = arg + out - alias
    curve = tuple(resident + t for t in temps)
    peak_index = max(range(n), key=lambda t: (curve[t], -t))
    at_peak = sorted((b for b, _ in entries if b.live_at(peak_index)
                      and b.accounted_as in ("argument", "output", "temp")),
                     key=lambda b: (-b.size_bytes, b.name))
    xla_peak = xla_temp = None
    if not isinstance(compiled, str):
        try:
            xla_peak = xla_peak_bytes(compiled)
            xla_temp = compiled.memory_analysis().temp_size_in_bytes
        except Exception:  # backends without memory_analysis: leave XLA's numbers unknown
            pass
    return HloTimeline(
        module=module.name, source="buffer_assignment" if exact else "hlo_text",
        instructions=tuple(i.name for i in module.entry.instructions),
        op_names=tuple(i.op_name for i in module.entry.instructions),
        buffers=tuple(b for b, _ in entries), timeline_bytes=curve, argument_bytes=arg,
        output_bytes=out, alias_bytes=alias, temp_bytes=max(temps), peak_bytes=curve[peak_index],
        peak_index=peak_index, live_at_peak=tuple(at_peak), xla_peak_bytes=xla_peak,
        xla_temp_bytes=xla_temp)
