"""Where XLA puts each ENTRY value, rebuilt from the HLO text alone.

Used when the executable's buffer assignment cannot be read. It follows the
steps of XLA's BufferAssigner (xla/service/buffer_assignment.cc) closely enough
to land near ``memory_analysis()``:

1. every entry parameter gets its own allocation (``argument``);
2. every value reaching the ROOT gets its own ``output`` allocation, except
   outputs aliased to a donated parameter, which live in that parameter's;
3. a temporary first tries to reuse, without overlapping in time, an allocation
   that is already reserved for the whole run (outputs and donated parameters,
   smallest first), because those bytes are paid for anyway;
4. the remaining temporaries go to the heap (``temp``), where a value may
   overwrite an operand that dies at the same instruction (in-place ops and
   elementwise fusions). XLA packs the heap with a best-fit simulation; the
   maximum over program points of live heap bytes is what that packing
   approaches from below.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlo_passes.hlo_text import (
    HOST_MEMORY_SPACE,
    ArrayShape,
    Computation,
    HloModuleText,
    subshape,
)
from hlo_passes.liveness import CALLERS, Liveness, Value, analyze, in_place_operands


@dataclass(frozen=True)
class Placement:
    """How one value is accounted for, and which memory it occupies.

    Values with the same ``slot`` occupy the same bytes (one allocation, or an
    in-place reuse); a timeline counts a slot once at any program point.
    """

    accounted_as: str  # "argument" | "output" | "temp" | "constant" | "host"
    slot: int


def _same_layout(a: object, b: object) -> bool:
    return (isinstance(a, ArrayShape) and isinstance(b, ArrayShape) and a.dtype == b.dtype
            and a.dims == b.dims and a.layout == b.layout)


def share_sources(module: HloModuleText, live: Liveness) -> dict[int, set[int]]:
    """Value id -> ids of operand values it may overwrite in place."""
    by_name = module.computations[live.computation].by_name()
    out: dict[int, set[int]] = {}
    for v in live.values:
        ins = by_name[v.instruction]
        if v.opcode in ("copy", "parameter", "constant", "tuple"):
            continue
        sources = set()
        for k, index in in_place_operands(module, ins, v.index):
            if k < len(ins.operands):
                operand = by_name.get(ins.operands[k])
                vid = live.trees.get(ins.operands[k], {}).get(index)
                # XLA compares the operand as this user sees it (after any bitcast).
                if (vid is not None and operand is not None
                        and _same_layout(subshape(operand.shape, index), v.shape)):
                    sources.add(vid)
        if sources:
            out[v.id] = sources
    return out


def _interferes(a: Value, b: Value, shares: dict[int, set[int]]) -> bool:
    if a.end < b.start or b.end < a.start:
        return False
    if a.end == b.start:
        return a.id not in shares.get(b.id, set())
    if b.end == a.start:
        return b.id not in shares.get(a.id, set())
    return True


def takeovers(values: list[Value], shares: dict[int, set[int]]) -> dict[int, int]:
    """Value id -> id of the same-sized operand whose bytes it overwrites in place.

    Only an operand that dies exactly where the value is defined qualifies, and
    each operand is taken over at most once.
    """
    by_id = {v.id: v for v in values}
    out: dict[int, int] = {}
    taken: set[int] = set()
    for v in sorted(values, key=lambda v: (v.start, v.id)):
        for src in sorted(shares.get(v.id, ())):
            u = by_id.get(src)
            if (u is not None and src not in taken and u.end == v.start
                    and u.size_bytes == v.size_bytes):
                out[v.id] = src
                taken.add(src)
                break
    return out


def computation_temp_peak(module: HloModuleText, name: str, depth: int = 0) -> int:
    """Most bytes of temporaries ``name`` holds at once (nested calls included).

    Parameters and values reaching the root are excluded: they are the caller's
    buffers (a while loop's state, a conditional's or call's result).
    """
    comp = module.computations.get(name)
    if comp is None or depth > 16:
        return 0
    live = analyze(module, comp)
    temps = [v for v in live.values if v.kind == "temp"]
    reused = set(takeovers(temps, share_sources(module, live)).values())
    delta = [0] * (live.length + 1)
    for v in temps:
        # An operand overwritten in place hands its bytes over where it dies.
        end = v.end - 1 if v.id in reused else v.end
        if end >= v.start:
            delta[v.start] += v.size_bytes
            delta[end + 1] -= v.size_bytes
    peak = running = 0
    for pos, ins in enumerate(comp.instructions):
        running += delta[pos]
        nested = 0
        if ins.opcode in CALLERS:
            nested = max((computation_temp_peak(module, c, depth + 1) for c in ins.called),
                         default=0)
        peak = max(peak, running + nested)
    return peak


def sub_computation_peaks(module: HloModuleText) -> list[tuple[int, str, int]]:
    """(ENTRY position, computation, bytes) for temporaries of while/call/conditional."""
    out = []
    for pos, ins in enumerate(module.entry.instructions):
        if ins.opcode in CALLERS:
            for name in ins.called:
                peak = computation_temp_peak(module, name)
                if peak:
                    out.append((pos, name, peak))
    return out


def post_order(comp: Computation) -> dict[str, int]:
    """Instruction -> position in a depth-first post order from the root.

    BufferAssigner breaks ties between equally sized buffers by post order, which
    is not the schedule order.
    """
    by_name = comp.by_name()
    order: dict[str, int] = {}
    roots = [comp.root.name] + [i.name for i in reversed(comp.instructions)]
    for root in roots:
        stack = [(root, False)]
        while stack:
            name, expanded = stack.pop()
            if name in order or name not in by_name:
                continue
            if expanded:
                order[name] = len(order)
                continue
            stack.append((name, True))
            stack.extend((o, False) for o in reversed(by_name[name].operands) if o not in order)
    return order


@dataclass
class _Allocation:
    size: int
    slot: int
    accounted_as: str
    reusable: bool
    values: list[Value]


def emulate_assignment(module: HloModuleText, live: Liveness) -> dict[int, Placement]:
    """Placement of every ENTRY value, following XLA's buffer assigner."""
    comp = module.entry
    by_name = comp.by_name()
    aliased = {(a.parameter, a.parameter_index): a.output_index for a in module.input_output_alias}
    root_tree = live.trees.get(comp.root.name, {})
    live_out_ids = set(root_tree.values())
    shares = share_sources(module, live)
    order = post_order(comp)
    # HloBuffers: a donated parameter and the output aliased to it are one buffer.
    groups: dict[int, list[Value]] = {v.id: [v] for v in live.values}
    for v in live.values:
        if v.kind == "parameter":
            key = (by_name[v.instruction].parameter_number, v.index)
            out_vid = root_tree.get(aliased[key]) if key in aliased else None
            if out_vid is not None and out_vid != v.id and out_vid in groups:
                groups[v.id].extend(groups.pop(out_vid))
    allocations: list[_Allocation] = []
    reusable: list[_Allocation] = []  # BufferAssigner's allocation_indices
    allocation_of: dict[int, _Allocation] = {}
    heap: list[Value] = []

    def new(size: int, accounted_as: str, held: list[Value], can_reuse: bool) -> _Allocation:
        alloc = _Allocation(size, len(allocations), accounted_as, can_reuse, list(held))
        allocations.append(alloc)
        allocation_of.update((h.id, alloc) for h in held)
        return alloc

    def try_assign(alloc: _Allocation, held: list[Value], live_out: bool) -> bool:
        size = max(h.size_bytes for h in held)
        if not alloc.reusable or size > alloc.size or (live_out and size != alloc.size):
            return False
        if any(_interferes(h, a, shares) for h in held for a in alloc.values):
            return False
        alloc.values.extend(held)
        allocation_of.update((h.id, alloc) for h in held)
        return True

    def sort_key(item: tuple[int, list[Value]]) -> tuple[int, bool, int, int]:
        held = item[1]
        live_out = any(h.id in live_out_ids for h in held)
        first = min(order.get(h.instruction, len(order)) for h in held)
        return (-max(h.size_bytes for h in held), not live_out, first, item[0])

    for _, held in sorted(groups.items(), key=sort_key):
        head = held[0]
        host = any(isinstance(h.shape, ArrayShape) and h.shape.memory_space == HOST_MEMORY_SPACE
                   for h in held)
        live_out = any(h.kind == "output" for h in held)
        if head.kind == "parameter":
            donated = len(held) > 1 or (by_name[head.instruction].parameter_number,
                                        head.index) in aliased
            alloc = new(head.size_bytes, "host" if host else "argument", held, donated)
            if donated:
                reusable.append(alloc)
            continue
        if head.kind == "constant" or host:
            new(head.size_bytes, "constant" if not host else "host", held, False)
            continue
        # Tuple tables never share (on CPU they land in the temp heap).
        if isinstance(head.shape, ArrayShape):
            # First an operand's allocation, then the smallest reusable one.
            operand_allocs = [allocation_of.get(live.trees.get(o, {}).get(()), None)
                              for o in by_name[head.instruction].operands]
            candidates = [a for a in operand_allocs if a is not None] + reusable[::-1]
            if any(try_assign(a, held, live_out) for a in candidates):
                continue
        if live_out:
            reusable.append(new(head.size_bytes, "output", held, True))
        else:
            heap.extend(held)
    placements = {vid: Placement(a.accounted_as, a.slot) for vid, a in allocation_of.items()}
    # Heap: a value that overwrites a same-sized operand dying here takes its slot.
    next_slot = len(allocations)
    taken_over = takeovers(heap, shares)
    for v in sorted(heap, key=lambda v: (v.start, v.id)):
        if v.id in taken_over:
            placements[v.id] = placements[taken_over[v.id]]
        else:
            placements[v.id] = Placement("temp", next_slot)
            next_slot += 1
    return placements
