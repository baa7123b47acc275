"""Loop levels (``jaxmem.plan.loops``): a scanned decoder gets plans as good as per-iteration
``jax.checkpoint``, found on the one post-AD trace.

The programs are tiny decoders whose layers run under ``lax.scan`` (and Flax linen's
``nn.scan``) over stacked parameters, trained with AdamW as ``bench.programs`` does.
XLA's ``argument + output - alias + temp`` is the oracle for every peak; the
hand-written reference (``jax.checkpoint(body, policy=nothing_saveable)`` inside the
scan) is compiled here, never assumed.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sympy

import jaxmem
from bench.programs import causal_attention, layer_norm, optax_step
from jaxmem.dims import sym
from jaxmem.graph import JaxmemWarning, build_graph, scan_counts
from jaxmem.graph.build import dim_of
from jaxmem.lower import as_function, compiler_options
from jaxmem.memory.liveness import liveness
from jaxmem.plan.loops import LoopPlan, apply_loop_plan, loop_candidates
from jaxmem.plan.offload import Costs
from jaxmem.plan.scan_pairs import find_scan_pairs

LAYERS, D, HEADS, VOCAB, B, S = 3, 64, 2, 64, 2, 64
CONSTRAINTS = (f"b <= {B}", f"s <= {S}")
POLY = (None, "b, s")
NOTHING = jax.checkpoint_policies.nothing_saveable


def _params(rng: np.random.Generator) -> dict:
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.1)

    def ln():
        return {"scale": 1 + w(LAYERS, D), "bias": w(LAYERS, D)}

    blocks = {"ln1": ln(), "ln2": ln(), "qkv": {"w": w(LAYERS, D, 3 * D), "b": w(LAYERS, 3 * D)},
              "out": {"w": w(LAYERS, D, D), "b": w(LAYERS, D)},
              "fc": {"w": w(LAYERS, D, 4 * D), "b": w(LAYERS, 4 * D)},
              "proj": {"w": w(LAYERS, 4 * D, D), "b": w(LAYERS, D)}}
    return {"embed": w(VOCAB, D), "blocks": blocks, "head": w(D, VOCAB)}


ADAMW = optax.adamw(1e-3)
#: Outputs are compared under SGD: AdamW divides by the gradients' own scale, so a
#: rounding difference in a near-zero gradient (a rebuild fused differently) becomes a
#: visible step.
SGD = optax.sgd(0.1)


def scan_step(policy=None, opt=ADAMW):
    """A train step of a GPT-like decoder scanned over its stacked layers; ``policy``
    wraps the scan body in ``jax.checkpoint``, the one line a user would write."""
    def layer(x, p):
        x = x + causal_attention(layer_norm(x, p["ln1"]), p, HEADS)
        h = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc"]["w"] + p["fc"]["b"])
        return x + h @ p["proj"]["w"] + p["proj"]["b"], None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss_fn(params, tokens):
        x, _ = jax.lax.scan(body, params["embed"][tokens], params["blocks"])
        logp = jax.nn.log_softmax(x @ params["head"])
        targets = jnp.roll(tokens, -1, axis=1)
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()

    return optax_step(loss_fn, opt)


def _args(opt):
    rng = np.random.default_rng(0)
    params = _params(rng)
    return (params, opt.init(params)), jnp.asarray(rng.integers(0, VOCAB, (B, S)), jnp.int32)


@pytest.fixture(scope="module")
def args():
    return _args(ADAMW)


def _peak(step, args) -> int:
    compiled = jax.jit(step).lower(*args).compile(compiler_options=compiler_options())
    return jaxmem.xla_peak_bytes(compiled)


def _assert_same(got, want) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


@pytest.fixture(scope="module")
def checkpointed_peak(args) -> int:
    """XLA's peak of the step with ``jax.checkpoint(body, policy=nothing_saveable)``."""
    return _peak(scan_step(NOTHING), args)


