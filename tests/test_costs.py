"""CostLog: measured compile and step seconds, and their round trip through the disk store."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.dispatch.costs import MAX_STORED_STEPS, CostLog


def test_json_round_trip_keeps_real_compiles_and_latest_steps() -> None:
    log = CostLog()
    log.record_compile({"b": 8, "s": 100}, 3.0)
    for i in range(MAX_STORED_STEPS + 5):
        log.record_step({"b": 8, "s": 100}, 0.01 * i)
    again = CostLog()
    assert again.merge_json(log.to_json())
    assert again.earlier == {"b=8,s=100": 3.0}
    assert len(again.steps) == MAX_STORED_STEPS and again.steps[-1][1] == log.steps[-1][1]


@pytest.mark.parametrize("data", [None, [], {"compiles": {"b=1": -1.0}, "steps": []},
                                  {"compiles": {}, "steps": [[{"b": "x"}, 1.0]]},
                                  {"compiles": {"b=1": float("nan")}, "steps": []},
                                  {"steps": []}])
def test_foreign_data_adds_nothing(data) -> None:
    log = CostLog()
    assert not log.merge_json(data)
    assert log.earlier == {} and log.steps == [] and not log.measured


def test_earlier_shapes_load_only_where_the_persistent_cache_is_on() -> None:
    log = CostLog()
    assert log.compile_s({"s": 1}, persistent_cache=True) is None
    log.merge_json({"compiles": {"s=64": 4.0}, "steps": []})
    assert log.compile_s({"s": 64}, persistent_cache=True) == 0.0  # no load measured yet
    assert log.compile_s({"s": 64}, persistent_cache=False) == 4.0
    assert log.compile_s({"s": 32}, persistent_cache=True) == 4.0
    log.record_compile({"s": 64}, 0.5)  # a load
    log.record_compile({"s": 32}, 2.0)  # a real compile
    assert log.compile_s({"s": 64}, persistent_cache=True) == 0.5
    assert log.compile_s({"s": 16}, persistent_cache=True) == 3.0


def step(w: jax.Array, x: jax.Array) -> jax.Array:
    return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)


def test_a_rerun_plans_with_the_costs_an_earlier_run_measured(tmp_path) -> None:
    kw = dict(polymorphic_shapes=(None, "b, s, 16"), constraints=("s <= 64",),
              cache_dir=tmp_path)
    w = jnp.ones((16, 16))
    calls = [(w, jax.ShapeDtypeStruct((2, s, 16), jnp.float32)) for s in (8, 20, 64)]
    first = jaxmem.jit(step, **kw)
    first.plan_compiles(calls, pad_dims=("s",))
    first.costs.record_step({"b": 2, "s": 64}, 0.25)
    first.close()
    second = jaxmem.jit(step, **kw)
    plan = second.plan_compiles(calls, pad_dims=("s",))
    assert second.cache_info().executables == 0  # no compile needed to learn the costs
    assert second.costs.steps == [({"b": 2, "s": 64}, 0.25)]
    assert second.costs.earlier == {"b=2,s=64": first.costs.compiles[0][1]}
    assert plan.covers
