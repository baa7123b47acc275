"""Residual groups (``jaxmem.plan.residuals``): one group per role in every layer, found
from the computation itself, so that a Python loop over layers without
``jax.named_scope`` is planned as finely as a named one."""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import deepest_level_lowers_and_matches

import jaxmem
from bench.programs import gpt_program, gpt_scan_program
from jaxmem.graph import build_graph
from jaxmem.plan.residuals import find_residuals

LAYERS = 3


def _residuals(step, *args, bodies: bool = False):
    """The residuals of ``step``'s trace; with ``bodies``, those of its loop bodies too."""
    graph = build_graph(jax.make_jaxpr(step)(*args))
    subs = [s for n in graph.nodes for s in n.subgraphs] if bodies else []
    return [r for g in (graph, *subs) for r in find_residuals(g)]


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


@pytest.mark.parametrize("make", [gpt_program, gpt_scan_program], ids=["loop", "scan"])
def test_a_concrete_trace_gets_the_symbolic_traces_groups(make):
    # The rewrite finds a level's groups again by name on each concrete trace: the two
    # traces must name the same groups, with as many residuals each, though the symbolic
    # one indexes ``qkv[:, :, 0]`` by a gather and reads dims as values where the
    # concrete one slices and has literals.
    program = make(layers=2, d=32, heads=2, vocab=32, max_b=2, max_s=16)
    graph = build_graph(jax.make_jaxpr(program.step)(*program.symbolic_args()))
    assert {"gather", "dim_as_value"} <= {n.primitive for n in graph.nodes}
    symbolic = _residuals(program.step, *program.symbolic_args(), bodies=True)
    concrete = _residuals(program.step, *program.concrete_args({"b": 2, "s": 16}), bodies=True)
    by_symbolic = collections.Counter(r.group for r in symbolic)
    assert len([g for g in by_symbolic if "(" in g]) >= 3, by_symbolic
    assert by_symbolic == collections.Counter(r.group for r in concrete)


def test_a_static_index_is_a_slice_on_either_trace():
    def loss(wv, x):
        t = jnp.tanh(x @ wv[0]).reshape(x.shape[0], 4, 3)
        return jnp.tanh(t[:, 1:3, 0] @ wv[1]).sum()  # the dot's backward reads the slice

    args = ((jnp.ones((8, 12)) * 0.1, jnp.ones((2, 5))), jnp.ones((2, 8)))
    sym = jax.export.symbolic_args_specs(args, (None, "b, _"))
    symbolic = {r.group for r in _residuals(jax.grad(loss), *sym)}
    assert symbolic == {r.group for r in _residuals(jax.grad(loss), *args)}
    assert any(g.startswith("<top>:slice") for g in symbolic), symbolic