@pytest.fixture(scope="module")
def planned(args):
    f = jaxmem.jit(scan_step(), polymorphic_shapes=POLY, constraints=CONSTRAINTS)
    return f, f.plans(*args)


def test_the_forward_and_backward_scans_are_paired_and_their_residuals_found(args):
    graph = build_graph(jax.make_jaxpr(scan_step())(*args))
    pairs = find_scan_pairs(graph)
    assert len(pairs) == 1
    f, b = graph.nodes[pairs[0].forward], graph.nodes[pairs[0].backward]
    assert not f.is_backward and b.is_backward and b.eqn.params["reverse"]
    assert len(pairs[0].droppable) > 5


def test_loop_levels_join_the_plan_set_and_describe_lists_them(planned):
    _, plans = planned
    loops = [level for level in plans.levels if level.loops is not None]
    assert len(plans.levels) > 1 and loops
    assert "scan bodies: rebuild" in plans.describe()


def test_every_level_computes_what_jax_jit_computes():
    args, step = _args(SGD), scan_step(opt=SGD)
    f = jaxmem.jit(step, polymorphic_shapes=POLY, constraints=CONSTRAINTS)
    plans = f.plans(*args)
    assert any(level.loops is not None and level.loops.saved_primitive for level in plans.levels)
    want = jax.jit(step)(*args)
    for k in range(len(plans.levels)):
        _assert_same(f.compile_level(k, *args).run(*args), want)


def test_the_lowest_level_matches_per_iteration_checkpoint_and_is_predicted(
        planned, args, checkpointed_peak):
    f, plans = planned
    compiled = [f.compile_level(k, *args) for k in range(len(plans.levels))]
    lowest = min(compiled, key=lambda p: p.peak_bytes)
    plain = compiled[0].peak_bytes
    print(f"\nplain {plain} B, nothing_saveable body {checkpointed_peak} B, lowest level "
          f"{lowest.level}: XLA {lowest.peak_bytes} B, predicted {lowest.predicted_peak_bytes} B")
    assert plans.levels[lowest.level].loops is not None
    assert lowest.peak_bytes <= 1.1 * checkpointed_peak < plain
    for plan in compiled:
        if plans.levels[plan.level].loops is not None:
            assert abs(plan.predicted_peak_bytes / plan.peak_bytes - 1) <= 0.1, plan.describe()


def test_a_budget_between_checkpoint_and_plain_is_met(args, checkpointed_peak):
    budget = int(1.1 * checkpointed_peak)
    f = jaxmem.jit(scan_step(), polymorphic_shapes=POLY, constraints=CONSTRAINTS,
                   budget_bytes=budget)
    plan = f.plan_for(*args)
    print(f"\nbudget {budget} B: level {plan.level}, XLA {plan.peak_bytes} B; {plan.guard}")
    assert plan.peak_bytes <= budget
    assert np.isclose(f(*args)[1], jax.jit(scan_step())(*args)[1], rtol=1e-5)


@pytest.mark.parametrize("policy", [NOTHING, jax.checkpoint_policies.dots_saveable],
                         ids=["nothing_saveable", "dots_saveable"])
def test_a_body_the_user_checkpointed_keeps_working_and_is_planned_on_top(policy):
    args, step = _args(SGD), scan_step(policy, SGD)
    f = jaxmem.jit(step, polymorphic_shapes=POLY, constraints=CONSTRAINTS)
    plans = f.plans(*args)
    want = jax.jit(step)(*args)
    peaks = []
    for k in range(len(plans.levels)):
        plan = f.compile_level(k, *args)
        _assert_same(plan.run(*args), want)
        peaks.append(plan.peak_bytes)
    assert min(peaks) <= 1.1 * _peak(scan_step(NOTHING, SGD), args)


