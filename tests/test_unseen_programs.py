"""bench.unseen_programs and bench.unseen_kinds: programs written apart from jaxmem run
under ``jaxmem.jit`` exactly as under ``jax.jit`` at their deepest level; at full size XLA
puts that level's peak below level 0's. The eval step (no gradient, nothing to
recompute: one level) runs exactly as under ``jax.jit``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxmem
from bench.unseen_kinds import KINDS
from bench.unseen_programs import CASES


def _check_deepest_level(name: str, quick: bool) -> None:
    case = {**CASES, **KINDS}[name](quick)
    args = (case.state, *case.data)
    f = jaxmem.jit(case.step, polymorphic_shapes=case.polymorphic_shapes,
                   constraints=case.constraints)
    levels = len(f.plans(*args).levels)
    assert levels > 1, f"{name}: no level recomputes anything"
    deepest = f.compile_level(levels - 1, *args)
    if not quick:  # tiny shapes are all fixed overhead, where a level can cost a little
        assert deepest.peak_bytes < f.compile_level(0, *args).peak_bytes
    f.use_plan(deepest, *args)
    _assert_same(f(*args), jax.jit(case.step)(*args))


def _assert_same(got: object, want: object) -> None:
    """Leaf by leaf to float32 rounding; typed PRNG keys by their key data."""
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


TRAIN = sorted((set(CASES) | set(KINDS)) - {"eval"})


@pytest.mark.parametrize("name", TRAIN)
def test_deepest_level_computes_the_step_of_jax_jit(name: str) -> None:
    _check_deepest_level(name, quick=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAIN)
def test_deepest_level_at_full_size_is_smaller_than_level_0(name: str) -> None:
    _check_deepest_level(name, quick=False)


@pytest.mark.parametrize("quick", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_eval_step_runs_as_jax_jit(quick: bool) -> None:
    case = CASES["eval"](quick)
    args = (case.state, *case.data)
    f = jaxmem.jit(case.step, polymorphic_shapes=case.polymorphic_shapes,
                   constraints=case.constraints)
    _assert_same(f(*args), jax.jit(case.step)(*args))
