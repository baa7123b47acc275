"""Tracing with symbolic dims: a function and argument specs to a closed jaxpr.

Example:
    >>> import jax, jax.numpy as jnp
    >>> b, = jax.export.symbolic_shape("b", constraints=("b <= 8",))
    >>> t = trace(lambda x: x * 2, jax.ShapeDtypeStruct((b, 3), jnp.float32))
    >>> t.symbols, t.constraints
    (('b',), ('b <= 8',))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem.errors import JaxmemError, ShapeOutOfRangeError, SymbolicTraceError
from jaxmem.unroll import write_out

#: The note on an error the function raised while traced with symbolic dims: the same
#: function may trace at every concrete shape (``float(x.shape[1])``, ``jnp.split`` of a
#: symbolic axis), so ``jaxmem.jit`` then traces each call shape instead.
SYMBOLIC_NOTE = "(jaxmem: raised while tracing with the symbolic dims"


def failed_symbolically(e: BaseException) -> bool:
    """Whether ``e`` was raised by tracing a function with symbolic dims."""
    notes = getattr(e, "__notes__", ())
    return isinstance(e, SymbolicTraceError) or any(
        n.startswith(SYMBOLIC_NOTE) for n in notes)


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced function.

    Attributes:
        closed_jaxpr: the jaxpr with symbolic dims.
        in_avals: flat abstract arguments.
        in_tree: pytree structure of the arguments.
        out_tree: pytree structure of the results.
        symbols: dimension variables, in order of first appearance.
        constraints: the constraints declared with those symbols.
    """

    closed_jaxpr: Any
    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_tree: Any
    out_tree: Any
    symbols: tuple[str, ...]
    constraints: tuple[str, ...]


def _as_spec(x: Any, path: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # weak types promote as jax.jit's do
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None),
                                    weak_type=getattr(x, "weak_type", False))
    if isinstance(x, (bool, int, float, complex, np.number)):
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype,
                                    weak_type=not isinstance(x, np.number))
    raise ShapeOutOfRangeError(
        f"argument {path} is a {type(x).__name__}, not an array or jax.ShapeDtypeStruct; "
        "pass arrays, ShapeDtypeStructs or scalars (use static_argnums for other values)")


def symbols_of(specs: Sequence[jax.ShapeDtypeStruct]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Dimension variables of the specs in order of appearance, and their scope's constraints."""
    names: dict[str, None] = {}
    scope = None
    for s in specs:
        for d in s.shape:
            if not isinstance(d, (int, np.integer)):
                scope = scope or getattr(d, "scope", None)
                for v in _vars(d):
                    names.setdefault(v, None)
    return tuple(names), _constraints_of(scope)


def _vars(d: Any) -> list[str]:
    get = getattr(d, "_get_vars", None) or getattr(d, "get_vars", None)
    if get is not None:
        return sorted(str(v) for v in get())
    return sorted(set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(d))) -
                  {"floordiv", "mod", "max", "min", "non_negative"})


def _constraints_of(scope: Any) -> tuple[str, ...]:
    if scope is None:
        return ()
    explicit = getattr(scope, "_explicit_constraints", None)
    if explicit is not None:
        return tuple(re.sub(r"^Constraint\((.*)\)$", r"\1", str(c)) for c in explicit)
    text = repr(scope)
    if "with constraints:" not in text:
        return ()
    return tuple(line.strip() for line in text.split("with constraints:")[1].splitlines()
                 if line.strip())


_INCONCLUSIVE = re.compile(r"comparison (.+?) is inconclusive", re.S)


def trace(fn: Callable[..., Any], *specs: Any) -> Traced:
    """Traces ``fn`` at argument specs whose dims may be symbolic.

    Args:
        fn: the function.
        *specs: pytrees of ``jax.ShapeDtypeStruct`` (dims from
            ``jax.export.symbolic_shape``) or arrays.

    Returns:
        A :class:`Traced`.

    Raises:
        SymbolicTraceError: tracing needs a comparison of dims the constraints do not
            settle (the message names it and the constraint to add), or JAX cannot
            trace an op with a symbolic size (the message names the dims). Any other
            error the function raises passes through, noted (:data:`SYMBOLIC_NOTE`) where
            the specs have symbolic dims.
    """
    flat, in_tree = jax.tree_util.tree_flatten(specs)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(specs)[0]]
    flat = [_as_spec(x, f"args{p}") for x, p in zip(flat, paths, strict=True)]
    args = jax.tree_util.tree_unflatten(in_tree, flat)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as e:  # JAX raises a plain subclass of core.InconclusiveDimensionOperation
        if type(e).__name__ == "InconclusiveDimensionOperation":
            raise _inconclusive(e) from e
        symbols = symbols_of(flat)[0]
        unsupported = _unsupported(e, symbols)
        if unsupported is not None:
            raise unsupported from e
        if symbols:
            e.add_note(f"{SYMBOLIC_NOTE} {', '.join(symbols)})")
        raise
    closed = write_out(closed, flat)
    symbols, constraints = symbols_of(flat)
    return Traced(closed, tuple(flat), in_tree, jax.tree_util.tree_structure(out_shape),
                  symbols, constraints)


def _unsupported(e: Exception, symbols: Sequence[str]) -> JaxmemError | None:
    """An op JAX cannot trace with a symbolic size (``lax.associative_scan`` over a
    symbolic axis: ``NotImplementedError``), named with the dims it saw, or None."""
    msg = str(e)
    named = [d for d in symbols if re.search(rf"(?<![\w/]){re.escape(d)}(?![\w/])", msg)]
    if not isinstance(e, NotImplementedError) or not named:
        return None
    dims = ", ".join(named)
    return SymbolicTraceError(
        f"JAX cannot trace the function with the symbolic dim(s) {dims}: {msg.splitlines()[0]} "
        f"Give {dims} a fixed size in polymorphic_shapes (one compile per value), or rewrite "
        "the op without it.")


def _inconclusive(e: Exception) -> JaxmemError:
    msg = str(e)
    m = _INCONCLUSIVE.search(msg)
    what = m.group(1).strip() if m else msg.splitlines()[0]
    hint = ""
    cm = re.match(r"'(.+?)'\s*(>=|<=|>|<|==|!=)\s*'(.+?)'", what)
    if cm:
        hint = f" Add the constraint \"{cm.group(1)} {cm.group(2)} {cm.group(3)}\" (or its " \
               "negation) to the symbolic_shape constraints, so that the case is settled."
    return SymbolicTraceError(f"tracing needs the symbolic comparison {what}, which the declared "
                         f"constraints do not settle.{hint}")
