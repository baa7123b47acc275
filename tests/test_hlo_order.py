"""Tests for ``hlo_passes.order``: whether a requested op order survived XLA's scheduler.

Orders are requested with ``lax.optimization_barrier`` and observed through the
``jax.named_scope`` names that XLA keeps in each instruction's ``op_name``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from hlo_passes import order_survival
from hlo_passes.hlo_text import parse_instruction
from hlo_passes.order import matches

KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def _two_branches(x, b):
    with jax.named_scope("branch_b"):
        for _ in range(3):
            b = jnp.sin(b @ b)
    x, b = lax.optimization_barrier((x, b))  # A's input now depends on B's result
    with jax.named_scope("branch_a"):
        for _ in range(3):
            x = jnp.cos(x @ x)
    return x.sum() + b.sum()


def test_barrier_order_survives_with_cpu_option():
    x = jnp.ones((64, 64))
    compiled = jax.jit(_two_branches).lower(x, x).compile(compiler_options=KEEP_BARRIERS)
    result = order_survival(compiled, ["branch_b", "branch_a"], mode="all")
    a, b = result.positions[1], result.positions[0]
    assert len(a) >= 3 and len(b) >= 3
    assert max(b) < min(a)  # B runs entirely before A
    assert result.fraction == 1.0 == float(result)
    assert result.observed == ("branch_b", "branch_a") and not result.missing
    reverse = order_survival(compiled, ["branch_a", "branch_b"], mode="all")
    assert reverse.fraction == 0.0 and reverse.broken == 1


def test_order_survival_counts_pairs_and_missing():
    def f(x):
        with jax.named_scope("s1"):
            x = jnp.sin(x) @ x
        with jax.named_scope("s2"):
            x = jnp.cos(x) @ x
        with jax.named_scope("s3"):
            return jnp.tanh(x) @ x

    compiled = jax.jit(f).lower(jnp.ones((16, 16))).compile()
    result = order_survival(compiled, ["s1", "s3", "s2", "nowhere"])
    assert result.missing == ("nowhere",)
    assert (result.kept, result.broken, result.tied) == (2, 1, 0)
    assert result.fraction == pytest.approx(2 / 3)
    assert result.observed == ("s1", "s2", "s3")


def test_markers_match_transformed_and_merged_op_names():
    ins = parse_instruction('%m = f32[2]{0} multiply(%x, %y), metadata={op_name='
                            '"jit(f)/transpose(jvp(layer_1))/attn/mul;jit(f)/jvp(mlp)/neg"}')
    assert matches(ins, "layer_1/attn") and matches(ins, "mlp") and matches(ins, "m")
    assert not matches(ins, "layer_1/mlp") and not matches(ins, "layer_10")
