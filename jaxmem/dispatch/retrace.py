"""Per-shape analyses, where JAX cannot trace a step with its symbolic dims.

``jax.export``'s shape polymorphism refuses what it cannot prove (reshaping
``s + (-s) % 16`` rows into chunks of 16, ``jnp.split`` of a symbolic axis, an op
without a symbolic rule), and Python code may need a dim's value (``float(x.shape[1])``,
``np.arange(s)``). ``jax.jit`` traces each shape anew and runs such a step, so
``jaxmem.jit`` does too: where the symbolic trace fails and the call's exact shapes
trace, it warns once and analyses and plans each call shape on its own (one analysis
per shape, as ``jax.jit`` has one trace per shape); where the exact shapes fail too, the
step's own error is raised, as ``jax.jit`` would. The declared ranges still hold: a
call outside them is a :class:`~jaxmem.errors.ShapeOutOfRangeError`.

Example:
    >>> import jax.numpy as jnp
    >>> analysis_key((), (jnp.ones((4, 3)),))[-1]
    ((2, 'float32'),)
    >>> import jaxmem, warnings
    >>> def chunks(x):  # rows padded to a multiple of 4: jax.export cannot divide s + (-s) % 4
    ...     return jnp.pad(x, ((0, (-x.shape[0]) % 4), (0, 0))).reshape(-1, 4, 2).sum()
    >>> f = jaxmem.jit(chunks, polymorphic_shapes=("s, 2",), constraints=("s <= 64",))
    >>> with warnings.catch_warnings(record=True):
    ...     f(jnp.ones((5, 2))), f(jnp.ones((6, 2)))
    (Array(10., dtype=float32), Array(12., dtype=float32))
    >>> f.cache_info().analyses
    2
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from jaxmem.dispatch.bind import bind_dims
from jaxmem.dispatch.cache import OnceCache
from jaxmem.dispatch.checks import call_key
from jaxmem.errors import warn
from jaxmem.plan.analysis import Analysis, declared_specs
from jaxmem.trace import failed_symbolically

#: ``(static, dynamic, polymorphic_shapes, constraints) -> Analysis``
Analyze = Callable[[tuple[Any, ...], tuple[Any, ...], Any, tuple[str, ...]], Analysis]


class ShapeAnalyses:
    """The analyses of one ``jaxmem.jit`` function: one per call structure, or one per
    call shape where it has no symbolic dims or JAX cannot trace it with them.

    Args:
        fun: the user's function (named in the warning).
        polymorphic_shapes, constraints, static_argnums: as given to ``jaxmem.jit``.
        analyze: analyses a call under the given shapes and constraints.
    """

    def __init__(self, fun: Callable[..., Any], polymorphic_shapes: Any,
                 constraints: tuple[str, ...], static_argnums: Sequence[int],
                 analyze: Analyze) -> None:
        self.fun, self.analyze = fun, analyze
        self.polymorphic_shapes, self.constraints = polymorphic_shapes, constraints
        self.static_argnums = static_argnums
        self.made: OnceCache[Analysis] = OnceCache()
        self.untraceable: set[Hashable] = set()  # structures analysed per shape

    def __len__(self) -> int:
        return len(self.made)

    def get(self, static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Analysis:
        """The analysis of a call, made once."""
        if self.polymorphic_shapes is not None:
            key = analysis_key(static, dynamic)
            if key not in self.untraceable:
                try:
                    return self.made.get_or_make(key, lambda: self.analyze(
                        static, dynamic, self.polymorphic_shapes, self.constraints))
                except Exception as e:
                    if not failed_symbolically(e):
                        raise
                    failure = e
                # The step's own error at this concrete shape, if it has one, is the one
                # jax.jit would raise (outside the handler: not chained to the symbolic
                # one); otherwise the symbolic dims were the cause.
                analysis = self.concrete(static, dynamic)
                self.untraceable.add(key)
                warn_retrace(self.fun, failure)
                return analysis
        return self.concrete(static, dynamic)

    def concrete(self, static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Analysis:
        """The analysis of the call's exact shapes, within the declared ranges."""
        if self.polymorphic_shapes is not None:
            check_declared(static, dynamic, self.static_argnums, self.polymorphic_shapes,
                           self.constraints)
        return self.made.get_or_make(call_key(static, dynamic),  # the exact shapes
                                     lambda: self.analyze(static, dynamic, None, ()))


def analysis_key(static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Hashable:
    """What one symbolic analysis serves: the tree, static values, leaf ranks and dtypes
    (a per-shape analysis is keyed by :func:`~jaxmem.dispatch.checks.call_key`)."""
    flat, tree = jax.tree_util.tree_flatten(dynamic)
    return tree, static, tuple((len(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
                               for x in flat)


def check_declared(static: tuple[Any, ...], dynamic: tuple[Any, ...],
                   static_argnums: Sequence[int], polymorphic_shapes: Any,
                   constraints: Sequence[str]) -> dict[str, int]:
    """The declared dims' values in a call, checked against their ranges without tracing.

    Raises:
        ShapeOutOfRangeError: naming the argument, the dim, the value and the bound.
    """
    declared = declared_specs(static, dynamic, static_argnums, polymorphic_shapes, constraints)
    return bind_dims(declared, dynamic)


def warn_retrace(fun: Callable[..., Any], error: Exception) -> None:
    """The one warning that a function's analyses are per shape from now on."""
    name = getattr(fun, "__name__", repr(fun))
    what = (str(error).strip().splitlines() or [""])[0].rstrip(".")  # JAX's can run long
    warn(f"jaxmem: {name} cannot be traced with its symbolic dims ({type(error).__name__}: "
         f"{what}). Each call shape is analysed and planned on its own instead, as jax.jit "
         "traces each shape.")