def test_a_dropout_mask_is_recomputed_from_its_key():
    def loss(ws, x, key):
        for i, w in enumerate(ws):
            h = jnp.tanh(x @ w)
            x = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape),
                          h / 0.9, 0)
        return (x ** 2).sum()

    step = jax.grad(loss)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.float32) * 0.1
    args = ([w] * 3, jnp.ones((32, 64)), jax.random.key(0))
    graph = build_graph(jax.make_jaxpr(step)(*args))
    random = {n.index for n in graph.nodes if n.primitive in ("random_bits", "threefry2x32")}
    assert random and any(random & set(r.recompute_nodes) for r in find_residuals(graph))
    # Re-drawn from the same key, the mask is the same: every level computes jax.jit's step.
    planned = jaxmem.jit(step, polymorphic_shapes=(None, "b, _", None), constraints=("b <= 32",))
    want = jax.jit(step)(*args)
    levels = planned.plans(*args).levels
    assert len(levels) > 1
    for k in range(len(levels)):
        got = planned.compile_level(k, *args).run(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("drop", [0, 2, 5])
def test_one_walk_gives_each_values_own_recompute_chain(drop):
    """``recompute_chains_from`` against ``recompute_chain`` value by value: from the
    saved set a segment plan walks from, and from smaller ones (some chains then fail)."""
    from jaxmem.plan.residuals import recompute_chain, recompute_chains_from

    p = gpt_program(LAYERS, 64, 2, 64, 2, 16)
    graph = build_graph(jax.make_jaxpr(p.step)(*p.symbolic_args()))
    residuals = find_residuals(graph)
    values = [v for r in residuals for v in (r.value, *r.aliases)]
    leaves = {r.value for r in residuals[::3]} | set(graph.inputs) | {v for v, _ in graph.consts}
    leaves -= set(list(graph.inputs)[:drop])
    walked = recompute_chains_from(graph, values, leaves)
    assert walked == {v: recompute_chain(graph, v, leaves) for v in values}
    assert any(c for c in walked.values()) and (drop == 0 or None in walked.values())


def test_a_users_checkpoint_rerun_is_planned_on_top_of():
    """Per-layer ``jax.checkpoint(nothing_saveable)`` in a Python loop: the checkpoint's
    re-run in the backward pass hands its values to the layer's backward pass. They are
    residuals too, so levels recompute them later still: below the user's own peak by
    XLA's figures, computing ``jax.jit``'s step."""
    from bench.programs import concrete

    p = gpt_program(2, 32, 2, 64, 4, 64, remat_policy=jax.checkpoint_policies.nothing_saveable)
    args = (concrete(p.state, 0),
            jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 64)), jnp.int32))
    f = jaxmem.jit(p.step, polymorphic_shapes=(None, "b, s"), constraints=p.constraints)
    graph = f.analysis(*args).graph
    rerun = [r for r in find_residuals(graph) if "rematted_computation" in r.group]
    assert rerun and all(not graph.nodes[r.producer].is_backward for r in rerun)
    deepest_level_lowers_and_matches(f, args, p.step)


def test_a_value_read_where_the_backward_pass_starts_is_no_residual():
    # The last layer's output is read by the loss's backward before any other backward
    # value exists: a rebuild would sit where it dies, pinned to nothing XLA keeps.
    def loss(ws, x):
        h = x
        for w in ws:
            h = h + jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    args = ([jnp.ones((32, 32))] * 2, jnp.ones((16, 32)))
    graph = build_graph(jax.make_jaxpr(jax.grad(loss))(*args))
    adds = [n.outputs[0] for n in graph.nodes if n.primitive == "add" and not n.is_backward]
    residuals = {r.value for r in find_residuals(graph)}
    assert adds[0] in residuals  # the first layer's output, read by the second's gradient
    assert adds[-1] not in residuals


def _batch_norm_mlp(ws, x):
    """Two ReLU layers normalised over the batch (a BatchNorm's statistics divide by
    the batch size: ``dim_as_value`` on a symbolic trace, a literal on a concrete one)."""
    for w in ws:
        h = x @ w
        mean = h.mean(0)
        var = ((h - mean) ** 2).mean(0)
        x = jax.nn.relu((h - mean) * jax.lax.rsqrt(var + 1e-5)) @ w.T
    return x.sum()


def test_a_batch_statistic_is_rebuilt_on_the_symbolic_trace_as_on_the_concrete_one():
    # Counted as a heavy op, each ``dim_as_value`` made the symbolic trace's chains too
    # long, so its model kept the ReLU and the centred value that the concrete rewrite
    # rebuilt: bench.unseen's BatchNorm MLP level at +38.8 %.
    from jaxmem.plan.remat import recompute_chains

    args = ([jnp.ones((16, 32)) * 0.1] * 2, jnp.ones((8, 16)))
    sym = jax.export.symbolic_args_specs(args, (None, "b, _"))
    rebuilt = []
    for specs in (sym, args):
        graph = build_graph(jax.make_jaxpr(jax.grad(_batch_norm_mlp))(*specs))
        residuals = find_residuals(graph)
        chains = recompute_chains(graph, residuals, residuals)
        rebuilt.append(collections.Counter(r.group for r, _ in chains))
    assert any(n.primitive == "dim_as_value" for n in build_graph(
        jax.make_jaxpr(jax.grad(_batch_norm_mlp))(*sym)).nodes)
    assert rebuilt[0] == rebuilt[1], rebuilt
    assert any(":max" in g for g in rebuilt[0]), rebuilt[0]
