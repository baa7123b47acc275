"""``bench.accuracy``: every level of a plan set against XLA, rows and summary.

A tiny MLP keeps this quick; the figures themselves come from ``python -m
bench.accuracy`` (README) and the bounds are tested in ``test_memory.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxmem
from bench import accuracy
from bench.programs import gpt_program, mlp_program


def test_polymorphic_shapes_name_the_batch_dims() -> None:
    assert accuracy.polymorphic_shapes(mlp_program(d_in=8, hidden=8)) == (None, "b, 8", "b")
    assert accuracy.polymorphic_shapes(gpt_program(1, 16, 1, 16)) == (None, "b, s")


def test_rows_cover_every_level_and_carry_its_own_prediction() -> None:
    program = mlp_program(d_in=16, hidden=32, layers=2, classes=4, max_b=64)
    rows = accuracy.run_program("mlp", program, [{"b": 8}, {"b": 64}], lambda _: None)
    f = jaxmem.jit(program.step, polymorphic_shapes=accuracy.polymorphic_shapes(program),
                   constraints=program.constraints)
    levels = f.plans(*program.concrete_args({"b": 8})).levels
    assert [(r["shape"]["b"], r["level"]) for r in rows] == [
        (b, k) for b in (8, 64) for k in range(len(levels))]
    for r in rows:
        # The prediction is the level's own peak_fn at the row's dims; XLA's figure is
        # the peak of that level's executable.
        assert r["predicted"] == levels[r["level"]].peak_fn(r["shape"])
        assert r["error"] == pytest.approx((r["predicted"] - r["xla"]) / r["xla"])
    summary = accuracy.summarize(rows)
    assert summary["overall"]["n"] == len(rows)
    assert summary["mlp level 0"]["n"] == 2
    assert list(summary)[-3:] == ["overall", "overall level 0", "overall deeper"]
    assert summary["overall"]["worst"] == max(abs(r["error"]) for r in rows)


def test_suite_has_scanned_linen_and_bf16_programs() -> None:
    assert {"gpt", "gpt-scan", "linen", "llama", "gpt-bf16", "llama-bf16",
            "gpt-scan-bf16", "linen-bf16", "linen-scan-bf16"} <= set(accuracy.SUITE)
    bf16 = accuracy.SUITE["gpt-bf16"][0](1)
    # Mixed precision: float32 parameters, bfloat16 compute.
    assert {x.dtype for x in jax.tree_util.tree_leaves(bf16.state)} == {
        jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}
    assert bf16.name.endswith("-bfloat16")


@pytest.mark.slow
def test_main_writes_rows_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "accuracy.json"
    assert accuracy.main(["--quick", "--programs", "mlp", "--no-timing", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"program", "level", "shape", "xla", "predicted", "error"} <= set(res["rows"][0])
    assert res["summary"]["overall"]["n"] == len(res["rows"])


@given(st.integers(1, 40))
def test_quick_form_compiles_the_first_middle_and_deepest_level(n) -> None:
    levels = accuracy.quick_levels(n)
    assert levels == sorted(set(levels)) and set(levels) <= set(range(n))
    assert levels[0] == 0 and levels[-1] == n - 1 and n // 2 in levels and len(levels) <= 3
