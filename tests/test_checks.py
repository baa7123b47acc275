"""jaxmem.dispatch.checks: what ``jaxmem.jit`` takes, checked as ``jax.jit`` checks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.dispatch.checks import donated_positions


def _step(state: dict[str, jax.Array], x: jax.Array, /, scale: float = 1.0) -> tuple:
    return jax.tree.map(lambda a: a + scale * x.sum(), state), x.sum()


def test_donate_argnames_resolve_to_positions_as_jax_jit_resolves_them() -> None:
    assert donated_positions(_step, (), "state") == (0,)
    assert donated_positions(_step, (1,), ("state", "scale")) == (0, 1, 2)
    with pytest.raises(ValueError, match="'nope'.*not a positional parameter"):
        donated_positions(_step, (), "nope")
    f = jaxmem.jit(_step, polymorphic_shapes=(None, "n"), constraints=("n <= 64",),
                   donate_argnames="state")
    state = {"a": jnp.ones(3)}
    _, total = f(state, jnp.ones(4))
    assert float(total) == 4.0 and state["a"].is_deleted()
