"""jaxmem: symbolic-shape memory planning for JAX training steps."""

from jaxmem import schedulers
from jaxmem._errors import (
    BudgetInfeasibleError,
    JaxmemError,
    ScheduleError,
    ShapeOutOfRangeError,
    SymbolicError,
)
from jaxmem.analyze import Report, analyze
from jaxmem.grad import value_and_grad
from jaxmem.graph import JaxmemWarning
from jaxmem.jit import Jitted, jit
from jaxmem.plan.plan import Plan, xla_peak_bytes
from jaxmem.regions import region
from jaxmem.schedulers import Scheduler

__all__ = [
    "BudgetInfeasibleError",
    "JaxmemError",
    "JaxmemWarning",
    "Jitted",
    "Plan",
    "Report",
    "ScheduleError",
    "Scheduler",
    "ShapeOutOfRangeError",
    "SymbolicError",
    "analyze",
    "jit",
    "region",
    "schedulers",
    "value_and_grad",
    "xla_peak_bytes",
]
