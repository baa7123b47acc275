"""``jaxmem.value_and_grad``: a drop-in for ``jax.value_and_grad`` that marks the batch-linear part.

The loss must be a mean over the batch axis (axis 0 of the batch arguments). It
computes exactly what ``jax.value_and_grad`` computes, inside a named scope
(``jaxmem_value_and_grad``). When jaxmem compiles a step with microbatching
(:class:`jaxmem.schedulers.Microbatch`, only when no recomputation level fits
the budget), the batch is split into k chunks inside one executable: a
``lax.scan`` over the equal chunks and one call on an uneven remainder, each
chunk's loss and gradients weighted by its share of the rows, so the results
equal the whole-batch ones up to float rounding.

Example:
    >>> import jax.numpy as jnp, jaxmem
    >>> loss, g = jaxmem.value_and_grad(lambda w, x: jnp.mean((x * w) ** 2))(2.0, jnp.ones(4))
    >>> float(loss), float(g)
    (4.0, 4.0)
    >>> with microbatching(3, 4):
    ...     loss, g = jaxmem.value_and_grad(lambda w, x: jnp.mean((x * w) ** 2))(2.0, jnp.ones(4))
    >>> float(loss), float(g)
    (4.0, 4.0)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

SCOPE = "jaxmem_value_and_grad"

_MICRO: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "jaxmem_microbatching", default=None)


@contextlib.contextmanager
def microbatching(k: int, batch: int) -> Iterator[None]:
    """While tracing, split batches of ``batch`` rows into ``k`` accumulation steps."""
    token = _MICRO.set((int(k), int(batch)))
    try:
        yield
    finally:
        _MICRO.reset(token)


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, **kwargs: Any) -> Callable[..., Any]:
    """Same signature and results as ``jax.value_and_grad``.

    With ``has_aux`` under microbatching, the auxiliary output is the
    row-weighted mean of the chunks' auxiliaries.
    """
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kw: Any) -> Any:
        with jax.named_scope(SCOPE):
            micro = _MICRO.get()
            if micro is None or micro[0] <= 1:
                return vg(*args, **kw)
            return _accumulate(vg, args, kw, nums, micro[0], micro[1])

    return wrapped


def _is_rows(x: Any, batch: int) -> bool:
    return getattr(x, "ndim", 0) > 0 and x.shape[0] == batch


def _chunk(args: Sequence[Any], nums: Sequence[int], batch: int, start: Any,
           size: int) -> list[Any]:
    """The arguments with every batch leaf (leading dim ``batch``) of non-diff args sliced."""
    def take(x: Any) -> Any:
        return lax.dynamic_slice_in_dim(x, start, size, 0) if _is_rows(x, batch) else x

    return [a if i in nums else jax.tree_util.tree_map(take, a) for i, a in enumerate(args)]


def _accumulate(vg: Callable[..., Any], args: Sequence[Any], kw: dict[str, Any],
                nums: Sequence[int], k: int, batch: int) -> Any:
    """Row-weighted sum of ``vg`` over ``k`` chunks of the batch (scan + remainder)."""
    size = -(-batch // k)
    full, rest = batch // size, batch % size

    def scaled(out: Any, weight: float) -> Any:
        return jax.tree_util.tree_map(lambda t: t * jnp.asarray(weight, t.dtype), out)

    def body(acc: Any, i: Any) -> tuple[Any, None]:
        out = scaled(vg(*_chunk(args, nums, batch, i * size, size), **kw), size / batch)
        return jax.tree_util.tree_map(jnp.add, acc, out), None

    shapes = jax.eval_shape(lambda: vg(*_chunk(args, nums, batch, 0, size), **kw))
    zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = lax.scan(body, zero, jnp.arange(full))
    if rest:
        tail = scaled(vg(*_chunk(args, nums, batch, full * size, rest), **kw), rest / batch)
        total = jax.tree_util.tree_map(jnp.add, total, tail)
    return total
