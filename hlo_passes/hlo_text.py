"""Parser for the text of a scheduled HLO module (``jax.stages.Compiled.as_text()``).

Only what the memory analyses need is kept: instruction names, opcodes, shapes
(with layouts), operands, called computations, a few attributes and the
``op_name`` metadata. In a scheduled module (``is_scheduled=true``) every
computation is printed in execution order, which is what makes positions in the
ENTRY computation program points.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Bits per element. Sub-byte types are packed by XLA, hence bits rather than bytes.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4,
    "f8e5m2": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3fnuz": 8,
    "f8e4m3": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "token": 0, "opaque": 0,
}
POINTER_BYTES = 8  # a tuple is a table of pointers to its elements (CPU and GPU)
HOST_MEMORY_SPACE = 5  # Layout::kHostMemorySpace: bytes there are not device bytes

ShapeIndex = tuple[int, ...]


@dataclass(frozen=True)
class ArrayShape:
    """An array (or token) shape such as ``f32[8,32]{1,0}``."""

    dtype: str
    dims: tuple[int, ...]
    layout: str = ""  # minor-to-major list plus any tiling, as printed
    memory_space: int = 0

    @property
    def size_bytes(self) -> int:
        bits = _BITS.get(self.dtype, 32)
        return math.ceil(math.prod(self.dims) * bits / 8)

    def __str__(self) -> str:
        dims = ",".join(map(str, self.dims))
        return f"{self.dtype}[{dims}]" + (f"{{{self.layout}}}" if self.layout else "")


@dataclass(frozen=True)
class TupleShape:
    """A tuple shape; its own buffer is the table of element pointers."""

    elements: tuple[Shape, ...]

    @property
    def size_bytes(self) -> int:
        return POINTER_BYTES * len(self.elements)

    def __str__(self) -> str:
        return "(" + ", ".join(map(str, self.elements)) + ")"


Shape = ArrayShape | TupleShape


def subshape(shape: Shape, index: ShapeIndex) -> Shape:
    """The shape at ``index`` inside ``shape`` (``()`` is the shape itself)."""
    for i in index:
        assert isinstance(shape, TupleShape), (shape, index)
        shape = shape.elements[i]
    return shape


def shape_indices(shape: Shape, prefix: ShapeIndex = ()) -> list[ShapeIndex]:
    """All indices of ``shape`` in pre-order: the tuple table first, then elements."""
    out = [prefix]
    if isinstance(shape, TupleShape):
        for i, element in enumerate(shape.elements):
            out.extend(shape_indices(element, (*prefix, i)))
    return out


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction as printed."""

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]
    attrs: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    op_name: str = ""
    is_root: bool = False

    @property
    def called(self) -> tuple[str, ...]:
        """Names of the computations this instruction calls (fusion bodies included)."""
        names: list[str] = []
        for key in ("calls", "to_apply", "body", "condition", "true_computation",
                    "false_computation", "branch_computations", "async_computation"):
            if key in self.attrs:
                names.extend(re.findall(r"%?([\w.\-]+)", self.attrs[key].strip("{}")))
        return tuple(names)

    @property
    def parameter_number(self) -> int:
        return int(self.attrs.get("_literal", "0"))


@dataclass(frozen=True)
class Computation:
    """A computation: instructions in printed (for scheduled modules: execution) order."""

    name: str
    instructions: tuple[Instruction, ...]
    is_entry: bool = False

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.is_root), self.instructions[-1])

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


@dataclass(frozen=True)
class AliasEntry:
    """One ``input_output_alias`` entry: output index <- (parameter, index)."""

    output_index: ShapeIndex
    parameter: int
    parameter_index: ShapeIndex


