"""A concrete plan: one level applied at concrete dims, compiled by XLA.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> f = jaxmem.jit(lambda x: (x * 2).sum(), polymorphic_shapes=("n",))
    >>> print(f.plan_for(jnp.ones(4)).describe().splitlines()[0])
    jaxmem plan at n=4: level 0 of 1 (save every residual)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import jax

from jaxmem._units import human_bytes
from jaxmem.dispatch import local_dims
from jaxmem.grad import microbatching
from jaxmem.graph import JaxmemWarning, build_graph
from jaxmem.plan.remat import apply_remat
from jaxmem.plan.residuals import find_residuals
from jaxmem.rewrite import as_function, compiler_options
from jaxmem.schedulers import reorder

if TYPE_CHECKING:
    from jaxmem.dispatch import Analysis


def xla_peak_bytes(compiled: Any) -> int:
    """Peak bytes of a compiled executable as jaxmem judges every figure: XLA's own.

    ``argument + output - alias + temp`` from ``compiled.memory_analysis()``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmem
        >>> c = jax.jit(lambda x: x * 2).lower(jnp.ones(256, jnp.float32)).compile()
        >>> jaxmem.xla_peak_bytes(c)
        2048
    """
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this executable has no memory_analysis()")
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for one concrete shape.

    Attributes:
        dims: the bound dimension values.
        level: index of the recomputation level.
        n_levels: how many levels the function has.
        recompute: residual groups recomputed (e.g. ``layer_*/attn:exp``).
        saved: residual groups kept from forward to backward.
        predicted_peak_bytes: jaxmem's symbolic prediction at ``dims``.
        peak_bytes: XLA's own figure for the compiled executable.
        budget_bytes: the budget, or None.
        compiled: the ``jax.stages.Compiled`` that runs.
        order_enforced: whether a scheduler's op order is enforced with barriers.
        static_argnums: positions of static arguments (not passed to ``compiled``).
        guard: why this level was chosen.
        microbatches: accumulation steps the batch is split into (1: none).
        offload: residual groups moved to host memory after the forward pass.
        offload_planned: whether offload was considered at all (it is not on CPU).
    """

    dims: dict[str, int]
    level: int
    n_levels: int
    recompute: tuple[str, ...]
    saved: tuple[str, ...]
    predicted_peak_bytes: int
    peak_bytes: int
    budget_bytes: int | None
    compiled: Any = dataclasses.field(repr=False)
    order_enforced: bool = False
    static_argnums: tuple[int, ...] = ()
    guard: str = ""
    microbatches: int = 1
    offload: tuple[str, ...] = ()
    offload_planned: bool = False

    def run(self, *args: Any) -> Any:
        """Runs the compiled executable on the full positional arguments."""
        if not self.static_argnums:
            return self.compiled(*args)
        return self.compiled(*[a for i, a in enumerate(args) if i not in self.static_argnums])

    def describe(self) -> str:
        """Human-readable: what is saved, recomputed, offloaded, and why."""
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items()) or "static shapes"
        parts = ([f"recompute {len(self.recompute)} residual group(s)"] if self.recompute
                 else []) + ([f"offload {len(self.offload)}"] if self.offload else [])
        what = ", ".join(parts) or "save every residual"
        budget = ("no budget" if self.budget_bytes is None
                  else f"budget {human_bytes(self.budget_bytes)}")
        lines = [f"jaxmem plan at {dims}: level {self.level} of {self.n_levels} ({what})",
                 f"  predicted peak {human_bytes(self.predicted_peak_bytes)}, XLA peak "
                 f"{human_bytes(self.peak_bytes)}, {budget}"]
        if self.guard:
            lines.append(f"  why: {self.guard}")
        if not self.recompute and not self.offload:
            lines.append("  recompute nothing")
        for g in self.recompute:
            lines.append(f"  recompute {g}")
        for g in self.saved:
            lines.append(f"  save      {g}")
        for g in self.offload:
            lines.append(f"  offload   {g} (to host memory after the forward pass, back before "
                         "its first backward use)")
        if not self.offload:
            lines.append("  offload   nothing" + ("" if self.offload_planned else
                                                  " (host offload is not planned on this "
                                                  "backend)"))
        if self.microbatches > 1:
            lines.append(f"  microbatch the batch into {self.microbatches} accumulation steps "
                         "(no recomputation level fits the budget)")
        if self.order_enforced:
            lines.append("  op order  the scheduler's order, enforced with optimization barriers")
        return "\n".join(lines)


