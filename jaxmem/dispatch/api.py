"""``jaxmem.jit``, the entry point: a :class:`~jaxmem.dispatch.jit.Jitted` of a function,
or a decorator that makes one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxmem.dispatch.jit import Jitted


def jit(fun: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Planned, budgeted ``jax.jit``. Use as ``jaxmem.jit(f, ...)`` or ``@jaxmem.jit(...)``.

    Args:
        fun: the function (omit to get a decorator).
        polymorphic_shapes: per positional argument, ``None`` or a string like ``"b, s"``
            (the form of ``jax.export.symbolic_args_specs``).
        constraints: e.g. ``("b <= 16", "s <= 512")``.
        budget_bytes: memory budget per device in bytes, or None for no limit.
        scheduler: a :class:`~jaxmem.Scheduler`; None means ``schedulers.MemoryAware()``.
        donate_argnums, donate_argnames, static_argnums, static_argnames, in_shardings,
            out_shardings: as for ``jax.jit``; keyword arguments of a call are traced
            without symbolic dims (:mod:`jaxmem.dispatch.keywords`), and one passed by
            keyword is not donated.
        symbolic: False runs the fallback-only ablation.
        offload: plan moving residuals to host memory (``pinned_host``) as well as
            recomputing them. None (default): not on any backend for now (on an H200
            no offload level lowered XLA's peak; :mod:`jaxmem.plan.offload`).
        offload_costs: the device rates (:class:`jaxmem.plan.offload.Costs`: FLOP/s and
            host-link bytes/s) that weigh recomputation against offload; None uses the
            default backend's figures (:func:`jaxmem.plan.offload.costs_for`).
        cache_dir: a directory (``str`` or ``os.PathLike``) where analyses persist across
            runs (:mod:`jaxmem.dispatch.store`); None uses ``<jax_compilation_cache_dir>/jaxmem``
            when JAX's persistent compilation cache is configured, else keeps them in memory.

    Example:
        >>> import jax.numpy as jnp, jaxmem
        >>> @jaxmem.jit(polymorphic_shapes=("n",), constraints=("n <= 1024",))
        ... def f(x):
        ...     return x * 2
        >>> f(jnp.arange(3.0))
        Array([0., 2., 4.], dtype=float32)
    """
    if fun is None:
        return lambda f: Jitted(f, **kwargs)
    return Jitted(fun, **kwargs)


__all__ = ["jit"]
