"""Building the dataflow graph (``jaxmem.graph``).

Covers: symbolic byte sizes, the per-primitive rules for sub-jaxprs (``pjit``,
``custom_jvp``, ``custom_vjp``, ``checkpoint`` inlined; ``cond``, ``scan``,
``while`` as control nodes with bodies), a whole ``value_and_grad`` + optax train
step, producers/consumers, forward/backward tagging, and that unknown primitives
and host callbacks give a ``JaxmemWarning`` instead of a crash.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from programs import small_gpt

import jaxmem
from jaxmem.graph import Graph, build_graph
from jaxmem.symbolic import sym

B, S = sym("b"), sym("s")


def graph_of(fn, *specs) -> Graph:
    return build_graph(jax.make_jaxpr(fn)(*specs))


def spec(*shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module")
def dims():
    return jax.export.symbolic_shape("b, s", constraints=("b <= 16", "s <= 512"))


def test_values_carry_symbolic_bytes(dims) -> None:
    b, s = dims
    g = graph_of(lambda x, w: jnp.tanh(x @ w).astype(jnp.bfloat16), spec(b, s, 64), spec(64, 32))
    assert [n.primitive for n in g.nodes] == ["dot_general", "tanh", "convert_element_type"]
    sizes = [g.values[n.outputs[0]].nbytes for n in g.nodes]
    assert sizes == [128 * B * S, 128 * B * S, 64 * B * S]
    assert g.values[g.inputs[0]].shape == (B, S, 64)
    assert g.values[g.outputs[0]].dtype == "bfloat16"
    assert g.nodes[0].flops == 2 * B * S * 32 * 64


def test_producers_and_consumers(dims) -> None:
    b, _ = dims
    g = graph_of(lambda x: (x * 2) + (x * 3), spec(b, 8))
    x = g.inputs[0]
    assert x not in g.producers
    assert g.consumers[x] == (0, 1)
    assert g.producers[g.outputs[0]] == 2
    for n in g.nodes:
        for v in n.outputs:
            assert g.values[v].id == v


def _prims(g: Graph) -> list[str]:
    return [n.primitive for n in g.nodes]


def test_pjit_is_inlined(dims) -> None:
    b, _ = dims
    inner = jax.jit(lambda x: jnp.sin(x) * 2)
    g = graph_of(lambda x: inner(x) + 1, spec(b, 4))
    assert "pjit" not in _prims(g) and "jit" not in _prims(g)
    assert "sin" in _prims(g)


def test_custom_jvp_and_custom_vjp_are_inlined(dims) -> None:
    b, _ = dims

    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))
    g = graph_of(lambda x: jax.nn.relu(clip_grad(x)).sum(), spec(b, 4))
    assert not any(p.startswith("custom_") for p in _prims(g))
    g2 = graph_of(jax.grad(lambda x: jax.nn.softplus(clip_grad(x)).sum()), spec(b, 4))
    assert not any(p.startswith("custom_") for p in _prims(g2))
    assert any(n.is_backward for n in g2.nodes)


def test_checkpoint_is_inlined(dims) -> None:
    b, _ = dims
    f = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)))
    g = graph_of(jax.grad(lambda x: f(x).sum()), spec(b, 4))
    assert not {"checkpoint", "remat", "remat2"} & set(_prims(g))
    assert _prims(g).count("sin") >= 2


def test_a_differentiated_checkpoint_recomputes_behind_a_barrier() -> None:
    """JAX lowers the recomputation of a checkpointed layer behind an optimization
    barrier on its inputs (the incoming cotangent among them). Inlined without one, the
    model ran the recomputation as early as breadth-first order allows and
    over-predicted a user-checkpointed decoder's level 0 by 29.6 % (bench.unseen's
    user-remat step at (8, 64)); XLA is the reference. The bound is 15 %: the step is
    11.5 % under XLA, whose peak (in the last layer's backward pass) holds 24 buffers of
    256 KiB and 32 of 128 KiB where the model's holds 20 and 25 (among them the norms'
    products, six in XLA against four; docs/notes.md, session 23). Until session 23 the
    cross-entropy gradient's scatter was counted from the program's start, 2 points
    over, which hid part of that gap."""
    from bench.unseen import train_step

    step, state = train_step("user-remat", 3)
    args = (state, jnp.zeros((8, 64), jnp.int32), jax.random.key(1))
    g = build_graph(jax.make_jaxpr(step)(*args))
    barrier = next(n for n in g.nodes if n.primitive == "optimization_barrier")
    assert any(n.primitive == "dot_general" for n in g.nodes[barrier.index + 1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        predicted = jaxmem.analyze(step, *args, symbolic=False).peak_bytes_at()
    actual = jaxmem.xla_peak_bytes(jax.jit(step).lower(*args).compile())
    assert abs(predicted / actual - 1) <= 0.15, (predicted, actual)


def test_cond_scan_while_become_control_nodes(dims) -> None:
    b, _ = dims

    def f(x):
        y = jax.lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: jnp.tanh(v), x)
        y, _ = jax.lax.scan(lambda c, _: (jnp.sin(c) @ jnp.eye(4), None), y, None, length=3)
        return jax.lax.while_loop(lambda v: v.sum() < 10, lambda v: v + 1, y)

    g = graph_of(f, spec(b, 4))
    control = {n.primitive: n for n in g.nodes if n.kind == "control"}
    assert set(control) == {"cond", "scan", "while"}
    assert len(control["cond"].subgraphs) == 2
    assert len(control["while"].subgraphs) == 2  # condition and body
    (body,) = control["scan"].subgraphs
    assert "dot_general" in _prims(body)
    assert control["scan"].flops != 0
    # The body's memory counts while the loop runs (memory model), so it must not crash.
    dom = jaxmem.analyze(f, spec(b, 4))
    assert dom.peak_bytes_at(b=4, s=1) if "s" in dom.symbols else dom.peak_bytes_at(b=4) > 0


def _shard_mapped_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A step whose loss and gradient run inside ``jax.shard_map`` on a 1-device mesh."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    p = jax.sharding.PartitionSpec

    def local(w, x):
        loss, grad = jax.value_and_grad(lambda w: jnp.tanh(jnp.tanh(x @ w) @ w.T).sum())(w)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grad, "data")

    return jax.shard_map(local, mesh=mesh, in_specs=(p(), p("data")), out_specs=(p(), p()))(w, x)


def test_shard_map_body_is_modelled_as_a_control_node() -> None:
    args = (jnp.ones((64, 64)) * 0.01, jnp.ones((4096, 64)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)  # pvary, psum_invariant known
        g = build_graph(jax.make_jaxpr(_shard_mapped_step)(*args))
    (node,) = [n for n in g.nodes if n.primitive == "shard_map"]
    assert node.kind == "control" and "dot_general" in _prims(node.subgraphs[0])
    # Opaque, the body's activations were missing: the model said -75 % at this shape.
    predicted = jaxmem.analyze(_shard_mapped_step, *args).peak_bytes_at()
    actual = jaxmem.xla_peak_bytes(jax.jit(_shard_mapped_step).lower(*args).compile())
    assert abs(predicted / actual - 1) <= 0.25, (predicted, actual)


def test_whole_train_step_traces() -> None:
    p = small_gpt()
    closed = jax.make_jaxpr(p.step)(*p.symbolic_args())
    g = build_graph(closed)
    prims = set(_prims(g))
    assert {"dot_general", "reduce_max", "exp", "gather", "scatter-add"} <= prims
    assert any(n.is_backward for n in g.nodes) and not all(n.is_backward for n in g.nodes)
    assert len(g.inputs) == len(jax.tree_util.tree_leaves(p.symbolic_args()))
    assert len(g.outputs) == len(jax.tree_util.tree_leaves(jax.eval_shape(
        p.step, *p.concrete_args({"b": 2, "s": 8}))))
    assert any("transpose(" in n.scope for n in g.nodes)
    total = sympy.Add(*[g.values[v].nbytes for v in g.inputs])
    assert total.free_symbols == {B, S}


def test_unknown_primitive_warns_and_is_conservative(dims) -> None:
    b, _ = dims
    prim = jax.extend.core.Primitive("jaxmem_test_mystery")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    prim.def_impl(lambda x: x)
    with pytest.warns(jaxmem.JaxmemWarning, match="unknown primitive 'jaxmem_test_mystery'"):
        g = graph_of(lambda x: prim.bind(x) * 2, spec(b, 4))
    node = next(n for n in g.nodes if n.primitive == "jaxmem_test_mystery")
    assert node.kind == "opaque"


def test_pure_callback_warns(dims) -> None:
    b, _ = dims

    def host(x):
        return np.asarray(x) * 2

    def f(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x).sum()

    with pytest.warns(jaxmem.JaxmemWarning, match="host callback"):
        report = jaxmem.analyze(f, spec(b, 4))
    assert report.peak_bytes_at(b=4) >= 2 * 4 * 4 * 4


def test_no_warning_for_known_primitives() -> None:
    p = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)
        build_graph(jax.make_jaxpr(p.step)(*p.symbolic_args()))


def test_a_debug_print_in_a_train_step_is_known_and_runs(capfd) -> None:
    # jax.debug.print binds debug_print (no results, operands read on the device): a
    # train step that prints its loss must plan without a warning and still print.
    def loss(w, x):
        y = jnp.tanh(x @ w)
        jax.debug.print("loss {l}", l=y.sum())
        return (y * y).sum()

    w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)
        step = jaxmem.jit(jax.grad(loss), polymorphic_shapes=(None, "b, 8"),
                          constraints=("b <= 16",))
        got = step(w, x)
    np.testing.assert_allclose(got, jax.grad(loss)(w, x), rtol=1e-6)
    assert "loss" in capfd.readouterr().out


def test_a_linear_solve_and_its_gradient_are_known() -> None:
    # jnp.linalg.solve binds custom_linear_solve (an LU solve inside): an opaque op, as
    # lu and triangular_solve are, not an unknown one.
    def loss(a, b):
        return jnp.linalg.solve(a @ a.T + jnp.eye(8), b).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)
        g = build_graph(jax.make_jaxpr(jax.grad(loss, (0, 1)))(jnp.ones((8, 8)),
                                                             jnp.ones((8, 3))))
    assert [n.kind for n in g.nodes if n.primitive == "custom_linear_solve"] == ["opaque"] * 2


def _interleaved_rope(x):
    x1, x2 = x[..., ::2], x[..., 1::2]  # jnp.stack and its transpose, unstack
    return jnp.stack([x1 * 0.5 - x2 * 0.8, x1 * 0.8 + x2 * 0.5], -1).reshape(x.shape)


def _cond_loss(x, flag):  # the gradient of a cond allocates with empty2
    return jax.lax.cond(flag > 0, lambda h: jnp.mean(jnp.sin(h) ** 2),
                        lambda h: jnp.zeros((), h.dtype), x)


@pytest.mark.parametrize("fn", [lambda x, _: jnp.tanh(_interleaved_rope(x)).sum(), _cond_loss])
def test_stack_unstack_and_empty_are_known(fn, dims) -> None:
    # JAX 0.10's jnp.stack, its transpose and a cond gradient's allocation: an unknown
    # primitive would warn (and be counted as an opaque op).
    b, _ = dims
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)
        graph_of(jax.grad(fn), spec(b, 64), jax.ShapeDtypeStruct((), jnp.int32))
