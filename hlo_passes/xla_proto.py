"""XLA's own buffer assignment, read from the compiled executable.

``compiled.memory_analysis().serialized_buffer_assignment_proto`` is the
``xla.BufferAssignmentProto`` (xla/service/hlo.proto) that XLA built for the
executable: every allocation with its size and flags, and every logical buffer
(HloValue) assigned to it with its offset. It is the exact source behind
``memory_analysis()``; no recompilation or dump directory is needed. Logical
buffers name their defining instruction by unique id only, so the ids are
resolved through the serialized ``HloModuleProto`` of the same executable.

A minimal protobuf wire-format reader keeps this free of generated protobuf
code (jaxlib ships none for these messages). Field numbers are from hlo.proto.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from hlo_passes.hlo_text import HOST_MEMORY_SPACE, ShapeIndex


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, i


def _fields(data: bytes) -> dict[int, list[Any]]:
    """Decode one message level: field number -> list of raw values (ints or bytes)."""
    out: dict[int, list[Any]] = defaultdict(list)
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            length, i = _varint(data, i)
            value, i = data[i:i + length], i + length
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out[number].append(value)
    return out


def _ints(values: list[Any]) -> tuple[int, ...]:
    """A repeated int64 field, packed (bytes) or not (ints)."""
    out: list[int] = []
    for value in values:
        if isinstance(value, bytes):
            i = 0
            while i < len(value):
                number, i = _varint(value, i)
                out.append(number)
        else:
            out.append(value)
    return tuple(out)


def _int(fields: dict[int, list[Any]], number: int) -> int:
    values = fields.get(number)
    return values[-1] if values else 0


@dataclass(frozen=True)
class LogicalBuffer:
    """An HloValue as buffer assignment saw it."""

    id: int
    size: int
    instruction_id: int
    shape_index: ShapeIndex
    color: int


@dataclass(frozen=True)
class Allocation:
    """A BufferAllocation: one contiguous region that several buffers may share."""

    index: int
    size: int
    is_thread_local: bool
    is_tuple: bool
    is_parameter: bool
    is_constant: bool
    parameter_number: int
    parameter_index: ShapeIndex
    maybe_live_out: bool
    color: int
    assigned: tuple[tuple[int, int, int], ...]  # (logical buffer id, offset, size)

    @property
    def is_temp(self) -> bool:
        """BufferAllocation::IsPreallocatedTempBuffer: what memory_analysis calls temp."""
        return not (self.is_parameter or self.maybe_live_out or self.is_thread_local
                    or self.is_constant)

    @property
    def on_host(self) -> bool:
        return self.color == HOST_MEMORY_SPACE


@dataclass(frozen=True)
class BufferAssignment:
    """The decoded BufferAssignmentProto."""

    buffers: dict[int, LogicalBuffer]
    allocations: tuple[Allocation, ...]


def decode_buffer_assignment(data: bytes) -> BufferAssignment:
    """Decode a serialized ``xla.BufferAssignmentProto``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> c = jax.jit(lambda x: jnp.sin(x @ x.T)).lower(jnp.ones((8, 4))).compile()
        >>> ba = decode_buffer_assignment(
        ...     c.memory_analysis().serialized_buffer_assignment_proto)
        >>> sum(a.size for a in ba.allocations if a.is_parameter)
        128
    """
    top = _fields(data)
    buffers = {}
    for raw in top.get(1, []):
        f = _fields(raw)
        where = _fields(f[3][0]) if f.get(3) else {}
        buffer = LogicalBuffer(_int(f, 1), _int(f, 2), _int(where, 4),
                               _ints(where.get(3, [])), _int(f, 4))
        buffers[buffer.id] = buffer
    allocations = []
    for raw in top.get(3, []):
        f = _fields(raw)
        assigned = []
        for item in f.get(9, []):
            a = _fields(item)
            assigned.append((_int(a, 1), _int(a, 2), _int(a, 3)))
        allocations.append(Allocation(
            index=_int(f, 1), size=_int(f, 2), is_thread_local=bool(_int(f, 3)),
            is_tuple=bool(_int(f, 11)), is_parameter=bool(_int(f, 5)),
            is_constant=bool(_int(f, 12)), parameter_number=_int(f, 6),
            parameter_index=_ints(f.get(10, [])), maybe_live_out=bool(_int(f, 7)),
            color=_int(f, 8), assigned=tuple(assigned)))
    return BufferAssignment(buffers, tuple(allocations))


def instruction_names(module_proto: bytes) -> dict[int, tuple[str, str]]:
    """Map instruction unique id -> (computation name, instruction name).

    Reads ``HloModuleProto.computations[].instructions[]`` (fields 3/2, name 1, id 35).
    """
    out = {}
    for raw_comp in _fields(module_proto).get(3, []):
        comp = _fields(raw_comp)
        comp_name = comp[1][0].decode() if comp.get(1) else ""
        for raw_instr in comp.get(2, []):
            instr = _fields(raw_instr)
            name = instr[1][0].decode() if instr.get(1) else ""
            out[_int(instr, 35)] = (comp_name, name)
    return out


def read_buffer_assignment(
    compiled: Any,
) -> tuple[BufferAssignment, dict[int, tuple[str, str]]] | None:
    """XLA's buffer assignment of ``compiled`` and its id -> name table, or None.

    None means this jax/backend does not expose it; callers fall back to the text.
    """
    try:
        data = compiled.memory_analysis().serialized_buffer_assignment_proto
        modules = compiled.runtime_executable().hlo_modules()
    except Exception:  # any missing API means "not available here", not an error
        return None
    if not data or len(modules) != 1:
        return None
    return decode_buffer_assignment(data), instruction_names(
        modules[0].as_serialized_hlo_module_proto())
