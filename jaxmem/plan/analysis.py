"""The analysis of a call: stages trace → graph → symbolic → memory → plan, once per structure.

:func:`analyze_specs` reads the argument specs (with the ``polymorphic_shapes``
and constraints of ``jaxmem.jit``), traces the function with symbolic dims,
builds its graph, shape domain and plan set, and asks the scheduler for each
level's op order. The result, an :class:`Analysis`, is budget-independent: one
per (argument structure, dtypes, static args), shared by every shape and budget.

Example:
    >>> import jax.numpy as jnp
    >>> a = analyze_specs(lambda x: x * 2, (), (jnp.ones((4, 3)),), (), ("b, 3",), ("b <= 8",),
    ...                   None, (), True)
    >>> a.domain.symbols, len(a.plans.levels)
    (('b',), 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem.errors import ShapeOutOfRangeError
from jaxmem.graph import Graph, build_graph
from jaxmem.perf import gc_paused
from jaxmem.plan.bodies import add_body_levels
from jaxmem.plan.levels import PlanSet, plan_levels
from jaxmem.plan.offload import Costs, costs_for, offload_by_default
from jaxmem.schedulers import ScheduleGraph, Scheduler, validate_order
from jaxmem.symbolic import ShapeDomain
from jaxmem.trace import Traced, symbols_of, trace


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Everything jaxmem derives once per (argument structure, dtypes, static args).

    Attributes:
        flat_fn: the function of the dynamic arguments only.
        specs: symbolic specs of the dynamic arguments (a tuple of pytrees).
        flat_specs: their leaves.
        paths: readable paths of the leaves (``args[1]['tokens']``).
        traced: the symbolic trace.
        graph: its graph.
        domain: the shape domain.
        plans: the recomputation levels.
        orders: per level, the scheduler's validated order or None.
        donated: flat indices of donated leaves.
        donate_dynamic: dynamic-argument positions to donate.
        offload_planned: whether the plans considered host offload.
    """

    flat_fn: Callable[..., Any]
    specs: tuple[Any, ...]
    flat_specs: tuple[jax.ShapeDtypeStruct, ...]
    paths: tuple[str, ...]
    traced: Traced
    graph: Graph
    domain: ShapeDomain
    plans: PlanSet
    orders: tuple[list[int] | None, ...]
    donated: tuple[int, ...]
    donate_dynamic: tuple[int, ...]
    offload_planned: bool = False


Orders = tuple[list[int] | None, ...]


@dataclasses.dataclass(frozen=True)
class Declared:
    """The declared shapes of the dynamic arguments, read without tracing.

    Attributes:
        specs: their symbolic specs (a tuple of pytrees).
        flat_specs: the specs' leaves.
        paths: readable paths of the leaves.
        domain: the shape domain of the declared dims and constraints.
    """

    specs: tuple[Any, ...]
    flat_specs: tuple[jax.ShapeDtypeStruct, ...]
    paths: tuple[str, ...]
    domain: ShapeDomain


def declared_specs(static: tuple[Any, ...], dynamic: tuple[Any, ...],
                   static_argnums: Sequence[int], polymorphic_shapes: Any,
                   constraints: Sequence[str]) -> Declared:
    """The dynamic arguments' specs under ``polymorphic_shapes`` and their domain.

    Raises:
        ShapeOutOfRangeError: an argument is not an array, or its rank is not declared.
    """
    n_args = len(static) + len(dynamic)
    leaves_with_path = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    specs = _symbolic_specs(dynamic, leaves_with_path,
                            _spec_for(polymorphic_shapes, static_argnums, n_args),
                            polymorphic_shapes, constraints)
    flat = tuple(jax.tree_util.tree_leaves(specs))
    symbols, scoped = symbols_of(flat)
    paths = tuple(f"args{jax.tree_util.keystr(p)}" for p, _ in leaves_with_path)
    return Declared(tuple(specs), flat, paths,
                    ShapeDomain.from_constraints(symbols, scoped or tuple(constraints)))


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What the plan set and the orders of one analysis are derived from.

    Attributes:
        traced: the symbolic trace.
        graph: its graph.
        domain: the shape domain.
        donated: flat indices of donated leaves.
        symbolic: False for the fallback-only ablation.
        offload: whether host offload is planned.
        costs: the device rates weighing FLOPs against transfers.
        scheduler: the scheduler asked for each level's order (None: none).
    """

    traced: Traced
    graph: Graph
    domain: ShapeDomain
    donated: tuple[int, ...]
    symbolic: bool
    offload: bool
    costs: Costs
    scheduler: Scheduler | None


@gc_paused()
def derive_plans(inputs: PlanInputs) -> tuple[PlanSet, Orders]:
    """The levels and each level's validated order: the expensive part of an analysis."""
    plans = plan_levels(inputs.graph, inputs.domain, symbolic=inputs.symbolic,
                        donated=inputs.donated, offload=inputs.offload, costs=inputs.costs)
    plans = add_body_levels(plans, inputs.graph, symbolic=inputs.symbolic, donated=inputs.donated)
    scheduler, domain = inputs.scheduler, inputs.domain
    orders = tuple(validate_order(level.graph, scheduler.order(ScheduleGraph(level.graph, domain)))
                   if scheduler is not None else None for level in plans.levels)
    return plans, orders