def _as_struct(x: Any) -> jax.ShapeDtypeStruct:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)


def compile_level(analysis: Analysis, k: int, dims: dict[str, int], static: tuple[Any, ...],
                  dynamic: tuple[Any, ...], jitted: Any, budget: int | None = None,
                  apply_order: bool = True, microbatches: int = 1, axis: str = "") -> Plan:
    """Applies level ``k`` to the concrete trace at ``dims`` and compiles it.

    ``budget`` overrides ``jitted.budget_bytes`` (a re-plan after an out-of-memory
    error); ``apply_order=False`` ignores the scheduler's op order; ``microbatches``
    splits dim ``axis`` into that many accumulation steps in ``jaxmem.value_and_grad``.
    """
    level = analysis.plans.levels[k]
    wanted = set(level.recompute) | set(level.offload)
    order = analysis.orders[k] if apply_order else None
    enforced = False
    plain = (not wanted and microbatches == 1
             and (order is None or order == list(range(len(order)))))
    if plain:
        # Nothing to rewrite: compile the user's function itself, as jax.jit would.
        run: Any = analysis.flat_fn
    else:
        run, enforced = _rewritten(analysis, k, dims, dynamic, order, microbatches, axis)

    kwargs: dict[str, Any] = {"donate_argnums": analysis.donate_dynamic}
    if jitted.in_shardings is not None:
        kwargs["in_shardings"] = jitted.in_shardings
    if jitted.out_shardings is not None:
        kwargs["out_shardings"] = jitted.out_shardings
    lowered = jax.jit(run, **kwargs).lower(*dynamic)
    compiled = lowered.compile(compiler_options=compiler_options())
    all_groups = [g for g, _ in analysis.plans.groups]
    flat_shardings = jax.tree_util.tree_leaves(compiled.input_shardings[0])
    predicted = level.peak_fn(local_dims(analysis, dims, flat_shardings))
    budget = jitted.budget_bytes if budget is None else budget
    if k == 0:
        guard = ("nothing needs recomputing: the predicted peak fits" if budget is not None
                 and predicted <= budget else "no budget given" if budget is None else
                 "level 0 was tried first")
    else:
        guard = (f"cheaper levels are predicted or measured above the budget; this one "
                 f"predicts {human_bytes(predicted)}")
    return Plan(dict(dims), k, len(analysis.plans.levels), level.recompute,
                tuple(g for g in all_groups if g not in wanted), predicted,
                xla_peak_bytes(compiled), budget, compiled, enforced, jitted.static_argnums,
                guard, microbatches, level.offload, analysis.offload_planned)


def _rewritten(analysis: Analysis, k: int, dims: dict[str, int], dynamic: tuple[Any, ...],
               order: list[int] | None, microbatches: int, axis: str) -> tuple[Any, bool]:
    """The function of level ``k`` at these shapes: concrete trace, remat, order."""
    level = analysis.plans.levels[k]
    avals = [_as_struct(x) for x in jax.tree_util.tree_leaves(dynamic)]
    tree = jax.tree_util.tree_structure(dynamic)

    def fresh(*a: Any) -> Any:  # a new function: JAX's trace cache cannot see the context
        return analysis.flat_fn(*a)

    with microbatching(microbatches, dims.get(axis, 0)):
        closed, out_shape = jax.make_jaxpr(fresh if microbatches > 1 else analysis.flat_fn,
                                           return_shape=True)(
            *jax.tree_util.tree_unflatten(tree, avals))
    graph = build_graph(closed)
    residuals = find_residuals(graph)
    recompute, offload = set(level.recompute), set(level.offload)
    rewritten = apply_remat(graph, [r for r in residuals if r.group in recompute],
                            [r for r in residuals if r.group in offload], residuals)
    enforced = False
    if order is not None and order != list(range(len(order))) and microbatches == 1:
        same = [n.primitive for n in rewritten.nodes] == [
            n.primitive for n in analysis.plans.levels[k].graph.nodes]
        if same:
            rewritten, enforced = reorder(rewritten, order), True
        else:
            warnings.warn("jaxmem: the concrete trace differs from the symbolic one; the "
                          "scheduler's order is not applied at this shape", JaxmemWarning,
                          stacklevel=3)
    body = as_function(rewritten, enforce_order=enforced)
    out_tree = jax.tree_util.tree_structure(out_shape)

    def run(*dyn: Any) -> Any:
        return jax.tree_util.tree_unflatten(out_tree, body(*jax.tree_util.tree_leaves(dyn)))

    return run, enforced
