"""How a train step is compiled and run: plain ``jax.jit`` or ``jaxmem.jit``.

Both runners compile one executable per concrete batch shape (no padding to
buckets), record its peak bytes as docs/design.md §2 defines them
(``argument + output - alias + temp`` of ``compiled.memory_analysis()``), and count
distinct executables. Shapes announced with ``compile_ahead`` are compiled on
``compile_workers`` background threads while steps run (XLA's compile releases the
GIL); ``wait_s`` is the time steps spent waiting for the compiler, ``compile_s`` the
wall time during which a compile was queued or running.

Example:
    >>> runner = XlaRunner(train_step, state_spec, compile_workers=2)  # doctest: +SKIP
    >>> runner.compile_ahead([(8, 412), (8, 97)])  # doctest: +SKIP
    >>> state, metrics = runner(state, batch)  # doctest: +SKIP
    >>> runner.peaks  # doctest: +SKIP
    {(8, 412): 250123456}
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from jaxmem import xla_peak_bytes
from jaxmem.lower import compiler_options
from train.compiles import busy_seconds

Shape = tuple[int, ...]


class JaxmemUnavailableError(RuntimeError):
    """``--scheduler jaxmem`` was asked for, but the installed jaxmem has no ``jit``."""


def batch_spec(
    shape: Shape, sharding: Any = None, packed: bool = False
) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract batch of ``shape`` as ``train.batching.collate`` makes it (``packed``:
    as ``train.packing.collate_packed`` does, with ``segment_ids`` and ``positions``).

    Example:
        >>> batch_spec((8, 100))["loss_mask"].dtype
        dtype('float32')
    """
    def spec(dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    packing = {"segment_ids": spec(jnp.int32), "positions": spec(jnp.int32)} if packed else {}
    return {"tokens": spec(jnp.int32), "targets": spec(jnp.int32),
            "loss_mask": spec(jnp.float32), **packing}


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
        remat: the model rematerialises its layers (``--remat``): compile with the XLA
            options that keep ``jax.checkpoint``'s barriers (on CPU XLA removes them
            otherwise, docs/design.md §4).
    """

    name = "xla"

    def __init__(
        self, train_step: Callable[..., Any], state_spec: Any, batch_sharding: Any = None,
        mesh_shardings: bool = False, compile_workers: int = 0, packed: bool = False,
        remat: bool = False,
    ) -> None:
        kwargs = {}
        if mesh_shardings:
            state_sh = jax.tree.map(lambda x: x.sharding, state_spec)
            kwargs = {"in_shardings": (state_sh, batch_sharding), "out_shardings": (state_sh, None)}
        self.jitted = jax.jit(train_step, donate_argnums=0, **kwargs)
        self.state_spec, self.batch_sharding = state_spec, batch_sharding
        self.packed = packed  # batches of packed rows (--packing)
        self.compiler_options = compiler_options() if remat else None
        self._pool = ThreadPoolExecutor(compile_workers) if compile_workers > 0 else None
        self._compiled: dict[Shape, Future[jax.stages.Compiled]] = {}
        self._lock = threading.Lock()
        self._busy: list[tuple[float, float]] = []  # [start, end] of every compile
        self.peaks: dict[Shape, int] = {}
        self.predicted: dict[Shape, int] = {}
        self.wait_s = 0.0  # time the caller spent waiting for the compiler

    @property
    def compiles(self) -> int:
        """Number of distinct executables compiled (background ones included)."""
        return sum(not f.cancelled() for f in self._compiled.values())

    @property
    def analyses(self) -> tuple[float, int]:
        """Seconds of jaxmem analysis, and analyses loaded from disk: none under XLA."""
        return 0.0, 0

    @property
    def compile_s(self) -> float:
        """Wall seconds during which at least one compile ran (any thread)."""
        with self._lock:
            return busy_seconds(self._busy)

    def _compile(self, shape: Shape) -> jax.stages.Compiled:
        start = time.perf_counter()
        compiled = self.jitted.lower(self.state_spec,
                                     batch_spec(shape, self.batch_sharding, self.packed))
        compiled = compiled.compile(compiler_options=self.compiler_options)
        with self._lock:
            self._busy.append((start, time.perf_counter()))
            self.peaks[shape] = xla_peak_bytes(compiled)
        return compiled

    def compile_ahead(self, shapes: Iterable[Shape]) -> None:
        """Start compiling ``shapes`` in the background, in order (no-op without workers)."""
        if self._pool is None:
            return
        for shape in shapes:
            if shape not in self._compiled:
                self._compiled[shape] = self._pool.submit(self._compile, shape)

    def plan_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        """The shape each announced batch runs at: its own (plain XLA pads nothing)."""
        return list(shapes)

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
    """``jaxmem.jit`` per docs/design.md §2, within ``budget_bytes``.

    Shapes announced with :meth:`compile_ahead` are planned and compiled by
    ``Jitted.precompile`` on ``compile_workers`` background threads, distinct shapes
    in parallel; a step whose shape is still being compiled waits for that compile
    instead of compiling it again.

    Args:
        train_step: ``(state, batch) -> (state, metrics)``.
        batch_size: largest ``b`` (constraint ``b <= batch_size``).
        max_len: largest ``s`` (constraint ``s <= max_len``).
        budget_bytes: per-device budget, or ``None``.
        state_spec: ``ShapeDtypeStruct`` pytree (with shardings) of the state; needed
            to compile ahead (the state itself is donated, so only its spec is used).
        batch_sharding: sharding of every batch array.
        mesh_shardings: pass ``in_shardings``/``out_shardings`` to ``jaxmem.jit``
            (``--mesh``).
        compile_workers: background compile threads; 0 plans on first use only.
        compile_plan: ``"cost"``: :meth:`plan_shapes` lets ``Jitted.plan_compiles`` choose
            the shapes to compile, padding the sequence dim ``s`` (exact here: padded
            positions are loss-masked and the model is causal); ``"exact"``: none padded.
        max_tokens: token-budget batching (``--max-tokens``): also ``b*s <= max_tokens``.
            The batch dim is never padded; ``s`` is padded only to another announced or
            compiled shape of the same ``b``, which is within the budget too.

    Raises:
        JaxmemUnavailableError: the installed jaxmem has no ``jit`` yet.
    """

    name = "jaxmem"

    def __init__(
        self, train_step: Callable[..., Any], batch_size: int, max_len: int,
        budget_bytes: int | None, state_spec: Any = None, batch_sharding: Any = None,
        mesh_shardings: bool = False, compile_workers: int = 0, packed: bool = False,
        compile_plan: str = "cost", max_tokens: int | None = None,
    ) -> None:
        try:
            import jaxmem

            jit = jaxmem.jit
        except (ImportError, AttributeError) as e:
            raise JaxmemUnavailableError(
                "--scheduler jaxmem needs jaxmem.jit (docs/design.md section 2), which this "
                f"checkout does not provide yet ({e}); use --scheduler xla meanwhile"
            ) from e
        kwargs = {}
        if mesh_shardings:
            state_sh = jax.tree.map(lambda x: x.sharding, state_spec)
            kwargs = {"in_shardings": (state_sh, batch_sharding),
                      "out_shardings": (state_sh, None)}
        self.step = jit(
            train_step,
            polymorphic_shapes=(None, "b, s"),
            constraints=(f"b <= {batch_size}", f"s <= {max_len}",
                         *([f"b*s <= {max_tokens}"] if max_tokens else [])),
            budget_bytes=budget_bytes,
            donate_argnums=(0,),
            **kwargs,
        )
        self.state_spec, self.batch_sharding = state_spec, batch_sharding
        self.compile_workers, self.packed = compile_workers, packed
        self.compile_plan = compile_plan
        self.compile_plans: list[Any] = []  # the CompilePlan of every announcement
        self.first_plan_s = 0.0  # the first plan's wall time (analysis, first compile)
        self._ahead: dict[Shape, Future[Any]] = {}
        self._plans: dict[Shape, Any] = {}
        self._lock = threading.Lock()
        self._busy: list[tuple[float, float]] = []  # [start, end] of planning/compiling
        self.peaks: dict[Shape, int] = {}
        self.predicted: dict[Shape, int] = {}
        self.wait_s = 0.0  # time steps spent waiting for their plan

    @property
    def compiles(self) -> int:
        """Number of distinct executables planned (background ones included)."""
        return self.step.compiles

    @property
    def analyses(self) -> tuple[float, int]:
        """Seconds the step spent in jaxmem's analyses, and how many it loaded from disk."""
        return self.step.analysis_s, self.step.cache_info().analyses_loaded

    @property
    def compile_s(self) -> float:
        """Wall seconds during which a plan was being made (queued or compiling, any thread)."""
        with self._lock:
            return busy_seconds(self._busy)

    def _record(self, start: float, end: float) -> None:
        with self._lock:
            self._busy.append((start, end))

    def compile_ahead(self, shapes: Iterable[Shape]) -> None:
        """Plan and compile ``shapes`` on background threads, in the order given.

        A no-op without ``compile_workers`` or ``state_spec``; shapes already
        announced or planned are skipped.
        """
        if self.compile_workers < 1 or self.state_spec is None:
            return
        new = [s for s in dict.fromkeys(tuple(s) for s in shapes)
               if s not in self._ahead and s not in self._plans]
        if not new:
            return
        start = time.perf_counter()
        futures = self.step.precompile(
            [(self.state_spec, batch_spec(s, self.batch_sharding, self.packed)) for s in new],
            background=True, workers=self.compile_workers)
        for shape, future in zip(new, futures, strict=True):
            self._ahead[shape] = future
            future.add_done_callback(lambda _, t=start: self._record(t, time.perf_counter()))

    def plan_shapes(self, shapes: Sequence[Shape]) -> list[Shape | None]:
        """The shape each announced batch runs at, from jaxmem's compile plan.

        With ``compile_plan="cost"`` (and a state spec, unpacked rows), the shapes go to
        ``Jitted.plan_compiles`` with ``s`` paddable; otherwise each runs as it is.
        Before any step has been timed (here or by an earlier run with the same cache),
        only the first batch is decided: it runs at the longest announced shape of its
        own ``b`` (all shapes share ``b`` unless ``--max-tokens``), which every plan
        compiles, so that its time calibrates the plan of the rest (None: not decided
        yet, announce it again).
        """
        if (self.compile_plan != "cost" or self.state_spec is None or self.packed
                or not shapes):
            return list(shapes)
        longest = max((x for x in shapes if x[0] == shapes[0][0]), key=lambda x: x[1])
        if not self.compile_plans:  # read what earlier runs measured before judging
            self._plan([longest])
        if not self.step.costs.steps:
            return [longest] + [None] * (len(shapes) - 1)
        plan = self._plan(shapes)
        out: list[Shape | None] = []
        for b, s in shapes:
            cover = dict(zip(plan.names, plan.cover(tuple({"b": b, "s": s}[n]
                                                          for n in plan.names)), strict=True))
            out.append((cover["b"], cover["s"]))
        return out

    def _plan(self, shapes: Sequence[Shape]) -> Any:
        start = time.perf_counter()
        plan = self.step.plan_compiles(
            [(self.state_spec, batch_spec(s, self.batch_sharding)) for s in shapes], ("s",))
        end = time.perf_counter()
        self._record(start, end)
        self.wait_s += end - start  # the loop waits for this (it may compile a shape)
        if not self.compile_plans:  # the first also analyses and compiles the largest call
            self.first_plan_s = end - start
        self.compile_plans.append(plan)
        return plan

    def prepare(self, state: Any, batch: dict[str, Any]) -> Any:
        """Plan (once) for ``batch``'s shape; record measured and predicted peaks.

        A shape compiled ahead is awaited (a background compile in progress is not
        repeated); any other is planned here.
        """
        shape = tuple(batch["tokens"].shape)
        if shape not in self._plans:
            start = time.perf_counter()
            plan = self.step.plan_for(state, batch)
            end = time.perf_counter()
            self.wait_s += end - start
            self._record(start, end)
            self._plans[shape] = plan
            self.peaks[shape] = xla_peak_bytes(plan.compiled)
            self.predicted[shape] = int(plan.predicted_peak_bytes)
        return self._plans[shape]

    def __call__(self, state: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        plan = self.prepare(state, batch)
        start = time.perf_counter()
        out = jax.block_until_ready(self.step(state, batch))  # the loop reads the loss next
        self.step.costs.record_step(plan.dims, time.perf_counter() - start)
        return out

    def describe(self, shape: Shape) -> str:
        """jaxmem's own account of the plan for ``shape``."""
        return self._plans[shape].describe()

    def close(self) -> None:
        """Cancel announced compiles that have not started; wait for those running."""
        for future in self._ahead.values():
            future.cancel()
        concurrent.futures.wait([f for f in self._ahead.values() if not f.cancelled()])
        self.step.close()


def make_runner(
    scheduler: str, train_step: Callable[..., Any], *, state_spec: Any, batch_sharding: Any,
    mesh: bool, batch_size: int, max_len: int, budget_bytes: int | None,
    compile_workers: int = 0, packed: bool = False, compile_plan: str = "cost",
    remat: bool = False, max_tokens: int | None = None,
) -> XlaRunner | JaxmemRunner:
    """The runner for ``--scheduler`` (``"xla"`` or ``"jaxmem"``).

    Args:
        scheduler: ``"xla"`` or ``"jaxmem"``.
        train_step: ``(state, batch) -> (state, metrics)``.
        state_spec: ``ShapeDtypeStruct`` pytree (with shardings) of the state.
        batch_sharding: sharding of every batch array.
        mesh: whether the run is sharded over a mesh (shardings go to the jit).
        batch_size, max_len, budget_bytes: the jaxmem constraints and budget.
        compile_workers: background compile threads (both schedulers).
        packed: batches hold packed rows (``segment_ids`` and ``positions`` too).
        compile_plan: jaxmem's ``compile_plan`` (``"cost"`` or ``"exact"``).
        remat: the model rematerialises its layers (``--remat``; the xla runner).
        max_tokens: ``--max-tokens`` (jaxmem's constraint ``b*s <= max_tokens``).
    """
    if scheduler == "xla":
        return XlaRunner(train_step, state_spec, batch_sharding, mesh, compile_workers, packed,
                         remat)
    if scheduler == "jaxmem":
        return JaxmemRunner(train_step, batch_size, max_len, budget_bytes, state_spec,
                            batch_sharding, mesh, compile_workers, packed, compile_plan,
                            max_tokens)
    raise ValueError(f"--scheduler must be 'xla' or 'jaxmem', got {scheduler!r}")