def merge_args(static_argnums: Sequence[int], static: Sequence[Any],
               dynamic: Sequence[Any]) -> list[Any]:
    """Re-interleaves static and dynamic positional arguments."""
    n = len(static) + len(dynamic)
    st = dict(zip(static_argnums, static, strict=True))
    dyn = iter(dynamic)
    return [st[i] if i in st else next(dyn) for i in range(n)]


def _spec_for(polymorphic_shapes: Any, static_argnums: Sequence[int], n_args: int) -> Any:
    if polymorphic_shapes is None:
        return None
    shapes = polymorphic_shapes
    if isinstance(shapes, str):
        shapes = (shapes,)
    shapes = tuple(shapes)
    if len(shapes) != n_args:
        raise ShapeOutOfRangeError(
            f"polymorphic_shapes has {len(shapes)} entries but the function got {n_args} "
            "positional arguments; give one entry (None or 'b, s', ...) per argument")
    return tuple(s for i, s in enumerate(shapes) if i not in static_argnums)


@gc_paused()
def analyze_specs(fun: Callable[..., Any], static: tuple[Any, ...], dynamic: tuple[Any, ...],
                  static_argnums: Sequence[int], polymorphic_shapes: Any,
                  constraints: Sequence[str], scheduler: Scheduler | None,
                  donate_argnums: Sequence[int], symbolic: bool,
                  offload: bool | None = None, costs: Costs | None = None,
                  planner: Callable[[PlanInputs], tuple[PlanSet, Orders]] = derive_plans
                  ) -> Analysis:
    """Traces ``fun`` symbolically and derives its plans (once per structure).

    ``offload`` None plans host offload where the default backend supports it;
    ``costs`` are the device rates that weigh recomputation against transfers
    (default: :func:`~jaxmem.plan.offload.costs_for` the default backend);
    ``planner`` derives the plan set and orders (:func:`derive_plans`, or a cache of it).
    """
    n_args = len(static) + len(dynamic)
    declared = declared_specs(static, dynamic, static_argnums, polymorphic_shapes, constraints)

    def flat_fn(*dyn: Any) -> Any:
        return fun(*merge_args(static_argnums, static, dyn))

    traced = trace(flat_fn, *declared.specs)
    graph = build_graph(traced.closed_jaxpr)
    domain = declared.domain  # the trace's symbols and constraints are the specs'
    dyn_positions = [i for i in range(n_args) if i not in static_argnums]
    donate_dynamic = tuple(dyn_positions.index(i) for i in donate_argnums if i in dyn_positions)
    donated = _flat_indices(dynamic, donate_dynamic)
    backend = jax.default_backend()
    offload = offload_by_default(backend) if offload is None else offload
    plans, orders = planner(PlanInputs(traced, graph, domain, donated, symbolic, offload,
                                       costs or costs_for(backend), scheduler))
    return Analysis(flat_fn, declared.specs, tuple(traced.in_avals), declared.paths, traced,
                    graph, domain, plans, orders, donated, donate_dynamic, offload)


