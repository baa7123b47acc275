"""``jaxmem.value_and_grad``: a drop-in for ``jax.value_and_grad`` that marks the batch-linear part.

The loss must be a mean over the batch axis. Today it computes exactly what
``jax.value_and_grad`` computes, inside a named scope (``jaxmem_value_and_grad``)
that lets plans and ``describe()`` tell the loss-and-gradient part of a step from
the optimizer update around it.

Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> loss, g = jaxmem.value_and_grad(lambda w, x: jnp.mean((x * w) ** 2))(2.0, jnp.ones(4))
    >>> float(loss), float(g)
    (4.0, 4.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

SCOPE = "jaxmem_value_and_grad"


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, **kwargs: Any) -> Callable[..., Any]:
    """Same signature and results as ``jax.value_and_grad``."""
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kw: Any) -> Any:
        with jax.named_scope(SCOPE):
            return vg(*args, **kw)

    return wrapped
