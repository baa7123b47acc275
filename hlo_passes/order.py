"""Did a requested operation order survive XLA's scheduler?

Operations are found in the scheduled ENTRY computation by *markers*: an HLO
instruction name, or a ``jax.named_scope`` path such as ``"layer_0/attn"``
matched against ``metadata.op_name``. JAX records scopes inside transformation
names (``jit(f)/transpose(jvp(layer_0))/attn/dot``) and XLA joins the names of
merged ops with ``;``, so a marker matches when its ``/``-separated components
appear consecutively among the components of any one of those names. Ops fused
into a fusion, or run inside a while body / branch / call, count at the
position of the ENTRY instruction that runs them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Literal

from hlo_passes.hlo_text import HloModuleText, Instruction, parse_hlo_module


def _components(op_name: str) -> list[list[str]]:
    return [[c for c in re.split(r"[/()]+", name) if c] for name in op_name.split(";")]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    k = len(needle)
    return k > 0 and any(haystack[i:i + k] == needle for i in range(len(haystack) - k + 1))


def matches(instruction: Instruction, marker: str) -> bool:
    """Whether ``instruction`` is named ``marker`` or carries it in its op_name.

    Example:
        >>> from hlo_passes.hlo_text import parse_instruction
        >>> i = parse_instruction(
        ...     '%f = f32[2]{0} sine(%x), metadata={op_name="jit(f)/jvp(layer_0)/attn/sin"}')
        >>> matches(i, "layer_0/attn"), matches(i, "layer_1")
        (True, False)
    """
    if instruction.name == marker:
        return True
    needle = [c for c in re.split(r"[/()]+", marker) if c]
    return any(_contains(h, needle) for h in _components(instruction.op_name))


def marker_positions(module: HloModuleText, marker: str) -> tuple[int, ...]:
    """Sorted ENTRY positions whose instruction, or anything it runs, matches ``marker``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from hlo_passes.hlo_text import parse_hlo_module
        >>> def f(x):
        ...     with jax.named_scope("proj"):
        ...         return jnp.tanh(x @ x)
        >>> m = parse_hlo_module(jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text())
        >>> len(marker_positions(m, "proj")) > 0, marker_positions(m, "absent")
        (True, ())
    """
    found = []
    for pos, ins in enumerate(module.entry.instructions):
        if ins.opcode in ("parameter", "get-tuple-element", "tuple", "opt-barrier"):
            continue  # bookkeeping, not work: JAX names the barrier's tuple after the barrier
        stack, seen, hit = [ins], set(), False
        while stack and not hit:
            current = stack.pop()
            hit = matches(current, marker)
            for name in current.called:
                if name not in seen and name in module.computations:
                    seen.add(name)
                    stack.extend(module.computations[name].instructions)
        if hit:
            found.append(pos)
    return tuple(found)


@dataclass(frozen=True)
class OrderSurvival:
    """How much of a requested order the schedule kept.

    Attributes:
        requested: the markers, in the requested order.
        positions: per marker, the ENTRY positions where it runs (empty: not found).
        observed: the found markers in the order they run (by first position).
        missing: markers that match nothing.
        kept: requested pairs (earlier, later) that run in that order.
        broken: requested pairs that run in the opposite order.
        tied: pairs that cannot be told apart (same instruction; with
            ``mode="all"`` also pairs whose spans interleave).
    """

    requested: tuple[str, ...]
    positions: tuple[tuple[int, ...], ...]
    observed: tuple[str, ...]
    missing: tuple[str, ...]
    kept: int
    broken: int
    tied: int

    @property
    def pairs(self) -> int:
        return self.kept + self.broken + self.tied

    @property
    def fraction(self) -> float:
        """Kept pairs / comparable pairs (Kendall-tau-like); 1.0 when nothing to compare."""
        return self.kept / self.pairs if self.pairs else 1.0

    def __float__(self) -> float:
        return self.fraction


def order_survival(
    compiled: Any, requested: Sequence[str], *, mode: Literal["first", "all"] = "first",
) -> OrderSurvival:
    """Measure whether ``requested`` (earliest first) is the order the ENTRY schedule runs.

    Args:
        compiled: a ``jax.stages.Compiled`` or the text of a scheduled HLO module.
        requested: markers (instruction names or named-scope paths), earliest first.
        mode: ``"first"`` compares where each marker first runs; ``"all"`` counts a
            pair as kept only if every op of the earlier marker runs before every op
            of the later one (broken if entirely after, tied if they interleave).

    Returns:
        The positions, the observed order and the kept / broken / tied pair counts;
        ``float(result)`` is the fraction of requested pairs kept.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def f(x):
        ...     with jax.named_scope("first"):
        ...         y = jnp.sin(x) @ x
        ...     with jax.named_scope("second"):
        ...         return jnp.cos(y) @ y
        >>> c = jax.jit(f).lower(jnp.ones((8, 8))).compile()
        >>> order_survival(c, ["first", "second"]).fraction
        1.0
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    module = parse_hlo_module(text)
    positions = tuple(marker_positions(module, m) for m in requested)
    found = [(p[0], i) for i, p in enumerate(positions) if p]
    observed = tuple(requested[i] for _, i in sorted(found))
    missing = tuple(m for m, p in zip(requested, positions, strict=True) if not p)
    kept = broken = tied = 0
    for a, b in combinations([p for p in positions if p], 2):
        if mode == "all":
            earlier, later = a[-1] < b[0], b[-1] < a[0]
        else:
            earlier, later = a[0] < b[0], b[0] < a[0]
        kept += earlier
        broken += later
        tied += not (earlier or later)
    return OrderSurvival(tuple(requested), positions, observed, missing, kept, broken, tied)
