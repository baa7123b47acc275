"""jaxmem: symbolic-shape memory planning for JAX training steps."""

from jaxmem._errors import (
    BudgetInfeasibleError,
    JaxmemError,
    ScheduleError,
    ShapeOutOfRangeError,
    SymbolicError,
)
from jaxmem.analyze import Report, analyze
from jaxmem.graph import JaxmemWarning

__all__ = [
    "BudgetInfeasibleError",
    "JaxmemError",
    "JaxmemWarning",
    "Report",
    "ScheduleError",
    "ShapeOutOfRangeError",
    "SymbolicError",
    "analyze",
]
