"""jaxmem's analyses on disk: a rerun loads its plan sets instead of deriving them again.

An entry is keyed by what the plan set is a function of: the symbolic trace's
jaxpr (printed with its name stacks, which name the residual groups), the shape
domain, the planning settings (symbolic, offload, device rates, donation, the
scheduler), the JAX and jaxlib versions, the backend, jaxmem's own source and the
entry format. The key is budget-independent, like the analysis. The trace is redone
on load (it is cheap and needed anyway); the levels, memory models and orders are
read back (:mod:`jaxmem.plan.stored`).

An entry is written to a temporary file in the same directory and renamed into
place (``os.replace``, atomic), so a reader never sees half an entry, and a run
killed mid-write leaves only a temporary file no reader opens (a later write
removes it once it is an hour old). Each entry holds a
SHA-256 of its body and its own key; an entry that is unreadable, truncated,
corrupt, of another format or key, or that does not fit the fresh trace is
ignored, derived again and overwritten, never trusted. Entries are JSON data;
loading one runs no code from it.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem, tempfile
    >>> d = tempfile.TemporaryDirectory()  # removed when the example ends
    >>> def step(w, x):
    ...     return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
    >>> kw = dict(polymorphic_shapes=(None, "b, 8"), constraints=("b <= 64",), cache_dir=d.name)
    >>> jaxmem.jit(step, **kw).plans(*args).levels[0].recompute
    ()
    >>> again = jaxmem.jit(step, **kw)
    >>> _ = again.plans(*args)
    >>> again.cache_info().analyses_loaded
    1
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import pathlib
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jaxlib

from jaxmem.dispatch.costs import CostLog, costs_path
from jaxmem.errors import warn
from jaxmem.exprjson import UnencodableError
from jaxmem.plan.analysis import Analysis, Orders, PlanInputs, derive_plans
from jaxmem.plan.levels import PlanSet
from jaxmem.plan.stored import StaleEntryError, decode_plans, encode_plans

#: Bumped whenever the layout of an entry changes; older entries then never match.
FORMAT_VERSION = 3
MAGIC = b"jaxmem-analysis\n"
#: A temporary file this old is what a killed writer left behind (a live write takes
#: well under a second); the next write in its directory removes it.
STALE_TEMP_S = 3600.0
SUBDIR = "jaxmem"  # under JAX's compilation cache directory


def cache_directory(cache_dir: pathlib.Path | None) -> pathlib.Path | None:
    """Where analyses go: ``cache_dir``, else ``<jax_compilation_cache_dir>/jaxmem``, else None.

    Read at each analysis, so ``jax.config.update("jax_compilation_cache_dir", DIR)``
    made after ``jaxmem.jit`` still applies.
    """
    if cache_dir is not None:
        return cache_dir
    jax_dir = jax.config.jax_compilation_cache_dir
    return pathlib.Path(jax_dir) / SUBDIR if jax_dir else None


@functools.cache
def source_digest() -> str:
    """SHA-256 of jaxmem's own source: a changed planner never reads an older one's entries."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def runtime_versions() -> tuple[str, str, str]:
    """``(jax, jaxlib, backend)`` as they enter the key (read at each call)."""
    return jax.__version__, jaxlib.__version__, jax.default_backend()


def _scheduler_id(scheduler: Any) -> str:
    if scheduler is None:
        return "None"
    cls = type(scheduler)
    try:  # a user's scheduler whose code changed must not reuse its old orders
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    return f"{cls.__module__}.{cls.__qualname__}|{scheduler!r}|{source}"


def entry_key(inputs: PlanInputs) -> str:
    """The key of the plan set derived from ``inputs`` (hex SHA-256).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmem.plan.analysis import analyze_specs
        >>> seen = []
        >>> _ = analyze_specs(lambda x: x * 2, (), (jnp.ones(3),), (), ("n",), (), None, (),
        ...                   True, planner=lambda i: seen.append(i) or derive_plans(i))
        >>> len(entry_key(seen[0]))
        64
    """
    d = inputs.domain
    parts = [f"format {FORMAT_VERSION}", *runtime_versions(), source_digest(),
             inputs.traced.closed_jaxpr.pretty_print(name_stack=True, custom_pp_eqn_rules=False),
             str(inputs.traced.in_tree), str(inputs.traced.out_tree),
             repr((d.symbols, d.lower, d.upper, [c.text for c in d.constraints])),
             repr((inputs.donated, inputs.symbolic, inputs.offload, inputs.costs)),
             _scheduler_id(inputs.scheduler)]
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()


def entry_path(directory: pathlib.Path, key: str) -> pathlib.Path:
    return directory / f"analysis-{key}.json.z"


