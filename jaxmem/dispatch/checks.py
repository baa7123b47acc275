"""Checks of ``jaxmem.jit``'s arguments, and of what a failed run left behind.

Example:
    >>> check_argnums("donate_argnums", 0)
    (0,)
    >>> check_budget(-1)
    Traceback (most recent call last):
    ...
    ValueError: budget_bytes must be positive, got -1
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from jaxmem.dispatch.keywords import check_argnames
from jaxmem.errors import ShapeOutOfRangeError
from jaxmem.plan.offload import Costs
from jaxmem.schedulers import Scheduler


def check_budget(budget_bytes: Any) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int number of bytes or None, got "
                        f"{budget_bytes!r} ({type(budget_bytes).__name__})")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    return budget_bytes


def check_argnums(name: str, value: int | Iterable[int]) -> tuple[int, ...]:
    nums = (value,) if isinstance(value, int) else tuple(value)
    for n in nums:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {n!r}")
    return nums


_SPEC = re.compile(r"^[\s\w,+*\-/()^.]*$")


def check_shapes(polymorphic_shapes: Any) -> Any:
    """Rejects entries that are not ``None`` or a dims string (ShapeOutOfRangeError)."""
    entries = ((polymorphic_shapes,) if isinstance(polymorphic_shapes, str)
               else polymorphic_shapes)
    leaves = jax.tree_util.tree_flatten_with_path(entries)[0] if entries is not None else []
    for path, leaf in leaves:
        if not isinstance(leaf, str) or not _SPEC.match(leaf):
            raise ShapeOutOfRangeError(
                f"polymorphic_shapes{jax.tree_util.keystr(path)} must be None or a string of "
                f"dims like 'b, s', got {leaf!r}")
    return polymorphic_shapes


def is_resource_exhausted(err: BaseException) -> bool:
    """True for XLA's out-of-memory error at run time (``RESOURCE_EXHAUSTED``)."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


def consumed(args: Sequence[Any], argnums: Sequence[int]) -> list[str]:
    """Paths of donated array leaves that a failed call already deleted."""
    out = []
    for i in argnums:
        if i >= len(args):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            deleted = getattr(leaf, "is_deleted", None)
            if deleted is not None and deleted():
                out.append(f"args[{i}]{jax.tree_util.keystr(path)}")
    return out


def split_args(args: tuple[Any, ...], static_argnums: Sequence[int]
               ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(static, dynamic)`` positional arguments, checking that every static one was passed."""
    for i in static_argnums:
        if i >= len(args):
            raise ShapeOutOfRangeError(
                f"static_argnums={tuple(static_argnums)} names argument {i}, but only "
                f"{len(args)} positional arguments were passed")
    static = tuple(args[i] for i in static_argnums)
    dynamic = tuple(a for i, a in enumerate(args) if i not in static_argnums)
    return static, dynamic


def call_key(static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Any:
    """The plan cache key of a call: tree structure, static values, leaf shapes and dtypes."""
    flat, tree = jax.tree_util.tree_flatten(dynamic)
    shapes = tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x))) for x in flat)
    try:
        hash(static)
    except TypeError as e:
        raise ShapeOutOfRangeError(f"static arguments must be hashable: {e}") from e
    return (tree, static, shapes)


def check_choices(scheduler: Any, offload: Any, offload_costs: Any) -> None:
    """Type checks of ``jaxmem.jit``'s strategy arguments (TypeError naming the argument)."""
    if scheduler is not None and not isinstance(scheduler, Scheduler):
        raise TypeError(f"scheduler must be a jaxmem.Scheduler or None, got {scheduler!r}")
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"offload must be True, False or None (auto), got {offload!r}")
    if offload_costs is not None and not isinstance(offload_costs, Costs):
        raise TypeError(f"offload_costs must be a jaxmem.plan.offload.Costs or None, got "
                        f"{offload_costs!r}")


def check_constraints(constraints: Iterable[Any]) -> tuple[str, ...]:
    """The constraints as a tuple of strings like ``"b <= 16"`` (ValueError otherwise)."""
    out = tuple(constraints)
    for c in out:
        if not isinstance(c, str):
            raise ValueError(f"constraints must be strings like 'b <= 16', got {c!r}")
    return out


def check_cache_dir(cache_dir: Any) -> pathlib.Path | None:
    """``jaxmem.jit``'s ``cache_dir`` as a path: None, or a ``str``/``os.PathLike`` naming a
    directory or nothing yet (TypeError or ValueError naming the argument otherwise).

    Example:
        >>> check_cache_dir(3)
        Traceback (most recent call last):
        ...
        TypeError: cache_dir must be a directory path (str or os.PathLike) or None, got 3 (int)
    """
    if cache_dir is None:
        return None
    if isinstance(cache_dir, bytes) or not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a directory path (str or os.PathLike) or None, got "
                        f"{cache_dir!r} ({type(cache_dir).__name__})")
    path = pathlib.Path(cache_dir).expanduser()
    if not str(cache_dir) or (path.exists() and not path.is_dir()):
        raise ValueError(f"cache_dir must name a directory (it is made if missing), got "
                         f"{str(cache_dir)!r}")
    return path


def donated_positions(fun: Callable[..., Any], argnums: Sequence[int],
                      names: str | Iterable[str]) -> tuple[int, ...]:
    """``donate_argnums`` with ``donate_argnames`` resolved to the positions of ``fun``'s
    parameters of those names, as ``jax.jit`` resolves them (ValueError naming one that
    is no positional parameter). An argument passed by keyword is not donated: jaxmem
    traces the keyword arguments as one dict."""
    names = check_argnames(names)
    if not names:
        return tuple(argnums)
    params = [p.name for p in inspect.signature(fun).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for n in names:
        if n not in params:
            raise ValueError(f"donate_argnames names {n!r}, which is not a positional "
                             f"parameter of {getattr(fun, '__name__', fun)!r} ({params})")
    return tuple(sorted({*argnums, *(params.index(n) for n in names)}))
