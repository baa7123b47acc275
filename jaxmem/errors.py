"""Exception types raised by jaxmem. All derive from :class:`JaxmemError`; warnings are
:class:`JaxmemWarning`, issued by :func:`warn` at the user's line."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings


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


class SymbolicTraceError(SymbolicError):
    """JAX cannot trace the function with the declared symbolic dims: a comparison of dims
    the constraints do not settle, or an op without symbolic support.

    ``jaxmem.analyze`` raises it; ``jaxmem.jit`` warns once and analyses each call shape
    on its own instead (as ``jax.jit`` retraces per shape).
    """


class JaxmemWarning(UserWarning):
    """A conservative estimate was used (unknown primitive, host callback, ...), or a
    request was narrowed (a gradient microbatching cannot split, taken whole)."""


def warn(message: str) -> None:
    """Issue ``message`` as a :class:`JaxmemWarning` located at the first frame outside
    jaxmem, JAX and Python's standard library (``contextlib``): the user's line that
    called jaxmem, or the line of their step that JAX was tracing (so that filters by
    module, and ``-W error``, see the user's file).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn("jaxmem: an example")
        >>> seen[0].category.__name__, seen[0].filename.endswith("errors.py")
        ('JaxmemWarning', False)
    """
    jax = sys.modules.get("jax")
    own = (os.path.dirname(__file__) + os.sep,
           *([os.path.dirname(jax.__file__) + os.sep] if jax and jax.__file__ else []))
    std = os.path.dirname(contextlib.__file__) + os.sep

    def internal(name: str) -> bool:
        return name.startswith(own) or (
            name.startswith(std) and not name.startswith(f"{std}site-packages{os.sep}"))

    here = inspect.currentframe()
    frame, level = (here.f_back if here else None), 1
    while frame is not None and internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, JaxmemWarning, stacklevel=level + 1)
