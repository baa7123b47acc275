"""Exception types raised by jaxmem. All derive from :class:`JaxmemError`."""

from __future__ import annotations


class JaxmemError(Exception):
    """Base class of every error jaxmem raises on purpose."""


class ShapeOutOfRangeError(JaxmemError, ValueError):
    """Arguments violate the declared ranks, dtypes, dim ranges or constraints.

    The message names the argument, the dimension, the value and the bound.
    """


class BudgetInfeasibleError(JaxmemError, ValueError):
    """No plan fits the memory budget.

    Attributes:
        min_peak_bytes: the peak of the cheapest plan jaxmem found, in bytes.
        budget_bytes: the budget that was asked for.
    """

    def __init__(self, message: str, *, min_peak_bytes: int, budget_bytes: int | None = None):
        super().__init__(message)
        self.min_peak_bytes = int(min_peak_bytes)
        self.budget_bytes = budget_bytes


class ScheduleError(JaxmemError):
    """A scheduler returned an order that is not a valid topological order."""


class SymbolicError(JaxmemError):
    """A symbolic shape question the declared constraints do not settle.

    The message names the comparison and the constraint that would settle it.
    """


class JaxmemWarning(UserWarning):
    """A conservative estimate was used (unknown primitive, host callback, ...), or a
    request was narrowed (a gradient microbatching cannot split, taken whole)."""
