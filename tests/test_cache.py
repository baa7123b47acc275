"""``jaxmem.dispatch.cache.OnceCache``: made once per key, however many threads ask."""

from __future__ import annotations

import threading
import time

import pytest

from jaxmem.dispatch.cache import OnceCache


def test_concurrent_askers_of_one_key_share_one_make_and_keys_run_in_parallel():
    cache: OnceCache[int] = OnceCache()
    made: list[str] = []
    inside = threading.Barrier(2, timeout=10)

    def make(key: str) -> int:
        made.append(key)
        if key in ("a", "b"):
            inside.wait()  # both distinct keys are being made at the same time
        time.sleep(0.05)
        return len(key)

    results: dict[int, int] = {}

    def ask(i: int, key: str) -> None:
        results[i] = cache.get_or_make(key, lambda: make(key))

    threads = [threading.Thread(target=ask, args=(i, k))
               for i, k in enumerate(["a", "a", "b", "a", "b"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sorted(made) == ["a", "b"] and len(cache) == 2
    assert results == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}


def test_a_failed_make_reaches_waiters_and_leaves_the_key_unmade():
    cache: OnceCache[int] = OnceCache()

    def boom() -> int:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        cache.get_or_make("k", boom)
    assert cache.get("k") is None and len(cache) == 0
    assert cache.get_or_make("k", lambda: 7) == 7
