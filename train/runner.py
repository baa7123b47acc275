"""How a train step is compiled and run: plain ``jax.jit`` or ``jaxmem.jit``.

Both runners compile one executable per concrete batch shape (no padding to
buckets), record its peak bytes as DESIGN.md §2 defines them
(``argument + output - alias + temp`` of ``compiled.memory_analysis()``), and count
distinct executables.

Example:
    >>> runner = XlaRunner(train_step, state_spec, compile_workers=2)  # doctest: +SKIP
    >>> runner.compile_ahead([(8, 412), (8, 97)])  # doctest: +SKIP
    >>> state, metrics = runner(state, batch)  # doctest: +SKIP
    >>> runner.peaks  # doctest: +SKIP
    {(8, 412): 250123456}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from jaxmem import xla_peak_bytes

Shape = tuple[int, ...]


class JaxmemUnavailableError(RuntimeError):
    """``--scheduler jaxmem`` was asked for, but the installed jaxmem has no ``jit``."""


def batch_spec(shape: Shape, sharding: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract batch of ``shape`` as ``train.batching.collate`` makes it.

    Example:
        >>> batch_spec((8, 100))["loss_mask"].dtype
        dtype('float32')
    """
    def spec(dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return {"tokens": spec(jnp.int32), "targets": spec(jnp.int32),
            "loss_mask": spec(jnp.float32)}


class XlaRunner:
    """``jax.jit(train_step, donate_argnums=0)``, compiled ahead of time once per shape.

    Compiling with ``.lower(...).compile()`` and calling the ``Compiled`` object runs
    exactly what ``jax.jit`` would run, and avoids compiling twice (once for the
    memory figure and once more inside the jit call). Shapes announced with
    :meth:`compile_ahead` are compiled by background threads while steps run (XLA
    compiles outside the GIL), so the loop waits less for the compiler.

    Args:
        train_step: ``(state, batch) -> (state, metrics)``.
        state_spec: ``ShapeDtypeStruct`` pytree (with shardings) of the state.
        batch_sharding: sharding of every batch array.
        mesh_shardings: pass ``in_shardings``/``out_shardings`` to ``jax.jit`` (``--mesh``).
        compile_workers: background compile threads; 0 compiles on first use only.
    """

    name = "xla"

    def __init__(
        self, train_step: Callable[..., Any], state_spec: Any, batch_sharding: Any = None,
        mesh_shardings: bool = False, compile_workers: int = 0,
    ) -> None:
        kwargs = {}
        if mesh_shardings:
            state_sh = jax.tree.map(lambda x: x.sharding, state_spec)
            kwargs = {"in_shardings": (state_sh, batch_sharding), "out_shardings": (state_sh, None)}
        self.jitted = jax.jit(train_step, donate_argnums=0, **kwargs)
        self.state_spec, self.batch_sharding = state_spec, batch_sharding
        self._pool = ThreadPoolExecutor(compile_workers) if compile_workers > 0 else None
        self._compiled: dict[Shape, Future[jax.stages.Compiled]] = {}
        self._lock = threading.Lock()
        self.peaks: dict[Shape, int] = {}
        self.predicted: dict[Shape, int] = {}
        self.compile_s = 0.0  # summed compile time of all executables (any thread)
        self.wait_s = 0.0  # time the caller spent waiting for the compiler

    @property
    def compiles(self) -> int:
        """Number of distinct executables compiled (background ones included)."""
        return sum(not f.cancelled() for f in self._compiled.values())

    def _compile(self, shape: Shape) -> jax.stages.Compiled:
        start = time.perf_counter()
        compiled = self.jitted.lower(self.state_spec, batch_spec(shape, self.batch_sharding))
        compiled = compiled.compile()
        with self._lock:
            self.compile_s += time.perf_counter() - start
            self.peaks[shape] = xla_peak_bytes(compiled)
        return compiled

    def compile_ahead(self, shapes: Iterable[Shape]) -> None:
        """Start compiling ``shapes`` in the background (no-op without workers)."""
        if self._pool is None:
            return
        for shape in shapes:
            if shape not in self._compiled:
                self._compiled[shape] = self._pool.submit(self._compile, shape)

    def prepare(self, batch: dict[str, Any]) -> jax.stages.Compiled:
        """The executable for ``batch``'s shape (compiled now, or awaited)."""
        shape = tuple(batch["tokens"].shape)
        start = time.perf_counter()
        if shape not in self._compiled:
            done: Future[jax.stages.Compiled] = Future()
            done.set_result(self._compile(shape))
            self._compiled[shape] = done
        compiled = self._compiled[shape].result()
        self.wait_s += time.perf_counter() - start
        return compiled

    def __call__(self, state: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return self.prepare(batch)(state, batch)

    def describe(self, shape: Shape) -> str:
        """What this runner did for ``shape`` (plain XLA: no plan)."""
        return f"plain jax.jit: XLA's default schedule, no rematerialisation ({shape})"

    def close(self) -> None:
        """Stop background compiles that have not started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class JaxmemRunner:
    """``jaxmem.jit`` per DESIGN.md §2, within ``budget_bytes``.

    Args:
        train_step: ``(state, batch) -> (state, metrics)``.
        batch_size: largest ``b`` (constraint ``b <= batch_size``).
        max_len: largest ``s`` (constraint ``s <= max_len``).
        budget_bytes: per-device budget, or ``None``.
        state_shardings: shardings of the state (``--mesh``), else ``None``.
        batch_sharding: sharding of every batch array (``--mesh``), else ``None``.

    Raises:
        JaxmemUnavailableError: the installed jaxmem has no ``jit`` yet.
    """

    name = "jaxmem"

    def __init__(
        self, train_step: Callable[..., Any], batch_size: int, max_len: int,
        budget_bytes: int | None, state_shardings: Any = None, batch_sharding: Any = None,
    ) -> None:
        try:
            import jaxmem

            jit = jaxmem.jit
        except (ImportError, AttributeError) as e:
            raise JaxmemUnavailableError(
                "--scheduler jaxmem needs jaxmem.jit (DESIGN.md section 2), which this "
                f"checkout does not provide yet ({e}); use --scheduler xla meanwhile"
            ) from e
        kwargs = {}
        if state_shardings is not None:
            kwargs = {"in_shardings": (state_shardings, batch_sharding),
                      "out_shardings": (state_shardings, None)}
        self.step = jit(
            train_step,
            polymorphic_shapes=(None, "b, s"),
            constraints=(f"b <= {batch_size}", f"s <= {max_len}"),
            budget_bytes=budget_bytes,
            donate_argnums=(0,),
            **kwargs,
        )
        self._plans: dict[Shape, Any] = {}
        self.peaks: dict[Shape, int] = {}
        self.predicted: dict[Shape, int] = {}
        self.compile_s = self.wait_s = 0.0

    @property
    def compiles(self) -> int:
        """Number of distinct executables behind the plans used."""
        return len({id(plan.compiled) for plan in self._plans.values()})

    def prepare(self, state: Any, batch: dict[str, Any]) -> Any:
        """Plan (once) for ``batch``'s shape; record measured and predicted peaks."""
        shape = tuple(batch["tokens"].shape)
        if shape not in self._plans:
            start = time.perf_counter()
            plan = self.step.plan_for(state, batch)
            self.compile_s += time.perf_counter() - start
            self.wait_s = self.compile_s
            self._plans[shape] = plan
            self.peaks[shape] = xla_peak_bytes(plan.compiled)
            self.predicted[shape] = int(plan.predicted_peak_bytes)
        return self._plans[shape]

    def __call__(self, state: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        self.prepare(state, batch)
        return self.step(state, batch)

    def describe(self, shape: Shape) -> str:
        """jaxmem's own account of the plan for ``shape``."""
        return self._plans[shape].describe()

    def compile_ahead(self, shapes: Iterable[Shape]) -> None:
        """No-op: planning ahead is jaxmem's own business."""

    def close(self) -> None:
        """Nothing to release."""


def make_runner(
    scheduler: str, train_step: Callable[..., Any], *, state_spec: Any, batch_sharding: Any,
    mesh: bool, batch_size: int, max_len: int, budget_bytes: int | None,
    compile_workers: int = 0,
) -> XlaRunner | JaxmemRunner:
    """The runner for ``--scheduler`` (``"xla"`` or ``"jaxmem"``).

    Args:
        scheduler: ``"xla"`` or ``"jaxmem"``.
        train_step: ``(state, batch) -> (state, metrics)``.
        state_spec: ``ShapeDtypeStruct`` pytree (with shardings) of the state.
        batch_sharding: sharding of every batch array.
        mesh: whether the run is sharded over a mesh (shardings go to the jit).
        batch_size, max_len, budget_bytes: the jaxmem constraints and budget.
        compile_workers: background compile threads (xla).
    """
    if scheduler == "xla":
        return XlaRunner(train_step, state_spec, batch_sharding, mesh, compile_workers)
    if scheduler == "jaxmem":
        state_sh = jax.tree.map(lambda x: x.sharding, state_spec) if mesh else None
        return JaxmemRunner(train_step, batch_size, max_len, budget_bytes, state_sh,
                            batch_sharding if mesh else None)
    raise ValueError(f"--scheduler must be 'xla' or 'jaxmem', got {scheduler!r}")
