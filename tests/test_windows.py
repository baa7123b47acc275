"""Convolution and pooling buffers (``jaxmem.memory.windows``, ``jaxmem.memory.library``)
against XLA's CPU peak.

Each test compiles a small program at two batch sizes and compares the symbolic
model's peak with ``jaxmem.xla_peak_bytes``. The comments give what the rule before
each one predicted (measured on jax 0.10.2, CPU).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.memory.library import library_window, pooling_fusions
from jaxmem.memory.schedule import xla_order
from jaxmem.memory.windows import conv_copies, max_pool_gradient_buffers, window_broadcasts
from jaxmem.symbolic import ShapeDomain, sym

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's rules")


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _f32(*shape: object) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _errors(fn, specs, batches=(4, 16)) -> list[float]:
    """The model's relative error against XLA at each batch size (``specs(b)``)."""
    (b,) = jax.export.symbolic_shape("b", constraints=("b <= 64",))
    graph = build_graph(jax.make_jaxpr(fn)(*specs(b)))
    model = memory_model(graph, ShapeDomain.from_constraints(("b",), ("b <= 64",)))
    out = []
    for n in batches:
        actual = jaxmem.xla_peak_bytes(jax.jit(fn).lower(*specs(n)).compile())
        out.append(int(model.peak_bytes.subs(sym("b"), n)) / actual - 1)
    return out


def _weight_gradient(x, w, dy):
    return jax.vjp(lambda w: _conv(x, w), w)[1](dy)[0]


def _weight_gradient_specs(n):
    return _f32(n, 32, 32, 16), _f32(3, 3, 16, 32), _f32(n, 32, 32, 32)


def test_weight_gradient_convolution_copies_both_operands() -> None:
    # Without the copies: -49 % (the activation and the cotangent are read with their
    # features as batch and as kernel input, and XLA transposes both first).
    errors = _errors(_weight_gradient, _weight_gradient_specs)
    assert all(abs(e) <= 0.02 for e in errors), errors
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_weight_gradient)(*_weight_gradient_specs(b)))
    copies = conv_copies(g, list(range(len(g.nodes))), lambda v: g.values[v].nbytes)
    assert sorted(c.value for c in copies) == sorted(g.inputs[::2])  # x and dy, not w


def _pool_gradient(x):
    return jax.grad(lambda x: (nn.avg_pool(jax.nn.relu(x), (2, 2), (2, 2)) ** 2).sum())(x)


def test_pool_fuses_its_prologue_and_its_transpose_folds_the_pad() -> None:
    # The ReLU fuses into the pooling fusion (without: +44 %, the ReLU's output
    # materialised), and the pool's transpose reads its cotangent through the pad
    # (without: +36 %, the padded cotangent materialised).
    errors = _errors(_pool_gradient, lambda n: (_f32(n, 32, 32, 16),))
    assert all(abs(e) <= 0.02 for e in errors), errors
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_pool_gradient)(_f32(b, 32, 32, 16)))
    fused, _ = pooling_fusions(g)
    assert [g.nodes[g.producers[v]].primitive for v in fused] == ["max"]


def _convnet_gradient(x, w1, b1, w2):
    def loss(w1, b1, w2):
        h = nn.avg_pool(jax.nn.relu(_conv(x, w1) + b1), (2, 2), (2, 2))
        return (_conv(h, w2) ** 2).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)


def _convnet_specs(n):
    return _f32(n, 32, 32, 8), _f32(3, 3, 8, 32), _f32(32), _f32(3, 3, 32, 32)


def test_pooling_fusion_reads_shared_constants_materialised() -> None:
    # The ReLU's 0 (shared with its gradient's select) and the pool's divisor (shared
    # with its transpose's) are full-size operands of the pooling fusion: without them
    # -32 %. What is left (-3 / -6 %) is elsewhere in the backward pass.
    errors = _errors(_convnet_gradient, _convnet_specs)
    assert all(abs(e) <= 0.08 for e in errors), errors
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_convnet_gradient)(*_convnet_specs(b)))
    used = [True] * len(g.nodes)
    extras = window_broadcasts(g, list(range(len(g.nodes))), used, "cpu")
    assert sorted(str(x.nbytes) for x in extras) == sorted(["32768*b", "131072*b"])
    assert window_broadcasts(g, list(range(len(g.nodes))), used, "gpu") == []


def _pooled_twice_gradient(x, w1, b1, w2):
    """The convnet's pool run twice on the same shape, as a rebuilt pool runs again in the
    backward pass: both read the ReLU's 0 and the divisor at one shape."""
    def loss(w1, b1, w2):
        h = nn.avg_pool(jax.nn.relu(_conv(x, w1) + b1), (2, 2), (2, 2))
        again = nn.avg_pool(jax.nn.relu(_conv(x, w1) - b1), (2, 2), (2, 2))
        return (_conv(h, w2) ** 2).sum() + (again ** 2).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)