def test_the_plan_saving_matmul_outputs_matches_dots_saveable(args):
    args, step = _args(SGD), scan_step(opt=SGD)
    flat, tree = jax.tree_util.tree_flatten(args)
    graph = build_graph(jax.make_jaxpr(lambda *a: step(*tree.unflatten(a)))(*flat))
    plans = loop_candidates(graph, find_scan_pairs(graph), {})
    saving = next(p for p in plans if p.saved_primitive)
    run = as_function(apply_loop_plan(graph, saving))
    compiled = jax.jit(run).lower(*flat).compile(compiler_options=compiler_options())
    hand = _peak(scan_step(jax.checkpoint_policies.dots_saveable, SGD), args)
    print(f"\nsaving matmul outputs: XLA {jaxmem.xla_peak_bytes(compiled)} B; "
          f"dots_saveable body {hand} B")
    assert jaxmem.xla_peak_bytes(compiled) <= 1.1 * hand
    _assert_same(compiled(*flat), jax.tree_util.tree_leaves(jax.jit(step)(*args)))


def test_a_plan_for_other_loops_is_not_applied(args):
    graph = build_graph(jax.make_jaxpr(scan_step())(*args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert apply_loop_plan(graph, LoopPlan(((), (0,)))) is graph
    assert any(issubclass(w.category, JaxmemWarning) for w in caught)


def test_fori_loop_layers_get_loop_levels():
    ws = jnp.asarray(np.random.default_rng(1).standard_normal((4, 16, 16)) * 0.3, jnp.float32)

    def step(ws, x):
        def loss(ws):
            h = jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(jnp.tanh(h @ ws[i]) @ ws[i]), x)
            return (h ** 2).mean()
        return ws - 0.1 * jax.grad(loss)(ws)

    x = jnp.ones((8, 16), jnp.float32)
    f = jaxmem.jit(step, polymorphic_shapes=(None, "b, 16"), constraints=("b <= 64",))
    plans = f.plans(ws, x)
    assert any(level.loops is not None for level in plans.levels)
    for k in range(len(plans.levels)):
        _assert_same(f.compile_level(k, ws, x).run(ws, x), jax.jit(step)(ws, x))


def test_a_flax_linen_nn_scan_decoder_reaches_per_iteration_checkpoint():
    from bench.reach import linen_scan_case

    case = linen_scan_case(B, S, LAYERS, D)
    hand = _peak(case["hand"]["nothing_saveable"], case["args"])
    f = jaxmem.jit(case["step"], polymorphic_shapes=case["poly"], constraints=case["constraints"],
                   budget_bytes=int(1.1 * hand))
    plan = f.plan_for(*case["args"])
    print(f"\nlinen nn.scan: nothing_saveable {hand} B; jaxmem level {plan.level} "
          f"{plan.peak_bytes} B, predicted {plan.predicted_peak_bytes} B")
    assert plan.peak_bytes <= 1.1 * hand
    assert f.plans(*case["args"]).levels[plan.level].loops is not None


def test_the_plan_saving_matmul_outputs_stacks_the_same_values_on_every_trace(args):
    """Planned on the symbolic trace, whose bodies hold equations on dims that a concrete
    trace's lack, it must stack the matmul outputs on a concrete trace too (it once
    named equation positions, and stacked other values there)."""
    b, s = jax.export.symbolic_shape("b, s", constraints=CONSTRAINTS)
    state, tokens = args
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    traces = [(spec, jax.ShapeDtypeStruct((b, s), tokens.dtype)), args]
    graphs = [build_graph(jax.make_jaxpr(scan_step())(*a)) for a in traces]
    at = {sym("b"): B, sym("s"): S}
    plan = next(p for p in loop_candidates(graphs[0], find_scan_pairs(graphs[0]), at)
                if p.saved_primitive)
    stacked = []
    for graph in graphs:
        rewritten = apply_loop_plan(graph, plan)
        node = rewritten.nodes[find_scan_pairs(graph)[0].forward]
        stacked.append([tuple(int(sympy.sympify(d).subs(at)) for d in rewritten.values[v].shape)
                        for v in node.outputs])
    assert stacked[0] == stacked[1]


def test_a_constant_filler_the_loops_read_takes_no_buffer(args):
    """A causal mask's filler (a broadcast of ``-1e9``, and the zeros of its transpose)
    that the loops read is moved into their bodies when lowered: XLA's loop state holds
    no array of its shape, and the model gives it no buffer."""
    graph = build_graph(jax.make_jaxpr(scan_step())(*args))
    rewritten = apply_loop_plan(graph, loop_candidates(graph, find_scan_pairs(graph), {})[-1])
    fillers = [n.outputs[0] for n in rewritten.nodes
               if n.primitive == "broadcast_in_dim" and not n.inputs
               and any(rewritten.nodes[c].primitive == "scan"
                       for c in rewritten.consumers.get(n.outputs[0], ()))]
    assert fillers
    compiled = jax.jit(as_function(rewritten)).lower(*jax.tree_util.tree_leaves(args)).compile(
        compiler_options=compiler_options())
    states = [line.split(" while(")[0] for line in compiled.as_text().splitlines()
              if " while(" in line]
    assert states
    for v in fillers:
        shape = "f32[" + ",".join(str(int(d)) for d in rewritten.values[v].shape) + "]"
        assert not any(shape in s for s in states), shape
    assert not {b.value for b in liveness(rewritten)} & set(fillers)


#: Rates at which this decoder's score matmul (contracting a head's 32 lanes) re-runs
#: faster than a loop stacks its output, and its wider matmuls do not.
SCORE_RERUN_COSTS = Costs(1e11, 1e10, 1.25e10)


def _score_ordinal(graph, pair) -> int:
    body = graph.nodes[pair.forward].eqn.params["jaxpr"].jaxpr
    dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
    (k,) = [k for k, e in enumerate(dots) if e.outvars[0].aval.shape == (B, HEADS, S, S)]
    return k


def test_matmuls_cheaper_to_rerun_than_to_stack_are_rerun_in_the_backward_loop():
    """The flash-attention choice, found by cost: the scores' matmul is re-run in the
    backward body, the other matmul outputs are stacked, and the step is unchanged."""
    args, step = _args(SGD), scan_step(opt=SGD)
    flat, tree = jax.tree_util.tree_flatten(args)
    graph = build_graph(jax.make_jaxpr(lambda *a: step(*tree.unflatten(a)))(*flat))
    (pair,) = find_scan_pairs(graph)
    corner = {sym("b"): B, sym("s"): S}
    plans = loop_candidates(graph, [pair], corner, SCORE_RERUN_COSTS)
    (plan,) = [p for p in plans if p.saved_ordinals is not None]
    (kept,) = plan.saved_ordinals
    score = _score_ordinal(graph, pair)
    assert score not in kept and len(kept) >= 4
    assert all(p.saved_ordinals is None for p in loop_candidates(graph, [pair], corner))

    rewritten = apply_loop_plan(graph, plan)
    backward = rewritten.nodes[pair.backward].eqn.params["jaxpr"].jaxpr
    reruns = [e for e in backward.eqns if e.primitive.name == "dot_general"
              and e.outvars[0].aval.shape == (B, HEADS, S, S)]
    original = graph.nodes[pair.backward].eqn.params["jaxpr"].jaxpr
    assert len(reruns) > sum(e.primitive.name == "dot_general"
                             and e.outvars[0].aval.shape == (B, HEADS, S, S) for e in original.eqns)
    run = as_function(rewritten)
    _assert_same(jax.jit(run)(*flat), jax.tree_util.tree_leaves(jax.jit(step)(*args)))


def test_a_step_is_predicted_slower_by_the_passes_over_what_its_loops_stack(planned, args):
    """``Level.step_s``: FLOPs at the device rate plus three passes over the bytes the
    scans stack beyond the cache, counted here from the rewritten graphs' scan equations,
    plus the first touch of the temporary bytes (the memory model's, at these dims)."""
    _, plans = planned
    costs = dataclasses.replace(plans.costs, cache_bytes=0.0, fresh_bytes_per_s=1e9,
                                fresh_above_bytes=0.0)
    dims = {"b": B, "s": S}
    for level in plans.levels:
        scans = [n.eqn for n in level.graph.nodes if n.primitive == "scan"]
        stacked = sum(int(np.prod([int(dim_of(d).subs({sym("b"): B, sym("s"): S}))
                                   for d in v.aval.shape])) * v.aval.dtype.itemsize
                      for e in scans for v in e.outvars[scan_counts(e.params)[1]:])
        assert stacked > 0
        beyond = max(0, stacked - costs.cache_bytes)
        temp = int(level.memory.temp_bytes.subs({sym("b"): B, sym("s"): S}))
        want = (costs.recompute_s(level.flops_fn(dims)) + 3 * beyond / costs.memory_bytes_per_s
                + temp / costs.fresh_bytes_per_s)
        assert level.step_s(dims, costs) == pytest.approx(want)


def _attention_with_a_broadcast_filler(x, p):
    """Causal attention whose filler is a broadcast of a broadcast of a scalar, as
    Flax NNX's ``nnx.scan``-ed attention leaves it (``finfo.min`` broadcast to the
    scores, then again for a leading axis)."""
    b, s, d = x.shape
    qkv = (x @ p["qkv"]["w"] + p["qkv"]["b"]).reshape(b, s, 3, HEADS, d // HEADS)
    scores = jnp.einsum("bqhd,bkhd->bhqk", qkv[:, :, 0], qkv[:, :, 1])[None]
    mask = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None, None, None]
    filler = jax.lax.broadcast_in_dim(
        jnp.broadcast_to(jnp.finfo(jnp.float32).min, scores.shape[1:]), scores.shape,
        (1, 2, 3, 4))
    probs = jax.nn.softmax(jnp.where(mask, scores, filler), axis=-1)[0]
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, qkv[:, :, 2]).reshape(b, s, d)
    return ctx @ p["out"]["w"] + p["out"]["b"]