def _symbolic_specs(dynamic: tuple[Any, ...], leaves_with_path: Sequence[Any], poly: Any,
                    polymorphic_shapes: Any, constraints: Sequence[str]) -> Any:
    """``jax.export.symbolic_args_specs`` of the dynamic arguments, with errors naming them."""
    for path, leaf in leaves_with_path:
        if not _is_arraylike(leaf):
            raise ShapeOutOfRangeError(
                f"argument args{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an "
                "array; pass arrays, Python scalars or jax.ShapeDtypeStruct (or mark it in "
                "static_argnums, or a keyword argument in static_argnames)")
    examples = jax.tree_util.tree_map(as_struct, dynamic)
    try:
        specs = jax.export.symbolic_args_specs(examples, poly, constraints=tuple(constraints))
    except Exception as e:  # jax's shape_poly parse errors are plain subclasses of Exception
        raise ShapeOutOfRangeError(f"cannot use polymorphic_shapes {polymorphic_shapes!r} with "
                                   f"constraints {tuple(constraints)!r} on these arguments: "
                                   f"{e}") from e
    spec_leaves, spec_tree = jax.tree_util.tree_flatten(specs)
    for (path, leaf), spec in zip(leaves_with_path, spec_leaves, strict=True):
        shape = tuple(getattr(leaf, "shape", ()))
        if len(spec.shape) != len(shape):
            raise ShapeOutOfRangeError(
                f"args{jax.tree_util.keystr(path)} has rank {len(shape)} (shape {shape}), but "
                f"polymorphic_shapes declares {format_shape(spec.shape)} of rank "
                f"{len(spec.shape)}")
    # symbolic_args_specs drops weak_type: a weakly typed scalar (a learned temperature,
    # jnp.array(jnp.log(10.0))) would trace strong here and weak in the concrete trace,
    # whose residuals then have other names than the plans' (they would stay saved).
    weak = [getattr(x, "weak_type", False) for x in jax.tree_util.tree_leaves(examples)]
    return jax.tree_util.tree_unflatten(spec_tree, [
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding, weak_type=True) if w else s
        for s, w in zip(spec_leaves, weak, strict=True)])


def _is_arraylike(x: Any) -> bool:
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or (
        isinstance(x, (int, float, complex, np.number)))


def as_struct(x: Any) -> Any:
    """Python scalars become weakly typed scalar specs, as ``jax.jit`` treats them."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)


def _flat_indices(dynamic: Sequence[Any], positions: Sequence[int]) -> tuple[int, ...]:
    out, start = [], 0
    for i, arg in enumerate(dynamic):
        n = len(jax.tree_util.tree_leaves(arg))
        if i in positions:
            out.extend(range(start, start + n))
        start += n
    return tuple(out)


def local_dims(analysis: Analysis, dims: dict[str, int],
               shardings: Sequence[Any]) -> dict[str, int]:
    """Per-device dims: a dim an argument is sharded along counts its shard's extent.

    With the batch of a data-parallel step split over n devices, each device sees
    ``b / n`` rows, so per-device predictions evaluate the symbolic peak there.

    Args:
        analysis: the analysis.
        dims: global dim values (from :func:`bind_dims`).
        shardings: one ``jax.sharding.Sharding`` (or None) per flat dynamic leaf.
    """
    out = dict(dims)
    if len(shardings) != len(analysis.flat_specs):
        return out
    for spec, sh in zip(analysis.flat_specs, shardings, strict=True):
        shard_shape = getattr(sh, "shard_shape", None)
        if shard_shape is None or not spec.shape:
            continue
        names = [str(d) if not isinstance(d, (int, np.integer)) else None for d in spec.shape]
        if any(n is not None and (not n.isidentifier() or n not in dims) for n in names):
            continue
        shape = tuple(dims[n] if n is not None else int(d)
                      for n, d in zip(names, spec.shape, strict=True))
        try:
            local = shard_shape(shape)
        except Exception:  # a sharding that does not divide this shape: keep global dims
            continue
        for n, g, loc in zip(names, shape, local, strict=True):
            if n is not None and loc < g:
                out[n] = min(out[n], int(loc))
    return out



def arg_shardings(dynamic: Sequence[Any]) -> list[Any]:
    """The sharding each flat dynamic argument already has (None for host values)."""
    return [getattr(x, "sharding", None) for x in jax.tree_util.tree_leaves(dynamic)]



def format_shape(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"
