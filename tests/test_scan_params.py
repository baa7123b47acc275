"""A scan's operand split, read and rebuilt on the JAX installed (0.10 or 0.11 form)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from jaxmem.graph import scan_counts, with_scan_counts


def _scan_eqn(n_consts: int):
    """The scan equation of a loop with ``n_consts`` closed-over arrays, two carries,
    one stacked input and two stacked outputs."""
    consts = [jnp.full(3, float(i)) for i in range(n_consts)]

    def f(c, d, xs):
        def body(carry, x):
            c, d = carry
            extra = sum(consts, jnp.zeros(3))
            return (c + x + extra, d * x), (c * x, d - x)
        return jax.lax.scan(body, (c, d), xs)

    jaxpr = jax.make_jaxpr(f)(jnp.zeros(3), jnp.ones(3), jnp.zeros((5, 3)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


@pytest.mark.parametrize("n_consts", [0, 2])
def test_counts_match_the_equation(n_consts: int) -> None:
    eqn = _scan_eqn(n_consts)
    consts, carry = scan_counts(eqn.params)
    assert (consts, carry) == (n_consts, 2)
    assert len(eqn.invars) == consts + carry + 1
    assert len(eqn.outvars) == carry + 2


@pytest.mark.parametrize("n_consts", [0, 2])
def test_rebuilt_params_equal_the_originals_for_the_same_split(n_consts: int) -> None:
    eqn = _scan_eqn(n_consts)
    rebuilt = with_scan_counts(eqn.params, num_consts=n_consts, num_carry=2, num_xs=1,
                               num_ys=2)
    assert scan_counts(rebuilt) == (n_consts, 2)
    if "num_consts" in eqn.params:  # 0.11's ft_out may mark forwarded ys; the counts agree
        assert rebuilt == dict(eqn.params)


def test_a_moved_split_is_read_back() -> None:
    eqn = _scan_eqn(0)
    moved = with_scan_counts(eqn.params, num_consts=3, num_carry=2, num_xs=4, num_ys=5)
    assert scan_counts(moved) == (3, 2)
    assert scan_counts(eqn.params) == (0, 2)  # the original is left as it was


@pytest.mark.skipif(importlib.util.find_spec("jax._src.flattree") is None,
                    reason="JAX before 0.11 has no flat-tree scan params")
def test_flat_tree_form_has_one_leaf_per_operand_and_result() -> None:
    eqn = _scan_eqn(1)
    moved = with_scan_counts(eqn.params, num_consts=1, num_carry=2, num_xs=3, num_ys=4)
    assert "num_consts" not in moved
    assert [len(t) for t in moved["ft_in"].unpack()] == [1, 2, 3]
    assert [len(t) for t in moved["ft_out"].unpack()] == [2, 4]
