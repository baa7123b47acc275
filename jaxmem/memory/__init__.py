"""Stage 4, memory: what XLA materialises, when each buffer lives, and the symbolic peak.

``fusion`` decides which values XLA materialises; ``liveness`` gives each buffer
its live range under an op order; ``reuse`` lets temporaries sit in output
buffers not written yet; ``model`` sums it all into the peak, a ``Max`` over
program points.
"""

from jaxmem.memory.fusion import materialised
from jaxmem.memory.liveness import Buffer, liveness
from jaxmem.memory.model import MemoryModel, memory_model

__all__ = ["Buffer", "MemoryModel", "liveness", "materialised", "memory_model"]
