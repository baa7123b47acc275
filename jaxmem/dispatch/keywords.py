"""Keyword arguments of a ``jaxmem.jit`` call, taken as ``jax.jit`` takes them.

jaxmem traces and plans a function of positional arguments. A call with keyword
arguments runs, through its own :class:`~jaxmem.dispatch.jit.Jitted`, the function of
one more positional argument: the dict of the dynamic keyword arguments (arrays or
scalars; no symbolic dims, so each keeps the shape it first came with), with the
static ones (``static_argnames``) bound in. There is one such function per number of
positional arguments, set of keyword names and static values. A keyword argument that
names a positional parameter with a ``polymorphic_shapes`` entry is passed in its place
first (``step(state, batch=batch)`` is ``step(state, batch)``), as its symbolic dims
need a position.

Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> def f(x, scale=1.0, mode="sum"):
    ...     y = x * scale
    ...     return y.sum() if mode == "sum" else y.max()
    >>> g = jaxmem.jit(f, polymorphic_shapes=("n",), constraints=("n <= 64",),
    ...                static_argnames=("mode",))
    >>> g(jnp.arange(3.0), scale=2.0, mode="max")
    Array(4., dtype=float32)
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jaxmem.errors import ShapeOutOfRangeError


def check_argnames(value: str | Iterable[str]) -> tuple[str, ...]:
    """``static_argnames`` as a tuple of names (ValueError naming a bad entry)."""
    names = (value,) if isinstance(value, str) else tuple(value)
    for n in names:
        if not isinstance(n, str) or not n.isidentifier():
            raise ValueError(f"static_argnames must hold argument names, got {n!r}")
    return names


def keyword_key(n_args: int, kwargs: Mapping[str, Any], static_argnames: Sequence[str]
                ) -> tuple[int, tuple[tuple[str, Any], ...], tuple[str, ...]]:
    """What picks the keyword function of a call: the number of positional arguments, the
    static keyword arguments' names and values, and the dynamic ones' names."""
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_argnames))
    try:
        hash(static)
    except TypeError as e:
        raise ShapeOutOfRangeError(f"static keyword arguments must be hashable: {e}") from e
    return n_args, static, tuple(sorted(k for k in kwargs if k not in static_argnames))


def with_keywords(fun: Callable[..., Any], static: Mapping[str, Any]) -> Callable[..., Any]:
    """``fun`` over its positional arguments and, last, a dict of keyword arguments."""
    bound = dict(static)

    @functools.wraps(fun)
    def call(*args: Any) -> Any:
        return fun(*args[:-1], **args[-1], **bound)

    return call


def keyword_settings(settings: Mapping[str, Any], n_args: int, names: Sequence[str]
                     ) -> dict[str, Any]:
    """``settings`` (``jaxmem.jit``'s keyword arguments) for the keyword function of calls
    with ``n_args`` positional arguments and dynamic keyword arguments ``names``."""
    shapes = settings["polymorphic_shapes"]
    if shapes is not None:
        shapes = (shapes,) if isinstance(shapes, str) else tuple(shapes)
        if len(shapes) != n_args:
            raise ShapeOutOfRangeError(
                f"polymorphic_shapes has {len(shapes)} entries but the call passed {n_args} "
                f"positional arguments; keyword arguments ({', '.join(names)}) take no "
                "symbolic dims, so pass the arguments with symbolic dims positionally")
        shapes = (*shapes, None)
    if settings["in_shardings"] is not None and names:
        raise ValueError(f"keyword arguments ({', '.join(names)}) cannot be passed when "
                         "in_shardings is given (as with jax.jit); pass them positionally")
    return {**settings, "polymorphic_shapes": shapes, "static_argnames": ()}


def dynamic_keywords(kwargs: Mapping[str, Any], static_argnames: Sequence[str]
                     ) -> dict[str, Any]:
    """The keyword arguments that are traced (not in ``static_argnames``)."""
    return {k: v for k, v in kwargs.items() if k not in static_argnames}


def shaped_positions(fun: Callable[..., Any], settings: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of ``fun``'s leading positional parameters that ``polymorphic_shapes``
    gives entries, in order (empty where the signature cannot be read)."""
    shapes = settings["polymorphic_shapes"]
    n = 0 if shapes is None else 1 if isinstance(shapes, str) else len(tuple(shapes))
    try:
        params = list(inspect.signature(fun).parameters.values())[:n]
    except (TypeError, ValueError):  # a builtin or C callable: keywords stay keywords
        return ()
    names = []
    for p in params:
        if p.kind is not p.POSITIONAL_OR_KEYWORD:
            break
        names.append(p.name)
    return tuple(names)


class KeywordCalls:
    """The function of each keyword signature of one ``jaxmem.jit`` function, made once.

    Args:
        fun: the user's function.
        settings: its ``jaxmem.jit`` keyword arguments.
        make: builds the jitted function of ``(function, settings)``.
    """

    def __init__(self, fun: Callable[..., Any], settings: Mapping[str, Any],
                 make: Callable[[Callable[..., Any], dict[str, Any]], Any]) -> None:
        self.fun, self.settings, self.make = fun, dict(settings), make
        self.static_argnames: tuple[str, ...] = self.settings["static_argnames"]
        self.shaped = tuple(n for n in shaped_positions(fun, settings)
                            if n not in self.static_argnames)
        self.made: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def promote(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` extended by the keyword arguments that name the next parameters with
        ``polymorphic_shapes`` entries, and the keyword arguments left."""
        names = []
        for name in self.shaped[len(args):]:
            if name not in kwargs:
                break
            names.append(name)
        if not names:
            return args, kwargs
        return (*args, *(kwargs[n] for n in names)), {
            k: v for k, v in kwargs.items() if k not in names}

    def route(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, tuple]:
        """The jitted function that runs ``fun(*args, **kwargs)``, and its arguments."""
        key = keyword_key(len(args), kwargs, self.static_argnames)
        made = self.made.get(key)  # the lock only where a signature is new
        if made is None:
            with self._lock:
                if key not in self.made:
                    self.made[key] = self.make(with_keywords(self.fun, dict(key[1])),
                                               keyword_settings(self.settings, len(args),
                                                                key[2]))
                made = self.made[key]
        return made, (*args, dynamic_keywords(kwargs, self.static_argnames))


def routes_keywords(lead: int = 0) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Makes a ``Jitted`` method of ``(*lead arguments, *call arguments)`` take the call's
    keyword arguments too: it then runs on the keyword signature's function. The
    method's own keyword-only parameters stay its own."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        own = {n for n, p in inspect.signature(method).parameters.items()
               if p.kind is p.KEYWORD_ONLY}

        @functools.wraps(method)
        def route(self: Any, *args: Any, **kwargs: Any) -> Any:
            mine = {k: kwargs.pop(k) for k in own & kwargs.keys()}
            if kwargs:
                tail, kwargs = self._keyword.promote(args[lead:], kwargs)
                args = (*args[:lead], *tail)
            if not kwargs:
                return method(self, *args, **mine)
            inner, pos = self._keyword.route(args[lead:], kwargs)
            return method(inner, *args[:lead], *pos, **mine)

        return route

    return wrap