@dataclass(frozen=True)
class HloModuleText:
    """A parsed HLO module."""

    name: str
    computations: dict[str, Computation] = field(hash=False, compare=False)
    entry_name: str
    input_output_alias: tuple[AliasEntry, ...] = ()
    is_scheduled: bool = False

    @property
    def entry(self) -> Computation:
        return self.computations[self.entry_name]


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets and quotes."""
    parts, depth, quoted, start, i = [], 0, False, 0, 0
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth, quoted, i = 0, False, start
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in {text!r}")


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def parse_shape(text: str) -> tuple[Shape, int]:
    """Parse a shape at the start of ``text``; return it and the characters consumed.

    Example:
        >>> shape, _ = parse_shape("(f32[8,32]{1,0}, /*index=1*/s32[])")
        >>> [s.size_bytes for s in shape.elements]
        [1024, 4]
    """
    i = len(text) - len(text.lstrip())
    if text.startswith("/*", i):
        i = text.index("*/", i) + 2
    if text.startswith("(", i):
        end = _matching(text, i)
        inner = re.sub(r"/\*.*?\*/", "", text[i + 1:end - 1])
        elements = tuple(parse_shape(part)[0] for part in _split_top(inner))
        return TupleShape(elements), end
    match = _ARRAY.match(text, i)
    if match is None:
        raise ValueError(f"cannot parse shape at {text[i:i + 40]!r}")
    dims = tuple(int(re.sub(r"[^0-9]", "", d) or 0) for d in match.group(2).split(",") if d)
    layout = (match.group(3) or "{}")[1:-1]
    space = re.search(r"S\((\d+)\)", layout)
    memory_space = int(space.group(1)) if space else 0
    return ArrayShape(match.group(1), dims, layout, memory_space), match.end()


def _parse_attrs(text: str) -> dict[str, str]:
    attrs = {}
    for part in _split_top(text):
        key, _, value = part.partition("=")
        attrs[key.strip()] = value.strip()
    return attrs


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_OPNAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def parse_instruction(line: str) -> Instruction:
    """Parse one instruction line such as ``%y = f32[4]{0} negate(%x), metadata={...}``."""
    match = _INSTR.match(line)
    if match is None:
        raise ValueError(f"not an instruction: {line!r}")
    is_root, name, rest = bool(match.group(1)), match.group(2), match.group(3)
    shape, used = parse_shape(rest)
    rest = rest[used:].lstrip()
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if opcode_match is None:
        raise ValueError(f"no opcode in {line!r}")
    opcode = opcode_match.group(1)
    close = _matching(rest, opcode_match.end() - 1)
    inner = rest[opcode_match.end():close - 1]
    attrs = _parse_attrs(rest[close:].lstrip(", "))
    operands: tuple[str, ...] = ()
    if opcode in ("parameter", "constant", "iota", "rng-get-and-update-state"):
        attrs["_literal"] = inner
    else:
        # An operand may be printed with its shape in front: keep the last %name token.
        operands = tuple(
            m.group(1) for p in _split_top(inner) if (m := re.search(r"%([^\s,()]+)\s*$", p))
        )
    metadata = attrs.get("metadata", "")
    op_name = _OPNAME.search(metadata)
    return Instruction(name, opcode, shape, operands, attrs,
                       op_name.group(1) if op_name else "", is_root)


def _parse_alias(header: str) -> tuple[AliasEntry, ...]:
    start = header.find("input_output_alias={")
    if start < 0:
        return ()
    body = header[start + len("input_output_alias="):]
    body = body[:_matching(body, 0)]
    entries = []
    for m in re.finditer(r"\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}", body):
        out = tuple(int(x) for x in m.group(1).split(",") if x.strip())
        param_index = tuple(int(x) for x in m.group(3).split(",") if x.strip())
        entries.append(AliasEntry(out, int(m.group(2)), param_index))
    return tuple(entries)


def parse_hlo_module(text: str) -> HloModuleText:
    """Parse the text of an HLO module.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> c = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(4)).compile()
        >>> m = parse_hlo_module(c.as_text())
        >>> m.entry.instructions[0].opcode
        'parameter'
    """
    lines = text.splitlines()
    header = next((ln for ln in lines if ln.startswith("HloModule")), "HloModule unknown")
    module_name = header.split()[1].rstrip(",") if len(header.split()) > 1 else "unknown"
    computations: dict[str, Computation] = {}
    entry_name = ""
    current: list[Instruction] | None = None
    name, is_entry = "", False
    for line in lines:
        if current is None:
            match = _COMP.match(line)
            if match:
                current, name, is_entry = [], match.group(2), bool(match.group(1))
            continue
        if line.strip() == "}":
            computations[name] = Computation(name, tuple(current), is_entry)
            entry_name = name if is_entry else entry_name
            current = None
        elif _INSTR.match(line):  # anything else (comments, blank lines) is not ours
            current.append(parse_instruction(line))
    if not entry_name:
        raise ValueError("no ENTRY computation in HLO text")
    return HloModuleText(module_name, computations, entry_name, _parse_alias(header),
                         "is_scheduled=true" in header)
