"""A thread-safe cache filled once per key: what ``Jitted`` keeps its analyses and plans in;
and :class:`CacheInfo`, what ``Jitted.cache_info()`` reports of them.

Several threads may ask for one key together (compile-ahead workers and the
training loop): the first computes it, the others wait for that result, and
distinct keys are computed in parallel — XLA's compile releases the GIL.

Example:
    >>> cache = OnceCache()
    >>> cache.get_or_make("a", lambda: 1), cache.get_or_make("a", lambda: 2)
    (1, 1)
    >>> len(cache), cache.get("b")
    (1, None)
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, NamedTuple, TypeVar

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """What a ``Jitted`` holds: analyses (one per argument structure), plans (one per call
    shape), distinct compiled executables, and how many of the analyses were loaded
    from the disk store (``jaxmem.jit(..., cache_dir=...)``) rather than derived."""

    analyses: int
    plans: int
    executables: int
    analyses_loaded: int = 0


class OnceCache(Generic[V]):
    """A dict whose values are made once per key, however many threads ask."""

    def __init__(self) -> None:
        self._done: dict[Hashable, V] = {}
        self._pending: dict[Hashable, concurrent.futures.Future[V]] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        return self._done.get(key)

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key``, made by ``make()`` if no thread has made it yet.

        An exception from ``make`` reaches every thread that waited for it, and
        the key stays unmade (the next call tries again).
        """
        value = self._done.get(key)
        if value is not None:
            return value
        with self._lock:
            if key in self._done:
                return self._done[key]
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = concurrent.futures.Future()
        if not owner:
            return pending.result()
        try:
            value = make()
        except BaseException as e:
            with self._lock:
                del self._pending[key]
            pending.set_exception(e)
            raise
        with self._lock:
            self._done[key] = value
            del self._pending[key]
        pending.set_result(value)
        return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._done[key] = value

    def values(self) -> Iterator[V]:
        return iter(list(self._done.values()))

    def __len__(self) -> int:
        return len(self._done)


def done_future(value: V) -> concurrent.futures.Future[V]:
    """A future that already holds ``value``."""
    f: concurrent.futures.Future[V] = concurrent.futures.Future()
    f.set_result(value)
    return f
