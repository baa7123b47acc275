"""Residual groups (``jaxmem.plan.residuals``): one group per role in every layer, found
from the computation itself, so that a Python loop over layers without
``jax.named_scope`` is planned as finely as a named one."""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp

from bench.programs import gpt_program
from jaxmem.graph import build_graph
from jaxmem.plan.residuals import find_residuals

LAYERS = 3


def _residuals(step, *args):
    return find_residuals(build_graph(jax.make_jaxpr(step)(*args)))


def _loss(ws, x, named: bool):
    for k, w in enumerate(ws):
        with jax.named_scope(f"layer_{k}") if named else contextlib.nullcontext():
            h = jnp.tanh(x @ w["up"])  # two roles of one primitive in every layer
            x = x + jnp.tanh(h @ w["down"]) * jnp.exp(x)
    return (x ** 2).sum()


def _args():
    w = {"up": jnp.ones((8, 16)) * 0.1, "down": jnp.ones((16, 8)) * 0.1}
    return [w] * LAYERS, jnp.ones((4, 8))


def _partition(residuals):
    """The residuals' grouping as sets of positions, whatever the groups are called."""
    groups = collections.defaultdict(set)
    for k, r in enumerate(residuals):
        groups[r.group].add(k)
    return sorted(map(sorted, groups.values()))


def test_roles_split_one_primitive_into_its_roles_in_every_layer():
    residuals = _residuals(jax.grad(lambda ws, x: _loss(ws, x, False)), *_args())
    tanh = collections.Counter(r.group for r in residuals if r.primitive == "tanh")
    # The two tanh of a layer are two groups, each holding that tanh of every layer.
    assert len(tanh) == 2 and set(tanh.values()) == {LAYERS}, tanh


def test_names_only_change_the_labels():
    unnamed = _residuals(jax.grad(lambda ws, x: _loss(ws, x, False)), *_args())
    named = _residuals(jax.grad(lambda ws, x: _loss(ws, x, True)), *_args())
    assert [r.primitive for r in named] == [r.primitive for r in unnamed]
    assert _partition(named) == _partition(unnamed)
    assert any(r.group.startswith("layer_*") for r in named)


def test_a_concrete_trace_gets_the_symbolic_traces_groups():
    # The rewrite finds a level's groups again by name on each concrete trace.
    program = gpt_program(layers=2, d=32, heads=2, vocab=32, max_b=2, max_s=16)
    symbolic = _residuals(program.step, *program.symbolic_args())
    concrete = _residuals(program.step, *program.concrete_args({"b": 2, "s": 16}))
    by_symbolic = collections.Counter(r.group for r in symbolic)
    by_concrete = collections.Counter(r.group for r in concrete)
    # Some primitives only one trace has (the symbolic one's dim arithmetic); every role
    # found on the concrete trace is the symbolic trace's, with as many residuals.
    roles = {g for g in by_concrete if "(" in g}
    assert len(roles) >= 5 and roles <= set(by_symbolic), (by_symbolic, by_concrete)
    assert all(by_concrete[g] == by_symbolic[g] for g in set(by_symbolic) & set(by_concrete))
