"""Dispatch: from argument specs to an analysis once, from concrete arguments to dims per call.

Example:
    >>> import jax, jax.numpy as jnp
    >>> a = analyze_specs(lambda x: x * 2, (), (jnp.ones((4, 3)),), (), ("b, 3",), ("b <= 8",),
    ...                   None, (), True)
    >>> bind_dims(a, (jnp.ones((5, 3)),))
    {'b': 5}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import sympy

from jaxmem._errors import JaxmemError, ShapeOutOfRangeError
from jaxmem.graph import Graph, build_graph
from jaxmem.plan.offload import costs_for, offload_supported
from jaxmem.plan.planner import PlanSet, plan_levels
from jaxmem.schedulers import ScheduleGraph, Scheduler, validate_order
from jaxmem.symbolic import ShapeDomain, sym, to_sympy
from jaxmem.trace import Traced, trace


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


def analyze_specs(fun: Callable[..., Any], static: tuple[Any, ...], dynamic: tuple[Any, ...],
                  static_argnums: Sequence[int], polymorphic_shapes: Any,
                  constraints: Sequence[str], scheduler: Scheduler | None,
                  donate_argnums: Sequence[int], symbolic: bool,
                  offload: bool | None = None) -> Analysis:
    """Traces ``fun`` symbolically and derives its plans (once per structure).

    ``offload`` None plans host offload where the default backend supports it.
    """
    n_args = len(static) + len(dynamic)
    poly = _spec_for(polymorphic_shapes, static_argnums, n_args)
    leaves_with_path = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    for path, leaf in leaves_with_path:
        if not _is_arraylike(leaf):
            raise ShapeOutOfRangeError(
                f"argument args{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an "
                "array; pass arrays, Python scalars or jax.ShapeDtypeStruct (or mark it in "
                "static_argnums)")
    examples = jax.tree_util.tree_map(_as_struct, dynamic)
    try:
        specs = jax.export.symbolic_args_specs(examples, poly, constraints=tuple(constraints))
    except Exception as e:  # jax's shape_poly parse errors are plain subclasses of Exception
        raise ShapeOutOfRangeError(f"cannot use polymorphic_shapes {polymorphic_shapes!r} with "
                                   f"constraints {tuple(constraints)!r} on these arguments: "
                                   f"{e}") from e
    spec_leaves = jax.tree_util.tree_leaves(specs)
    for (path, leaf), spec in zip(leaves_with_path, spec_leaves, strict=True):
        shape = tuple(getattr(leaf, "shape", ()))
        if len(spec.shape) != len(shape):
            raise ShapeOutOfRangeError(
                f"args{jax.tree_util.keystr(path)} has rank {len(shape)} (shape {shape}), but "
                f"polymorphic_shapes declares {_fmt(spec.shape)} of rank {len(spec.shape)}")

    def flat_fn(*dyn: Any) -> Any:
        return fun(*merge_args(static_argnums, static, dyn))

    traced = trace(flat_fn, *specs)
    graph = build_graph(traced.closed_jaxpr)
    domain = ShapeDomain.from_constraints(traced.symbols, traced.constraints or constraints)
    dyn_positions = [i for i in range(n_args) if i not in static_argnums]
    donate_dynamic = tuple(dyn_positions.index(i) for i in donate_argnums if i in dyn_positions)
    donated = _flat_indices(dynamic, donate_dynamic)
    backend = jax.default_backend()
    offload = offload_supported(backend) if offload is None else offload
    plans = plan_levels(graph, domain, symbolic=symbolic, donated=donated, offload=offload,
                        costs=costs_for(backend))
    orders = tuple(validate_order(level.graph, scheduler.order(ScheduleGraph(level.graph, domain)))
                   if scheduler is not None else None for level in plans.levels)
    paths = tuple(f"args{jax.tree_util.keystr(p)}" for p, _ in leaves_with_path)
    return Analysis(flat_fn, tuple(specs), tuple(traced.in_avals), paths, traced, graph, domain,
                    plans, orders, donated, donate_dynamic, offload)


def _is_arraylike(x: Any) -> bool:
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or (
        isinstance(x, (int, float, complex, np.number)))


def _as_struct(x: Any) -> Any:
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


def bind_dims(analysis: Analysis, dynamic: Sequence[Any]) -> dict[str, int]:
    """Reads the dim values from concrete arguments and checks them.

    Raises:
        ShapeOutOfRangeError: naming the argument, the dim, the value and the bound.
    """
    flat = jax.tree_util.tree_leaves(dynamic)
    if len(flat) != len(analysis.flat_specs):
        raise ShapeOutOfRangeError(f"expected {len(analysis.flat_specs)} array leaves, got "
                                   f"{len(flat)}")
    dims: dict[str, int] = {}
    pending: list[tuple[str, int, Any, int]] = []
    for path, spec, x in zip(analysis.paths, analysis.flat_specs, flat, strict=True):
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != len(spec.shape):
            raise ShapeOutOfRangeError(f"{path} has rank {len(shape)} (shape {shape}), but its "
                                       f"declared shape {_fmt(spec.shape)} has rank "
                                       f"{len(spec.shape)}")
        for axis, (d, v) in enumerate(zip(spec.shape, shape, strict=True)):
            if isinstance(d, (int, np.integer)):
                if int(d) != v:
                    raise ShapeOutOfRangeError(f"{path} axis {axis} is {v}, but the declared "
                                               f"shape {_fmt(spec.shape)} fixes it to {d}")
                continue
            name = str(d)
            if name.isidentifier():
                if name in dims and dims[name] != v:
                    raise ShapeOutOfRangeError(
                        f"dimension {name} is {dims[name]} in one argument but {v} in {path} "
                        f"axis {axis}")
                dims[name] = int(v)
            else:
                pending.append((path, axis, d, int(v)))
    for path, axis, d, v in pending:
        expr = to_sympy(d)
        unknown = [s for s in expr.free_symbols if str(s) not in dims]
        if len(unknown) == 1:
            sol = [r for r in sympy.solve(sympy.Eq(expr, v), unknown[0]) if r.is_integer]
            if not sol:
                raise ShapeOutOfRangeError(f"{path} axis {axis} is {v}, which no integer value of "
                                           f"{unknown[0]} makes equal to {d}")
            dims[str(unknown[0])] = int(sol[0])
        got = int(expr.subs({sym(k): val for k, val in dims.items()}))
        if got != v:
            raise ShapeOutOfRangeError(f"{path} axis {axis} is {v}, but its declared dim {d} is "
                                       f"{got} at {dims}")
    missing = [s for s in analysis.domain.symbols if s not in dims]
    if missing:
        raise JaxmemError(f"dims {missing} could not be read from the argument shapes")
    problem = analysis.domain.contains(dims)
    if problem:
        raise ShapeOutOfRangeError(problem)
    return dims


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


def _fmt(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"
