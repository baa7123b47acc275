"""Binding a call: dim values read from concrete arguments, checked against the domain.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmem.plan.analysis import analyze_specs
    >>> a = analyze_specs(lambda x: x * 2, (), (jnp.ones((4, 3)),), (), ("b, 3",), ("b <= 8",),
    ...                   None, (), True)
    >>> bind_dims(a, (jnp.ones((5, 3)),))
    {'b': 5}
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import sympy

from jaxmem.dims import sym, to_sympy
from jaxmem.errors import JaxmemError, ShapeOutOfRangeError
from jaxmem.plan.analysis import Analysis, Declared, format_shape


def bind_dims(analysis: Analysis | Declared, dynamic: Sequence[Any]) -> dict[str, int]:
    """Reads the dim values from concrete arguments and checks them against the declared
    shapes of ``analysis`` (an analysis, or the declared specs alone).

    Raises:
        ShapeOutOfRangeError: naming the argument, the dim, the value and the bound.
    """
    flat = jax.tree_util.tree_leaves(dynamic)
    if len(flat) != len(analysis.flat_specs):
        raise ShapeOutOfRangeError(f"expected {len(analysis.flat_specs)} array leaves, got "
                                   f"{len(flat)}")
    dims: dict[str, int] = {}
    source: dict[str, str] = {}  # dim -> the argument axis it was read from
    pending: list[tuple[str, int, Any, int]] = []
    for path, spec, x in zip(analysis.paths, analysis.flat_specs, flat, strict=True):
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != len(spec.shape):
            raise ShapeOutOfRangeError(f"{path} has rank {len(shape)} (shape {shape}), but its "
                                       f"declared shape {format_shape(spec.shape)} has rank "
                                       f"{len(spec.shape)}")
        for axis, (d, v) in enumerate(zip(spec.shape, shape, strict=True)):
            if isinstance(d, (int, np.integer)):
                if int(d) != v:
                    raise ShapeOutOfRangeError(f"{path} axis {axis} is {v}, but the declared "
                                               f"shape {format_shape(spec.shape)} fixes it to {d}")
                continue
            name = str(d)
            if name.isidentifier():
                if name in dims and dims[name] != v:
                    raise ShapeOutOfRangeError(
                        f"dimension {name} is {dims[name]} in one argument but {v} in {path} "
                        f"axis {axis}")
                dims[name] = int(v)
                source.setdefault(name, f"{path} axis {axis}")
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
            source.setdefault(str(unknown[0]), f"{path} axis {axis}")
        got = int(expr.subs({sym(k): val for k, val in dims.items()}))
        if got != v:
            raise ShapeOutOfRangeError(f"{path} axis {axis} is {v}, but its declared dim {d} is "
                                       f"{got} at {dims}")
    missing = [s for s in analysis.domain.symbols if s not in dims]
    if missing:
        raise JaxmemError(f"dims {missing} could not be read from the argument shapes")
    problem = analysis.domain.contains(dims)
    if problem:
        named = [f"{k} is the size of {path_axis}" for k, path_axis in source.items()
                 if re.search(rf"\b{re.escape(k)}\b", problem)]
        raise ShapeOutOfRangeError(f"{problem} ({'; '.join(named)})" if named else problem)
    return dims


