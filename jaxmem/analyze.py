"""``jaxmem.analyze``: the symbolic memory report of a function, without compiling it.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> b, s = jax.export.symbolic_shape("b, s", constraints=("b <= 16", "s <= 512"))
    >>> w = jnp.zeros((64, 64))
    >>> r = jaxmem.analyze(lambda w, x: jnp.tanh(x @ w).sum(), w,
    ...                    jax.ShapeDtypeStruct((b, s, 64), jnp.float32))
    >>> r.symbols
    ('b', 's')
    >>> r.peak_bytes_at(b=8, s=256) > 0
    True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import sympy

from jaxmem.errors import ShapeOutOfRangeError
from jaxmem.fastexpr import compile_expr
from jaxmem.graph import Graph, build_graph
from jaxmem.memory import MemoryModel, memory_model
from jaxmem.perf import gc_paused
from jaxmem.symbolic import ShapeDomain, sym
from jaxmem.trace import Traced, trace


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`analyze` found.

    Attributes:
        symbols: the dimension variables.
        domain: their ranges and constraints.
        graph: the flat dataflow graph.
        memory: the symbolic memory model in program order.
    """

    symbols: tuple[str, ...]
    domain: ShapeDomain
    graph: Graph
    memory: MemoryModel
    traced: Traced = dataclasses.field(repr=False, compare=False)

    @property
    def peak_bytes(self) -> sympy.Expr:
        """Predicted peak (``argument + output - alias + temp``) as a sympy expression."""
        return self.memory.peak_bytes

    @property
    def comparisons(self) -> dict[str, int]:
        """How each memory comparison made during analysis was decided."""
        counts = {"symbolic": 0, "fallback": 0}
        counts.update(dict(self.memory.comparisons))
        return counts

    @functools.cached_property
    def _peak_fn(self) -> Callable[..., Any]:
        # A DAG-aware compile: the peak's piecewise steps repeat, lambdify would
        # print (and evaluate) each repetition.
        return compile_expr([sym(n) for n in self.symbols], self.memory.peak_bytes)

    def peak_bytes_at(self, **dims: int) -> int:
        """Evaluates the peak at concrete dims, e.g. ``peak_bytes_at(b=8, s=256)``.

        Raises:
            ShapeOutOfRangeError: a dim is missing, unknown, or outside the domain.
        """
        point = self._point(dims)
        return int(self._peak_fn(*[point[n] for n in self.symbols]))

    def timeline_at(self, **dims: int) -> list[int]:
        """Temporary bytes live at each program point, at concrete dims."""
        point = self._point(dims)
        subs = {sym(n): v for n, v in point.items()}
        return [int(sympy.sympify(e).subs(subs)) for e in self.memory.timeline]

    def _point(self, dims: dict[str, int]) -> dict[str, int]:
        unknown = set(dims) - set(self.symbols)
        missing = set(self.symbols) - set(dims)
        if unknown or missing:
            raise ShapeOutOfRangeError(
                f"peak_bytes_at needs exactly the dims {self.symbols}; "
                f"unknown {sorted(unknown)}, missing {sorted(missing)}")
        for n, v in dims.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ShapeOutOfRangeError(f"dim {n}={v!r} must be an int")
        problem = self.domain.contains(dims)
        if problem:
            raise ShapeOutOfRangeError(problem)
        return dims

    def describe(self) -> str:
        """A short human-readable summary."""
        m = self.memory
        lines = [f"jaxmem report over {', '.join(self.symbols) or 'no symbols'}",
                 f"  domain      : {_domain_text(self.domain)}",
                 f"  graph       : {len(self.graph.nodes)} ops, {len(self.graph.values)} values",
                 f"  arguments   : {m.argument_bytes} bytes",
                 f"  outputs     : {m.output_bytes} bytes",
                 f"  temp (max)  : {m.temp_bytes}",
                 f"  peak        : {m.peak_bytes}",
                 f"  comparisons : {self.comparisons}"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Report(symbols={self.symbols}, peak_bytes={self.peak_bytes}, "
                f"comparisons={self.comparisons})")


def _domain_text(dom: ShapeDomain) -> str:
    parts = [f"{lo} <= {n}" + (f" <= {hi}" if hi is not None else "")
             for n, lo, hi in zip(dom.symbols, dom.lower, dom.upper, strict=True)]
    return ", ".join(parts + [c.text for c in dom.constraints])


@gc_paused()
def analyze(fn: Callable[..., Any], *specs: Any, symbolic: bool = True) -> Report:
    """Symbolic memory analysis of ``fn`` over every shape its specs allow.

    Args:
        fn: the function, e.g. a whole train step.
        *specs: its arguments as pytrees of arrays or ``jax.ShapeDtypeStruct``,
            dims from ``jax.export.symbolic_shape`` (with constraints).
        symbolic: False disables symbolic comparisons (the fallback-only ablation).

    Returns:
        A :class:`Report`; ``report.peak_bytes_at(b=8, s=256)`` gives bytes.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> n, = jax.export.symbolic_shape("n", constraints=("n <= 100",))
        >>> analyze(lambda x: x @ x.T, jax.ShapeDtypeStruct((n, 4), jnp.float32)).peak_bytes
        4*n**2 + 16*n
    """
    traced = trace(fn, *specs)
    graph = build_graph(traced.closed_jaxpr)
    domain = ShapeDomain.from_constraints(traced.symbols, traced.constraints)
    memory = memory_model(graph, domain, symbolic=symbolic)
    return Report(traced.symbols, domain, graph, memory, traced)
