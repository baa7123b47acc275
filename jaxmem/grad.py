"""``jaxmem.value_and_grad``: a drop-in for ``jax.value_and_grad`` that marks the batch-linear part.

The loss must be a mean over the batch axis (axis 0 of the batch arguments), and the
batch must reach it as an argument; a loss that reads it from an enclosing scope, or
divides by a sum over the rows (a masked mean), is taken unsplit with a warning. It
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
from jax.extend import core as jcore

from jaxmem.errors import warn

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
            if micro is None or micro[0] <= 1 or not _splittable(fun, args, kw, nums, micro[1]):
                return vg(*args, **kw)
            return _accumulate(vg, args, kw, nums, micro[0], micro[1])

    return wrapped


def _splittable(fun: Callable[..., Any], args: Sequence[Any], kw: dict[str, Any],
                nums: Sequence[int], batch: int) -> bool:
    """Whether row-weighted chunks of ``fun`` sum to its value; else a warning, and the
    gradient is taken unsplit.

    Not when the loss reads a traced array of ``batch`` rows from an enclosing scope
    (``value_and_grad(lambda p: loss(p, batch))(params)``: microbatching splits arguments
    only, so each chunk would see all of it), nor when it divides by a value summed over
    the rows (``sum(l * mask) / sum(mask)``, a masked token mean: each chunk's own
    denominator differs from the batch's, so row weights do not recover the whole).
    """
    closed = jax.make_jaxpr(lambda *a: fun(*a, **kw))(*args)
    reason = None
    rows = [c.shape for c in closed.consts if isinstance(c, jax.core.Tracer) and _is_rows(c, batch)]
    if rows:
        reason = (f"the loss reads arrays of {batch} rows (shapes "
                  f"{', '.join(map(str, rows))}) from its enclosing scope; microbatching splits "
                  "only arguments: pass the batch as one")
    else:
        flat = [(i, leaf) for i, a in enumerate(args) for leaf in jax.tree_util.tree_leaves(a)]
        data = [i not in nums and _is_rows(leaf, batch) for i, leaf in flat]
        deps = [False] * len(closed.jaxpr.constvars) + data
        if _divides_by_batch_sum(closed.jaxpr, deps, batch):
            reason = ("the loss divides by a value summed over the batch's rows (a masked "
                      "mean?); microbatching weights chunks by their rows, which recovers "
                      "only a mean over rows")
    if reason:
        warn(f"jaxmem.value_and_grad: {reason}. This gradient is taken unsplit.")
    return reason is None


def _divides_by_batch_sum(jaxpr: Any, deps: Sequence[bool], batch: int) -> bool:
    """Whether ``jaxpr`` (``deps``: which of its constvars and invars hold batch rows) divides
    by a value that depends on them but has no rows axis (reduced over the batch)."""
    dep = {v for v, d in zip([*jaxpr.constvars, *jaxpr.invars], deps, strict=True) if d}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, jcore.Literal) and v in dep for v in eqn.invars]
        if eqn.primitive.name == "div" and ins[1] and not _is_rows(eqn.invars[1].aval, batch):
            return True
        for sub in jcore.jaxprs_in_params(eqn.params):
            if len(sub.invars) == len(ins) and _divides_by_batch_sum(
                    sub, [False] * len(sub.constvars) + ins, batch):
                return True
        if any(ins):
            dep.update(eqn.outvars)
    return False


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
