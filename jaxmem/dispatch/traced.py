"""``jaxmem.jit`` under an outer JAX transformation, and ``jax.jit``'s shape-only entry points.

A ``jax.jit`` function called inside another trace (an outer ``jax.jit``, ``jax.grad``,
``jax.vmap``, ``jax.eval_shape``) is inlined into that trace, and the outer compile
decides its memory. ``jaxmem.jit`` does the same: with a tracer among the arguments
nothing is planned, and the call is ``jax.jit``'s with the same static, donated and
sharded arguments.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> f = jaxmem.jit(lambda x: jnp.tanh(x).sum(), polymorphic_shapes=("n",),
    ...                constraints=("n <= 64",))
    >>> jax.grad(f)(jnp.zeros(3))
    Array([1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxmem import lower


def has_tracer(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether an argument leaf is a tracer of an outer JAX transformation."""
    leaves = jax.tree_util.tree_leaves((args, dict(kwargs or {})))
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def as_jax_jit(fun: Callable[..., Any], settings: Mapping[str, Any]) -> Any:
    """``jax.jit(fun)`` with the static, donated and sharded arguments of ``settings``
    (``Jitted._settings()``)."""
    kwargs: dict[str, Any] = {
        "static_argnums": settings["static_argnums"],
        "static_argnames": settings["static_argnames"],
        "donate_argnums": settings["donate_argnums"]}
    for name in ("in_shardings", "out_shardings"):
        if settings[name] is not None:
            kwargs[name] = settings[name]
    return jax.jit(fun, **kwargs)


class PlannedLowered:
    """A level's ``jax.stages.Lowered`` (``Jitted.lower``) whose ``compile()`` passes the
    per-executable XLA options jaxmem compiles with (``jaxmem.lower.compiler_options``),
    so that it makes the executable a call runs. Everything else is the ``Lowered``'s."""

    def __init__(self, lowered: Any):
        self.lowered = lowered

    def compile(self, compiler_options: Mapping[str, Any] | None = None) -> Any:
        """``Lowered.compile`` with jaxmem's options, ``compiler_options`` over them."""
        return self.lowered.compile(
            compiler_options={**lower.compiler_options(), **(compiler_options or {})})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)

    def __repr__(self) -> str:
        return f"PlannedLowered({self.lowered!r})"
