"""How a ``scan`` equation splits its operands and results, on every supported JAX.

JAX 0.10 gives the split as ``num_consts`` / ``num_carry`` (and a ``linear`` flag per
operand); JAX 0.11 as flat trees, ``ft_in`` (consts, carry, xs) and ``ft_out`` (carry,
ys). Every pass that reads or rewrites a scan goes through these two functions, so the
rest of jaxmem never sees which form it has.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(c, xs):
    ...     return jax.lax.scan(lambda c, x: (c + x, c * x), c, xs)
    >>> eqn = jax.make_jaxpr(f)(jnp.zeros(3), jnp.zeros((5, 3))).eqns[0]
    >>> scan_counts(eqn.params)
    (0, 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def with_scan_counts(params: Mapping[str, Any], *, num_consts: int, num_carry: int,
                     num_xs: int, num_ys: int) -> dict[str, Any]:
    """``params`` for a scan whose operands are ``num_consts`` consts, ``num_carry``
    carries and ``num_xs`` stacked inputs, and whose results are the carries and
    ``num_ys`` stacked outputs. A ``linear`` tuple, where JAX has one, is the caller's
    to rebuild (only it knows which operands moved)."""
    new = dict(params)
    if "num_consts" in params:
        new.update(num_consts=num_consts, num_carry=num_carry)
        return new
    from jax._src import flattree as ft  # only JAX versions with ft_in have it

    new["ft_in"] = ft.pack((ft.nones(num_consts), ft.nones(num_carry), ft.nones(num_xs)))
    new["ft_out"] = ft.pack((ft.nones(num_carry), ft.nones(num_ys)))
    return new
