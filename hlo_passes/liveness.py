"""Values and live ranges of a scheduled HLO computation.

A *value* is what XLA's dataflow analysis calls an HloValue: a buffer defined by
one instruction at one shape index. Instructions that only forward buffers
(get-tuple-element, bitcast, optimization-barrier, while, and the elements of a
tuple) define no new value; their outputs are further *positions* of their
operands' values, which keeps those values alive for as long as the forwarding
instruction's output is used. Live ranges are closed intervals of positions in
the computation's schedule, with XLA's conventions (checked against XLA's own
HloLiveRange dump in the tests): entry parameters live for the whole program
unless donated, values reaching the ROOT live to its end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hlo_passes.hlo_text import (
    ArrayShape,
    Computation,
    HloModuleText,
    Instruction,
    Shape,
    ShapeIndex,
    shape_indices,
    subshape,
)

# Instructions whose output is their operand's buffer (no allocation of their own).
FORWARDING = frozenset(
    {"bitcast", "opt-barrier", "optimization-barrier", "domain", "add-dependency"})
# Elementwise opcodes: an output may overwrite a same-shaped operand in place.
ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "bitcast-convert", "cbrt", "ceil", "clamp", "clz",
    "compare", "complex", "convert", "cosine", "divide", "erf", "exponential",
    "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one", "logistic",
    "maximum", "minimum", "multiply", "negate", "not", "or", "popcnt", "power", "real",
    "reduce-precision", "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt",
    "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine",
    "sqrt", "stochastic-convert", "subtract", "tan", "tanh", "xor",
})
IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
# Instructions that run a non-fused computation whose temporaries live during the call.
CALLERS = frozenset({"while", "conditional", "call", "async-start", "custom-call"})


@dataclass(frozen=True)
class Value:
    """One buffer-defining (instruction, shape index) and its live range."""

    id: int
    instruction: str
    index: ShapeIndex
    shape: Shape
    start: int
    end: int
    kind: str  # "parameter" | "output" | "temp" | "constant"
    op_name: str
    opcode: str

    @property
    def size_bytes(self) -> int:
        return self.shape.size_bytes

    @property
    def name(self) -> str:
        return self.instruction + (str(list(self.index)).replace(" ", "") if self.index else "")


@dataclass(frozen=True)
class Liveness:
    """Values of one computation, and which value each position holds."""

    computation: str
    values: tuple[Value, ...]
    trees: dict[str, dict[ShapeIndex, int]]  # instruction -> index -> value id
    length: int


def analyze(module: HloModuleText, comp: Computation) -> Liveness:
    """Values and live ranges of ``comp`` in its printed (scheduled) order.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from hlo_passes.hlo_text import parse_hlo_module
        >>> c = jax.jit(lambda x: (x + 1, x * 2)).lower(jnp.ones(4)).compile()
        >>> m = parse_hlo_module(c.as_text())
        >>> sorted({v.kind for v in analyze(m, m.entry).values})
        ['output', 'parameter']
    """
    n = len(comp.instructions)
    starts: list[int] = []
    ends: list[int] = []
    defs: list[tuple[Instruction, ShapeIndex, Shape]] = []
    trees: dict[str, dict[ShapeIndex, int]] = {}

    def define(ins: Instruction, pos: int, index: ShapeIndex) -> int:
        defs.append((ins, index, subshape(ins.shape, index)))
        starts.append(pos)
        ends.append(pos)
        return len(defs) - 1

    def use(vid: int, pos: int) -> None:
        ends[vid] = max(ends[vid], pos)

    for pos, ins in enumerate(comp.instructions):
        operand_trees = [trees.get(o, {}) for o in ins.operands]
        if ins.opcode == "get-tuple-element" and operand_trees:
            k = int(ins.attrs.get("index", "0"))
            src = operand_trees[0]
            if () in src:
                use(src[()], pos)  # reads the tuple's pointer table
            trees[ins.name] = {i[1:]: v for i, v in src.items() if i[:1] == (k,)}
        elif ins.opcode in FORWARDING and operand_trees:
            trees[ins.name] = dict(operand_trees[0])
        elif ins.opcode == "tuple":
            tree = {(): define(ins, pos, ())}
            for k, src in enumerate(operand_trees):
                tree.update({(k, *i): v for i, v in src.items()})
            trees[ins.name] = tree
        else:
            for src in operand_trees:
                for vid in src.values():
                    use(vid, pos)
            if ins.opcode == "while" and operand_trees:
                # Loop state is updated in place: the while's buffers are its operand's.
                trees[ins.name] = dict(operand_trees[0])
            else:
                trees[ins.name] = {i: define(ins, pos, i) for i in shape_indices(ins.shape)}

    live_out = set(trees.get(comp.root.name, {}).values())
    donated_params = {(a.parameter, a.parameter_index) for a in module.input_output_alias}
    values = []
    for vid, (ins, index, shape) in enumerate(defs):
        start, end = starts[vid], ends[vid]
        if ins.opcode == "parameter":
            kind = "parameter"
            if comp.is_entry:
                # XLA keeps entry parameters for the whole run, except donated ones,
                # whose bytes are free for reuse after their last use.
                donated = (ins.parameter_number, index) in donated_params
                start, end = 0, end if donated else n - 1
        elif ins.opcode == "constant":
            kind = "constant"
        elif vid in live_out:
            kind = "output"
        else:
            kind = "temp"
        if vid in live_out:
            end = n - 1
        values.append(Value(vid, ins.name, index, shape, start, end, kind, ins.op_name,
                            ins.opcode))
    return Liveness(comp.name, tuple(values), trees, n)


def caller_positions(module: HloModuleText) -> dict[str, int]:
    """Computation name -> position of the ENTRY instruction that (transitively) runs it."""
    out: dict[str, int] = {module.entry_name: -1}
    for pos, ins in enumerate(module.entry.instructions):
        stack = list(ins.called)
        while stack:
            name = stack.pop()
            if name in out or name not in module.computations:
                continue
            out[name] = pos
            for inner in module.computations[name].instructions:
                stack.extend(inner.called)
    return out


def _follow_tuples(comp: Computation, name: str, index: ShapeIndex) -> tuple[str, ShapeIndex]:
    """Undo tuple / get-tuple-element indirection (XLA's FollowTupleIndirection)."""
    by_name = comp.by_name()
    ins = by_name[name]
    while ins.opcode == "tuple" and index:
        ins, index = by_name[ins.operands[index[0]]], index[1:]
    while ins.opcode == "get-tuple-element":
        index = (int(ins.attrs.get("index", "0")), *index)
        ins = by_name[ins.operands[0]]
    return ins.name, index


def _elementwise_uses(comp: Computation, param: str) -> bool:
    """AreTransitiveUsesElementwiseOrTuple for a fused parameter."""
    users: dict[str, list[Instruction]] = {}
    for ins in comp.instructions:
        for o in ins.operands:
            users.setdefault(o, []).append(ins)
    stack, seen = [param], set()
    while stack:
        name = stack.pop()
        for user in users.get(name, []):
            if user.opcode not in ELEMENTWISE and user.opcode != "tuple":
                return False
            if user.name not in seen:
                seen.add(user.name)
                stack.append(user.name)
    return True


def _aliasing_attr(ins: Instruction) -> list[tuple[ShapeIndex, int, ShapeIndex]]:
    """Parse ``output_to_operand_aliasing={{0}: (1, {})}`` into (out, operand, index)."""
    def parse(s: str) -> ShapeIndex:
        return tuple(int(x) for x in s.split(",") if x.strip())

    text = ins.attrs.get("output_to_operand_aliasing", "")
    pattern = r"\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}"
    return [(parse(m.group(1)), int(m.group(2)), parse(m.group(3)))
            for m in re.finditer(pattern, text)]


def in_place_operands(module: HloModuleText, ins: Instruction,
                      index: ShapeIndex) -> list[tuple[int, ShapeIndex]]:
    """Operands (number, index) whose buffer the output at ``index`` may overwrite.

    A condensed form of HloDataflowAnalysis::CanShareOperandBufferWithUser:
    in-place ops, declared output/operand aliasing, and elementwise consumers of an
    operand with the same shape and layout.
    """
    out_shape = subshape(ins.shape, index)
    if not isinstance(out_shape, ArrayShape):
        return []
    pairs = [(k, oi) for oi_out, k, oi in _aliasing_attr(ins) if oi_out == index]
    if ins.opcode in IN_PLACE and not index:
        pairs.append((0, ()))
    if ins.opcode == "sort" and len(ins.operands) == 1:
        pairs.append((0, ()))
    if ins.opcode in ELEMENTWISE:
        pairs.extend((k, ()) for k in range(len(ins.operands)))
    body = module.computations.get(ins.called[0]) if ins.called else None
    if ins.opcode == "fusion" and body is not None:
        params = {i.name: i.parameter_number for i in body.instructions
                  if i.opcode == "parameter"}
        src, src_index = _follow_tuples(body, body.root.name, index)
        src_ins = body.by_name()[src]
        if src_ins.opcode in IN_PLACE and not src_index:
            name, _ = _follow_tuples(body, src_ins.operands[0], ())
            if name in params:
                pairs.append((params[name], ()))
        if ins.attrs.get("kind") in ("kLoop", "kInput"):
            pairs.extend((k, ()) for p, k in params.items() if _elementwise_uses(body, p))
    return pairs
