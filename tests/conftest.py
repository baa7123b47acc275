"""Shared pytest setup for jaxmem's own tests.

Hypothesis runs a few dozen examples without deadlines (sympy's first calls are
slow and would trip them); ``HYPOTHESIS_PROFILE=thorough`` runs more.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# ``import programs`` from any test module, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("default", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def bs_domain():
    """The domain ``1 <= b <= 16, 1 <= s <= 512`` of the contract's examples."""
    from jaxmem.symbolic import ShapeDomain

    return ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 512"))


@pytest.fixture(scope="session")
def b_dim():
    """A symbolic batch dim ``b <= 1024``."""
    import jax

    (b,) = jax.export.symbolic_shape("b", constraints=("b <= 1024",))
    return b


@pytest.fixture(scope="session")
def b_dom():
    """The domain ``1 <= b <= 1024`` of :func:`b_dim`."""
    from jaxmem.symbolic import ShapeDomain

    return ShapeDomain.from_constraints(("b",), ("b <= 1024",))
