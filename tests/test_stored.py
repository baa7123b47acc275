"""Plan sets as data (``jaxmem.plan.stored``): decoded onto a fresh trace, equal to the derived."""

from __future__ import annotations

import copy
import json
import warnings

import jax
import jax.numpy as jnp
import pytest
from programs import small_gpt

import jaxmem
from jaxmem.plan.analysis import Analysis, analyze_specs
from jaxmem.plan.offload import Costs
from jaxmem.plan.stored import StaleEntryError, decode_plans, encode_plans


def _toy_step(ws: list, x: jax.Array) -> list:
    def loss(ws: list, x: jax.Array) -> jax.Array:
        for w in ws:
            x = x + jnp.tanh(x @ w)
        return (x**2).sum()

    return jax.grad(loss)(ws, x)


def _toy(offload: bool = False) -> Analysis:
    args = ([jnp.ones((32, 32))] * 3, jnp.ones((8, 32)))
    # With a slow device and a fast host link, offload beats recomputation.
    costs = Costs(flops_per_s=1e8, host_bytes_per_s=1e13) if offload else None
    return analyze_specs(_toy_step, (), args, (), (None, "b, 32"), ("b <= 256",), None, (),
                         True, offload, costs)


def _fresh(analysis: Analysis) -> tuple:
    """The graph and domain of a second trace of the same function (a rerun's)."""
    again = analyze_specs(analysis.flat_fn, (), analysis.specs, (), None, (), None, (), True,
                          planner=lambda inputs: ((), ()))
    return again.graph, again.domain


@pytest.mark.parametrize("make", [_toy, lambda: _toy(offload=True)], ids=["toy", "offload"])
def test_decoded_plans_equal_the_derived_ones(make) -> None:
    a = make()
    assert len(a.plans.levels) > 1
    if a.offload_planned:
        assert any(level.offloaded for level in a.plans.levels)
    data = json.loads(json.dumps(encode_plans(a.plans, a.orders, a.graph)))
    graph, domain = _fresh(a)
    plans, orders = decode_plans(data, graph, domain)
    assert (plans, orders) == (a.plans, a.orders)
    corner = domain.corner()
    assert [lv.peak_fn(corner) for lv in plans.levels] == [
        lv.peak_fn(corner) for lv in a.plans.levels]


def test_segment_levels_and_orders_round_trip_on_a_gpt() -> None:
    prog = small_gpt()

    class Forward(jaxmem.Scheduler):  # any valid order, so that orders are stored too
        def order(self, graph):
            return list(range(len(graph.graph.nodes)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        a = analyze_specs(prog.step, (), prog.concrete_args({"b": 2, "s": 16}), (),
                          (None, "b, s"), prog.constraints, Forward(), (), True)
        graph, domain = _fresh(a)
    assert any(level.segments is not None for level in a.plans.levels)
    data = json.loads(json.dumps(encode_plans(a.plans, a.orders, a.graph)))
    assert decode_plans(data, graph, domain) == (a.plans, a.orders)


def test_an_entry_for_another_graph_is_stale() -> None:
    a = _toy()
    data = encode_plans(a.plans, a.orders, a.graph)
    other = analyze_specs(lambda x: jax.grad(lambda x: jnp.sin(x).sum())(x), (),
                          (jnp.ones((4, 32)),), (), ("b, 32",), ("b <= 256",), None, (), True)
    with pytest.raises(StaleEntryError):
        decode_plans(data, other.graph, other.domain)


@pytest.mark.parametrize("damage", ["level graph", "residual", "order", "missing", "expr"])
def test_damaged_data_raises_stale_entry_errors(damage: str) -> None:
    a = _toy()
    data = copy.deepcopy(encode_plans(a.plans, a.orders, a.graph))
    if damage == "level graph":
        data["levels"][-1]["graph"][0] += 1
    elif damage == "residual":
        data["levels"][-1]["residuals"][0][0] = 10**6
    elif damage == "order":
        data["orders"][0] = [0, 0]
    elif damage == "missing":
        del data["levels"][0]["memory"]
    else:
        data["exprs"][0] = ["app", "print", []]
    with pytest.raises(StaleEntryError):
        decode_plans(data, a.graph, a.domain)


def test_loop_levels_round_trip_on_a_scanned_decoder() -> None:
    from test_loops import ADAMW, CONSTRAINTS, POLY, _args, scan_step

    a = analyze_specs(scan_step(), (), _args(ADAMW), (), POLY, CONSTRAINTS, None, (), True)
    assert any(level.loops is not None for level in a.plans.levels)
    data = json.loads(json.dumps(encode_plans(a.plans, a.orders, a.graph)))
    graph, domain = _fresh(a)
    assert decode_plans(data, graph, domain) == (a.plans, a.orders)