def test_pools_reading_one_constant_share_its_broadcast() -> None:
    # XLA's CSE makes one broadcast of each constant at each shape, whatever number of
    # pools read it; one buffer per pool put a convnet level's rebuild at +17 %.
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_pooled_twice_gradient)(*_convnet_specs(b)))
    used = [True] * len(g.nodes)
    assert sum(library_window(g, n) for n in g.nodes) == 2
    extras = window_broadcasts(g, list(range(len(g.nodes))), used, "cpu")
    assert sorted(str(x.nbytes) for x in extras) == sorted(["32768*b", "131072*b"])
    errors = _errors(_pooled_twice_gradient, _convnet_specs)
    assert all(abs(e) <= 0.08 for e in errors), errors


def _max_pool_gradient(x):
    pool = lambda x: nn.max_pool(x, (2, 2), (2, 2))  # noqa: E731
    return jax.grad(lambda x: (pool(x) ** 2).sum())(x)


def _max_pool_convnet_step(x, w1, w2):
    def loss(w1, w2):
        h = nn.max_pool(jax.nn.relu(_conv(x, w1)), (2, 2), (2, 2))
        h = nn.max_pool(jax.nn.relu(_conv(h, w2)), (2, 2), (2, 2))
        return jnp.mean(h ** 2)
    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def test_max_pool_gradient_takes_the_expansions_buffers() -> None:
    # XLA's CPU backend expands a max pool's gradient into iotas (one s32 array of the
    # operand's shape per dim, made at the program's start), a window computing maxima
    # and their indices, and a scatter into zeros made at the start: without the rule
    # -70 % (the gradient alone) and -61 % (the step; its iotas and zeros live through
    # the forward pass).
    errors = _errors(_max_pool_gradient, lambda n: (_f32(n, 64, 64, 8),))
    assert all(abs(e) <= 0.06 for e in errors), errors
    errors = _errors(_max_pool_convnet_step,
                     lambda n: (_f32(n, 64, 64, 3), _f32(3, 3, 3, 16), _f32(3, 3, 16, 32)))
    assert all(abs(e) <= 0.08 for e in errors), errors
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_max_pool_gradient)(_f32(b, 64, 64, 8)))
    order, used = list(range(len(g.nodes))), [True] * len(g.nodes)
    notes = sorted(x.note for x in max_pool_gradient_buffers(g, order, used, "cpu"))
    assert notes == ["max-pool gradient: iota of an operand dim",
                     "max-pool gradient: selected indices",
                     "max-pool gradient: window maxima and indices"]  # the zeros: the result
    assert max_pool_gradient_buffers(g, order, used, "gpu") == []


def _both_gradients(x, w):
    return jax.grad(lambda x, w: jnp.sum(_conv(x, w) ** 2), argnums=(0, 1))(x, w)


def test_both_gradients_of_a_convolution_follow_xlas_copies_and_order() -> None:
    # Three rules at once, each read from XLA's buffer assignment (before them: -33 %):
    # an argument's copy is made at the program's start; the cotangent's copy, which
    # XLA computes from the cotangent's sources (``2 * y``, duplicated into the copy),
    # keeps ``y`` live until it is made; and the copies are instructions of XLA's
    # queue, so the input gradient's convolution runs before the weight gradient's.
    errors = _errors(_both_gradients, lambda n: (_f32(n, 64, 64, 8), _f32(3, 3, 8, 16)))
    assert all(abs(e) <= 0.02 for e in errors), errors
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_both_gradients)(_f32(b, 64, 64, 8), _f32(3, 3, 8, 16)))
    convs = [n.index for n in g.nodes if n.primitive == "conv_general_dilated"]
    order = xla_order(g, "cpu")
    (input_gradient,) = [i for i in convs[1:] if g.values[g.nodes[i].outputs[0]].shape[0]
                         == sym("b")]
    (weight_gradient,) = [i for i in convs[1:] if i != input_gradient]
    assert order.index(input_gradient) < order.index(weight_gradient)


def _skip_net_gradient(x, w1, w2, w3):
    def loss(ws):
        w1, w2, w3 = ws
        h1 = jax.nn.relu(_conv(x, w1))
        h2 = jax.nn.relu(_conv(h1, w2))
        return jnp.sum(_conv(jnp.concatenate([h1, h2], -1), w3) ** 2)
    return jax.grad(loss)((w1, w2, w3))


def test_kernel_gradients_read_copies_made_in_the_forward_pass() -> None:
    # The kernel gradients' convolutions read the ReLUs and the skip concatenate through
    # copies XLA makes as soon as each is written; the ReLUs and the concatenate then die
    # after their forward readers. Held to the backward pass besides: +34 % on a U-Net.
    specs = lambda n: (_f32(n, 32, 32, 8), _f32(3, 3, 8, 16), _f32(3, 3, 16, 16),  # noqa: E731
                       _f32(3, 3, 32, 8))
    errors = _errors(_skip_net_gradient, specs)
    assert all(abs(e) <= 0.03 for e in errors), errors
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_skip_net_gradient)(*specs(b)))
    reads: set[tuple[int, int]] = set()
    conv_copies(g, xla_order(g, "cpu"), lambda v: g.values[v].nbytes, reads)
    read = {g.nodes[g.producers[v]].primitive for _, v in reads if v in g.producers}
    assert {"max", "concatenate"} <= read
