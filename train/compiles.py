"""Compile bookkeeping of a run: JAX's persistent cache, XLA compiles counted, busy time.

Example:
    >>> busy_seconds([(0.0, 1.0), (0.5, 2.0)])
    2.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax


def enable_compilation_cache(directory: str | Path) -> None:
    """Keep every executable this process compiles in JAX's persistent cache at ``directory``.

    A later run that compiles the same program at the same shapes, with the same
    options, JAX/XLA version and backend, loads the executable from there instead
    of compiling it; jaxmem's analyses go to its ``jaxmem/`` subfolder and load
    from there too (``jaxmem.jit``'s ``cache_dir``). Per-shape planning still runs.
    JAX by default skips compiles under 1 s
    (``jax_persistent_cache_min_compile_time_secs``), which is most CPU compiles;
    here every compile and entry size is kept. Takes effect only if nothing in the
    process has compiled yet.

    Example:
        >>> enable_compilation_cache("/tmp/jax-cache")  # doctest: +SKIP
    """
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass
class CompileCount:
    """XLA compiles seen by :func:`count_compiles` (every executable of the process).

    Attributes:
        requests: executables XLA was asked for (compiled or loaded).
        cache_hits: of those, loaded from the persistent compilation cache.
        seconds: wall seconds of all requests (compiles and loads).
    """

    requests: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    @property
    def compiles(self) -> int:
        """Executables XLA really compiled (requests the cache did not serve)."""
        return self.requests - self.cache_hits


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCount]:
    """Counts XLA compile requests and persistent-cache hits while the block runs.

    Reads JAX's own monitoring events (``/jax/core/compile/backend_compile_duration``
    and ``/jax/compilation_cache/cache_hits``), from every thread.

    Example:
        >>> with count_compiles() as count:
        ...     _ = jax.jit(lambda x: x + 1)(1.0)
        >>> count.requests >= 1
        True
    """
    count, lock = CompileCount(), threading.Lock()

    def on_event(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            with lock:
                count.cache_hits += 1

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with lock:
                count.requests += 1
                count.seconds += duration

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals (overlaps counted once).

    Example:
        >>> busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
        4.0
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