def test_a_filler_broadcast_from_a_broadcast_scalar_takes_no_buffer(args):
    """XLA folds a broadcast of a broadcast constant into one broadcast of the scalar,
    which the loops then run inside: their state holds no array of the filler's shape
    (Flax NNX's scanned decoder at (16, 512): 64 MiB the model held outside the loops)."""
    def layer(x, p):
        x = x + _attention_with_a_broadcast_filler(layer_norm(x, p["ln1"]), p)
        return x + jnp.tanh(x @ p["fc"]["w"]) @ p["proj"]["w"], None

    def loss_fn(params, tokens):
        x, _ = jax.lax.scan(layer, params["embed"][tokens], params["blocks"])
        return (x @ params["head"]).mean()

    graph = build_graph(jax.make_jaxpr(optax_step(loss_fn, ADAMW))(*args))
    rewritten = apply_loop_plan(graph, loop_candidates(graph, find_scan_pairs(graph), {})[-1])
    nodes, producers = rewritten.nodes, rewritten.producers
    chained = [n.outputs[0] for n in nodes  # the mask, computed from an iota, stays
               if n.primitive == "broadcast_in_dim" and n.inputs and n.inputs[0] in producers
               and str(rewritten.values[n.outputs[0]].dtype) == "float32"
               and nodes[producers[n.inputs[0]]].primitive == "broadcast_in_dim"
               and any(nodes[c].primitive == "scan"
                       for c in rewritten.consumers.get(n.outputs[0], ()))]
    assert chained
    compiled = jax.jit(as_function(rewritten)).lower(*jax.tree_util.tree_leaves(args)).compile(
        compiler_options=compiler_options())
    states = [line.split(" while(")[0] for line in compiled.as_text().splitlines()
              if " while(" in line]
    assert states
    for v in chained:
        shape = "f32[" + ",".join(str(int(d)) for d in rewritten.values[v].shape) + "]"
        assert not any(shape in s for s in states), shape
    assert not {b.value for b in liveness(rewritten)} & set(chained)
