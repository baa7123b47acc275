"""Performance helpers shared by the stages: pausing Python's cyclic garbage collector.

An analysis allocates millions of small objects (sympy expressions, graph nodes,
coefficient dictionaries) that are nearly all still referenced when the collector
runs, so each full collection re-scans the whole heap for nothing: on a 22-layer
Llama step (8,500 nodes) the collector took 45 % of the plan derivation and 35 %
of ``jaxmem.analyze`` (``bench.scale``, noisy shared CPU). :func:`gc_paused`
suspends it for the duration of an analysis; reference counting still frees
everything acyclic at once, and the cycles made meanwhile are left to the next
full collection (the objects alive at the end join the oldest generation).

Example:
    >>> import gc
    >>> with gc_paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH = 0  # analyses running that paused the collector (threads and nesting)
_RESUME = False  # whether the collector was on when the first of them started


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disables the cyclic garbage collector inside the block (nested or threaded: until
    the last block ends); re-enables it only if it was enabled before the first.

    Usable as a decorator (``@gc_paused()``).
    """
    global _DEPTH, _RESUME
    with _LOCK:
        if _DEPTH == 0:
            _RESUME = gc.isenabled()
            gc.disable()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _RESUME:
                _promote_to_oldest()
                gc.enable()


def _promote_to_oldest() -> None:
    """Moves every tracked object into the collector's oldest generation, unscanned.

    Resumed as it was, the collector's next young collection scans everything the
    analysis allocated (1.5 million objects after a 22-layer step's plans: 0.3-0.6 s
    of CPU at the end of ``derive_plans``), then again as it ages. Freezing and
    unfreezing at once moves them to the oldest generation (``gc.unfreeze``), where
    the next full collection finds any cycle among them, as it would have anyway.
    Skipped where someone else froze objects (unfreezing would release theirs).
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