def write_entry(path: pathlib.Path, key: str, payload: dict[str, Any]) -> None:
    """Writes an entry atomically: a temporary file in the same directory, then a rename."""
    body = zlib.compress(json.dumps({"format": FORMAT_VERSION, "key": key, "plans": payload},
                                    separators=(",", ":")).encode(), 6)
    data = MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the bytes do
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    sweep_temps(path.parent)


def sweep_temps(directory: pathlib.Path, older_than_s: float = STALE_TEMP_S) -> None:
    """Removes temporary files that killed writers left in ``directory`` (never an entry)."""
    cutoff = time.time() - older_than_s
    for tmp in directory.glob(".tmp-*.part"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except OSError:  # another process removed it first
            pass


def read_entry(path: pathlib.Path, key: str) -> dict[str, Any] | None:
    """The stored plan data at ``path`` if it is whole, intact and for ``key``; else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, _, rest = data.partition(b"\n")
    digest, _, body = rest.partition(b"\n")
    if head + b"\n" != MAGIC or hashlib.sha256(body).hexdigest().encode() != digest:
        return None
    try:
        entry = json.loads(zlib.decompress(body))
    except (zlib.error, ValueError):
        return None
    if (not isinstance(entry, dict) or entry.get("format") != FORMAT_VERSION
            or entry.get("key") != key or not isinstance(entry.get("plans"), dict)):
        return None
    return entry["plans"]


class AnalysisStore:
    """One ``jaxmem.jit``'s way to its analyses: the disk store, and what it cost.

    Attributes:
        cache_dir: the explicit directory, or None (JAX's compilation cache's ``jaxmem/``
            subfolder when that is configured, else no disk store).
        loaded: analyses whose plan sets came from disk.
        built: analyses whose plan sets were derived.
        seconds: time spent in analyses (trace, graph, and deriving or loading plans).
    """

    def __init__(self, cache_dir: pathlib.Path | None = None) -> None:
        self.cache_dir = cache_dir
        self.loaded = 0
        self.built = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._keys: dict[int, str] = {}  # id(analysis graph) -> its entry key

    def _costs_entry(self, analysis: Analysis, budget_bytes: int | None
                     ) -> tuple[pathlib.Path, str] | None:
        directory = cache_directory(self.cache_dir)
        key = self._keys.get(id(analysis.graph))
        if directory is None or key is None:
            return None
        return costs_path(directory, key, budget_bytes), f"costs|{key}|{budget_bytes}"

    def read_costs(self, analysis: Analysis, budget_bytes: int | None, log: CostLog) -> bool:
        """Adds what earlier runs stored for ``analysis`` under the budget to ``log``."""
        entry = self._costs_entry(analysis, budget_bytes)
        stored = read_entry(*entry) if entry is not None else None
        return stored is not None and log.merge_json(stored)

    def write_costs(self, analysis: Analysis, budget_bytes: int | None, log: CostLog) -> None:
        """Stores ``log`` for the next run; a failure only warns."""
        entry = self._costs_entry(analysis, budget_bytes)
        if entry is not None:
            try:
                write_entry(entry[0], entry[1], log.to_json())
            except OSError as e:
                warn(f"jaxmem: compile and step times not stored: {e}")

    def analyze(self, run: Callable[[Callable[[PlanInputs], tuple[PlanSet, Orders]]], Analysis]
                ) -> Analysis:
        """``run(planner)``, timed, with :meth:`plan` as the planner."""
        start = time.perf_counter()
        try:
            return run(self.plan)
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - start

    def plan(self, inputs: PlanInputs) -> tuple[PlanSet, Orders]:
        """The plan set and orders of ``inputs``: loaded where a valid entry exists, else
        derived (and stored, where there is a directory)."""
        directory = cache_directory(self.cache_dir)
        path = key = None
        if directory is not None:
            key = entry_key(inputs)
            with self._lock:
                self._keys[id(inputs.graph)] = key
            path = entry_path(directory, key)
            stored = read_entry(path, key)
            if stored is not None:
                try:
                    out = decode_plans(stored, inputs.graph, inputs.domain)
                except StaleEntryError:
                    out = None  # derived again below, and the entry overwritten
                if out is not None:
                    self._count(loaded=1)
                    return out
        plans, orders = derive_plans(inputs)
        self._count(built=1)
        if path is not None and key is not None:
            _save(path, key, plans, orders, inputs)
        return plans, orders

    def _count(self, loaded: int = 0, built: int = 0) -> None:
        with self._lock:
            self.loaded += loaded
            self.built += built


def _save(path: pathlib.Path, key: str, plans: PlanSet, orders: Orders,
          inputs: PlanInputs) -> None:
    """Stores a plan set; a failure costs the next run an analysis, never this call."""
    try:
        write_entry(path, key, encode_plans(plans, orders, inputs.graph))
    except (OSError, UnencodableError) as e:
        warn(f"jaxmem: analysis not stored in {path.parent}: {e}")
