"""What compiles and steps of one ``jaxmem.jit`` took, kept across runs for compile planning.

A :class:`CostLog` records each plan's compile seconds and each step the caller
reports. With a disk store it is saved next to the function's analysis, keyed by
the analysis and the budget (the budget picks the levels, so the executables), and
read back by the next run: that run plans its compiles knowing which shapes an
earlier run compiled, what a real compile costs and how long steps take, before it
has compiled or run anything. Where JAX's persistent compilation cache is on, a
shape an earlier run compiled is predicted to load at what loads have cost in this
run (nothing until one is measured), not to compile again.

Example:
    >>> log = CostLog()
    >>> log.record_compile({"b": 8, "s": 128}, 2.0)
    >>> log.compile_s({"b": 8, "s": 256}, persistent_cache=False)
    2.0
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import threading
from collections.abc import Callable, Mapping
from typing import Any

#: Step samples kept on disk (the latest ones).
MAX_STORED_STEPS = 256

Dims = dict[str, int]


def _dims_key(dims: Mapping[str, int]) -> str:
    return ",".join(f"{k}={int(v)}" for k, v in sorted(dims.items()))


@dataclasses.dataclass
class CostLog:
    """Measured seconds of one function under one budget.

    Attributes:
        compiles: ``(dims, seconds)`` of each plan made in this process (tracing,
            lowering, every level compiled to choose it).
        steps: ``(dims, seconds)`` of steps reported, earlier runs' first.
        earlier: real compile seconds of the shapes earlier runs compiled, by dims.
        writer: stores the log where the next run reads it (set by the first compile
            plan when there is a disk store); :meth:`save` calls it.
    """

    compiles: list[tuple[Dims, float]] = dataclasses.field(default_factory=list)
    steps: list[tuple[Dims, float]] = dataclasses.field(default_factory=list)
    earlier: dict[str, float] = dataclasses.field(default_factory=dict)
    writer: Callable[[CostLog], None] | None = dataclasses.field(default=None, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def save(self) -> None:
        """Stores the log for the next run (a no-op without a disk store)."""
        if self.writer is not None:
            self.writer(self)

    def record_compile(self, dims: Mapping[str, int], seconds: float) -> None:
        """Adds one plan's compile time."""
        with self._lock:
            self.compiles.append((dict(dims), seconds))

    def record_step(self, dims: Mapping[str, int], seconds: float) -> None:
        """Adds one step's measured time."""
        with self._lock:
            self.steps.append((dict(dims), seconds))

    @property
    def measured(self) -> bool:
        """Whether any compile time is known (this run's or an earlier one's)."""
        return bool(self.compiles or self.earlier)

    def compile_s(self, dims: Mapping[str, int], persistent_cache: bool) -> float | None:
        """Predicted seconds to get an executable at ``dims``; None before any compile.

        A shape an earlier run compiled loads from JAX's persistent cache when that is
        on (at the median load seen so far, else 0); any other costs the median real
        compile.
        """
        with self._lock:
            loads = [s for d, s in self.compiles if _dims_key(d) in self.earlier]
            real = [s for d, s in self.compiles if _dims_key(d) not in self.earlier]
            real += list(self.earlier.values())
        if persistent_cache and _dims_key(dims) in self.earlier:
            return statistics.median(loads) if loads else 0.0
        return statistics.median(real) if real else None

    def to_json(self) -> dict[str, Any]:
        """The log as JSON data: real compile seconds by shape, and the latest steps."""
        with self._lock:
            earlier = dict(self.earlier)
            for d, s in self.compiles:
                earlier.setdefault(_dims_key(d), s)
            steps = self.steps[-MAX_STORED_STEPS:]
        return {"compiles": earlier, "steps": [[d, s] for d, s in steps]}

    def merge_json(self, data: Any) -> bool:
        """Adds an earlier run's log (from :meth:`to_json`); False, adding nothing, when
        ``data`` is not such a log."""
        try:
            earlier = {str(k): _seconds(v) for k, v in data["compiles"].items()}
            steps = [({str(k): int(v) for k, v in d.items()}, _seconds(s))
                     for d, s in data["steps"]]
        except (TypeError, ValueError, KeyError, AttributeError):
            return False
        with self._lock:
            self.earlier.update(earlier)
            self.steps[:0] = steps
        return True


def _seconds(value: Any) -> float:
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"not a duration: {value!r}")
    return seconds


def costs_path(directory: pathlib.Path, analysis_key: str, budget_bytes: int | None
               ) -> pathlib.Path:
    """Where the log of an analysis under a budget is stored."""
    return directory / f"costs-{analysis_key[:32]}-{budget_bytes}.json.z"
