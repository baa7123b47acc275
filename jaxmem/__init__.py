"""jaxmem: symbolic-shape memory planning for JAX training steps.

The flow, one stage per module, each importing only earlier ones:
``trace`` → ``graph`` → ``symbolic`` → ``memory`` → ``plan`` → ``rewrite`` →
``lower`` → ``dispatch`` (see ``docs/design.md``).
"""

from jaxmem import schedulers
from jaxmem.analyze import Report, analyze
from jaxmem.dispatch.api import jit
from jaxmem.dispatch.jit import CacheInfo, Jitted
from jaxmem.dispatch.plan import Plan
from jaxmem.errors import (
    BudgetInfeasibleError,
    JaxmemError,
    ScheduleError,
    ShapeOutOfRangeError,
    SymbolicError,
    SymbolicTraceError,
)
from jaxmem.grad import value_and_grad
from jaxmem.graph import JaxmemWarning
from jaxmem.lower import xla_peak_bytes
from jaxmem.regions import region
from jaxmem.schedulers import Scheduler

__all__ = [
    "BudgetInfeasibleError",
    "CacheInfo",
    "JaxmemError",
    "JaxmemWarning",
    "Jitted",
    "Plan",
    "Report",
    "ScheduleError",
    "Scheduler",
    "ShapeOutOfRangeError",
    "SymbolicError",
    "SymbolicTraceError",
    "analyze",
    "jit",
    "region",
    "schedulers",
    "value_and_grad",
    "xla_peak_bytes",
]
