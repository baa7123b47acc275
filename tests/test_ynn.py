"""Row-reduction library fusions (``jaxmem.memory.ynn``): rules, and the peak against XLA's.

Measured on jax 0.10.2, CPU: without the two rules the plain GPT's deepest level at
(8, 512) was predicted 19 % over XLA's peak (the ``dP`` matmul XLA computes inside the
softmax-backward fusion) and its level 0 4 % under (the norm scale broadcasts).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import sympy
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import jaxmem
from bench.accuracy import polymorphic_shapes
from bench.programs import gpt_program
from hlo_passes.timeline import buffer_timeline
from jaxmem.graph import build_graph
from jaxmem.memory.fusion import materialised, used_nodes
from jaxmem.memory.library import YNN_MIN_ROWS, below_rows, from_rows
from jaxmem.memory.ynn import row_fused_dots
from jaxmem.memory.ynn_operands import prologue_constants, shared_row_broadcasts
from jaxmem.symbolic import sym


def _softmax(x: jax.Array) -> jax.Array:
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
    return e / e.sum(-1, keepdims=True)


def _attention_grad(q, k, v):
    return jax.grad(lambda q, k, v: jnp.tanh(_softmax(q @ k.swapaxes(-1, -2)) @ v).sum(),
                    argnums=(0, 1, 2))(q, k, v)


def _layer_norm_grad(x, scale, bias, w):
    def loss(x, scale, bias, w):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return jnp.tanh(((x - mu) * jax.lax.rsqrt(var + 1e-5) * scale + bias) @ w).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, bias, w)


def _gelu_norm_step(x, h, h2, w):
    """A residual add of ``gelu(h) @ w`` before a row mean (taken in float32, as
    mixed-precision norms are): the norm's YNN fusion takes in the matmul and gelu's
    chain; a second gelu of that shape shares its constants."""
    def loss(x, h, h2, w):
        y = (x + jax.nn.gelu(h) @ w).astype(jnp.float32)
        gelu2 = jax.nn.gelu(h2).astype(jnp.float32)
        return jnp.tanh(y - y.mean(-1, keepdims=True)).sum() + gelu2.sum()
    return jax.value_and_grad(loss)(x, h, h2, w)


_GELU_SHAPES = ("(b, 512, 64)", "(b, 512, 128)", "(b, 512, 128)", None)


def _f32(*shape: object) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@given(st.integers(1, 4 * YNN_MIN_ROWS))
def test_row_gates_are_complementary_steps(rows: int) -> None:
    assert below_rows(rows) + from_rows(rows) == 1
    assert from_rows(rows) == (rows >= YNN_MIN_ROWS)
    b = sym("b")
    assert below_rows(b).subs(b, rows) == below_rows(rows)
    assert from_rows(b).subs(b, rows) == from_rows(rows)


def test_softmax_backward_dot_is_fused_from_the_row_threshold() -> None:
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_attention_grad)(*[_f32(b, 4, 256, 64)] * 3))
    fused = row_fused_dots(g, materialised(g))
    (dot,) = fused  # dP = dO @ V^T: the score-sized cotangent, and nothing else
    assert g.nodes[g.producers[dot]].primitive == "dot_general"
    assert g.values[dot].shape == (sym("b"), 4, 256, 256)
    rows_per_b = 4 * 256  # softmax rows: b * heads * s
    for n in (1, 2, 3, 4, 8):
        assert fused[dot].subs(sym("b"), n) == int(n * rows_per_b < YNN_MIN_ROWS)


def _attention_grad_bf16(q, k, v):
    """bf16 matmuls, the softmax in float32: ``dP`` is bf16, converted before the row sum."""
    def loss(q, k, v):
        p = _softmax((q @ k.swapaxes(-1, -2)).astype(jnp.float32)).astype(jnp.bfloat16)
        return jnp.tanh((p @ v).astype(jnp.float32)).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_bf16_softmax_backward_dot_is_fused_through_its_convert() -> None:
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 4, 256, 64), jnp.bfloat16)
    g = build_graph(jax.make_jaxpr(_attention_grad_bf16)(spec, spec, spec))
    (dot,) = row_fused_dots(g, materialised(g))
    assert g.values[dot].dtype == "bfloat16" and g.values[dot].shape[-2:] == (256, 256)
    x = jnp.ones((4, 4, 256, 64), jnp.bfloat16)  # 4096 softmax rows: YNN's
    compiled = jax.jit(_attention_grad_bf16).lower(x, x, x).compile()
    backward_dots = [buf for buf in buffer_timeline(compiled).buffers
                     if buf.kind == "temp" and "transpose(" in buf.op_name
                     and buf.op_name.endswith("dot_general") and "256,256]" in buf.shape]
    assert not backward_dots, "XLA computes dP inside the row sum's fusion"


def _layer_norm_grad_bf16(x, scale, bias, w):
    """The mixed-precision norm: statistics in float32, scale and bias applied in bf16."""
    def loss(x, scale, bias, w):
        x32 = x.astype(jnp.float32)
        mu = x32.mean(-1, keepdims=True)
        var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
        y = ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(jnp.bfloat16)
        y = y * scale.astype(jnp.bfloat16) + bias.astype(jnp.bfloat16)
        return jnp.tanh((y @ w.astype(jnp.bfloat16)).astype(jnp.float32)).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, bias, w)


def test_bf16_norm_scale_broadcast_is_float32() -> None:
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_layer_norm_grad_bf16)(
        jax.ShapeDtypeStruct((b, 512, 256), jnp.bfloat16), _f32(256), _f32(256),
        _f32(256, 256)))
    order = list(range(len(g.nodes)))
    (extra,) = shared_row_broadcasts(g, order, used_nodes(g), "cpu")  # the scale's bf16 copy
    assert g.nodes[g.producers[extra.value]].inputs == (1,)
    full = 512 * 256 * 4
    assert [extra.nbytes.subs(sym("b"), n) for n in (4, 8)] == [0, 8 * full]


def test_norm_scale_broadcast_lives_from_start_to_its_backward_reader() -> None:
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_layer_norm_grad)(
        _f32(b, 512, 256), _f32(256), _f32(256), _f32(256, 256)))
    order = list(range(len(g.nodes)))
    (extra,) = shared_row_broadcasts(g, order, used_nodes(g), "cpu")  # the scale, not the bias
    assert extra.value == 1 and extra.start == 0
    readers = [n.index for n in g.nodes if 1 in n.inputs or any(
        g.producers.get(v) is not None and 1 in g.nodes[g.producers[v]].inputs
        for v in n.inputs)]
    assert extra.end == max(readers)
    full = 512 * 256 * 4
    assert [extra.nbytes.subs(sym("b"), n) for n in (4, 8, 16)] == [0, 8 * full, 16 * full]
    assert shared_row_broadcasts(g, order, used_nodes(g), "gpu") == []


def _flax_layer_norm_grad(x, scale, bias, w):
    def loss(x, scale, bias, w):
        norm = nnx.LayerNorm(x.shape[-1], rngs=nnx.Rngs(0))
        norm.scale.value, norm.bias.value = scale, bias
        return jnp.tanh(norm(x) @ w).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, bias, w)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's library")
def test_flax_norm_scale_broadcast_is_a_buffer_from_the_sums_input_elements() -> None:
    """Flax's LayerNorm sums ``d(rsqrt(var) * scale) * scale`` alone per row: YNN takes that
    product once the sum reads 4096 elements, far below 4096 rows."""
    (b,) = jax.export.symbolic_shape("b")
    g = build_graph(jax.make_jaxpr(_flax_layer_norm_grad)(
        _f32(b, 8, 64), _f32(64), _f32(64), _f32(64, 64)))
    (extra,) = shared_row_broadcasts(g, list(range(len(g.nodes))), used_nodes(g), "cpu")
    full = 8 * 64 * 4
    sizes = {n: extra.nbytes.subs(sym("b"), n) for n in (4, 8)}
    assert sizes == {4: 0, 8: 8 * full}
    for n, size in sizes.items():
        compiled = jax.jit(_flax_layer_norm_grad).lower(
            _f32(n, 8, 64), _f32(64), _f32(64), _f32(64, 64)).compile()
        wrapped = re.findall(r"%wrapped_broadcast[.0-9]* = f32\[(\d+),8,64\]",
                             compiled.as_text())
        assert (size > 0) == bool(wrapped), (n, wrapped)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's library")
def test_gpt_deepest_level_peak_follows_xla_across_the_threshold() -> None:
    program = gpt_program(layers=2, d=128)
    f = jaxmem.jit(program.step, polymorphic_shapes=polymorphic_shapes(program),
                   constraints=program.constraints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        for dims in ({"b": 2, "s": 128}, {"b": 8, "s": 512}):  # softmax rows 512, 8192
            args = program.concrete_args(dims)
            plans = f.plans(*args)
            deepest = f.compile_level(len(plans.levels) - 1, *args)
            error = deepest.predicted_peak_bytes / deepest.peak_bytes - 1
            assert abs(error) <= 0.05, (dims, error)
            peak = plans.levels[-1].memory.peak_bytes
            assert peak.has(sympy.Piecewise), peak


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prologue_constants_are_full_size_from_the_row_threshold(dtype: Any) -> None:
    (b,) = jax.export.symbolic_shape("b")
    shapes = ((b, 512, 64), (b, 512, 128), (b, 512, 128), (128, 64))
    g = build_graph(jax.make_jaxpr(_gelu_norm_step)(
        *[jax.ShapeDtypeStruct(s, dtype) for s in shapes]))
    order = list(range(len(g.nodes)))
    extras = prologue_constants(g, order, used_nodes(g), "cpu")
    assert len(extras) == 4  # 0.5, 1, 0.044715, sqrt(2 / pi)
    hidden = 512 * 128 * 4  # bytes per b of one f32[b, 512, 128] (XLA CPU computes in f32)
    for x in extras:
        assert x.start == 0
        assert [x.nbytes.subs(sym("b"), n) for n in (4, 8, 16)] == [0, 8 * hidden, 16 * hidden]
    computed = row_fused_dots(g, materialised(g))
    gelu_out = next(v for v in computed if g.values[v].shape[-1] == 128)
    assert computed[gelu_out].subs(sym("b"), 8) == 0
    assert computed[gelu_out].subs(sym("b"), 4) == 1
    assert prologue_constants(g, order, used_nodes(g), "gpu") == []


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's library")
@pytest.mark.parametrize(("dtype", "bound"), [(jnp.float32, 0.02), (jnp.bfloat16, 0.10)])
def test_gelu_prologue_peak_follows_xla_from_the_threshold(dtype: Any, bound: float) -> None:
    """Without the prologue rule the float32 peak was predicted 47 % under XLA's at b = 8
    and 16; below the threshold (b = 4) the model is still about half XLA's (not found)."""
    f = jaxmem.jit(_gelu_norm_step, polymorphic_shapes=_GELU_SHAPES, constraints=("b <= 16",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        for n in (8, 16):  # 4096 and 8192 rows
            args = [jnp.ones(s, dtype) for s in ((n, 512, 64), (n, 512, 128), (n, 512, 128),
                                                  (128, 64))]
            plan = f.compile_level(0, *args)
            error = plan.predicted_peak_bytes / plan.peak_bytes - 1
            assert abs(error) <= bound, (n, error)


def _dpa_layer(groups: int, causal: bool):
    def layer(x, wq, wk, wv, wo, heads=4):
        b, s, d = x.shape
        q = (x @ wq).reshape(b, s, heads, d // heads)
        k, v = ((x @ w)[..., : groups * (d // heads)].reshape(b, s, groups, d // heads)
                for w in (wk, wv))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        return out.reshape(b, s, d) @ wo
    return layer


@pytest.mark.parametrize("groups,causal", [(4, False), (2, False), (4, True), (2, True)])
def test_dot_product_attention_steps_read_the_scales_broadcast(groups, causal) -> None:
    # jax.nn.dot_product_attention's softmax gradient ends in `* scale` after a transpose
    # (its group axis moved); XLA sinks the multiply into the YNN fusion, which reads the
    # scale's broadcast (shared with the forward scores') as a buffer. Without a mask
    # (causal: the select ends the fusion first) the model was -8 to -11 % under.
    def loss(params, x):
        for w in params:
            x = x + _dpa_layer(groups, causal)(x, *w)
        return (x ** 2).mean()

    step = jax.grad(loss)
    params = [tuple(jax.random.normal(jax.random.PRNGKey(4 * i + j), (64, 64)) * 0.1
                    for j in range(4)) for i in range(2)]
    b, s = jax.export.symbolic_shape("b, s", constraints=("b <= 16", "s <= 512"))
    report = jaxmem.analyze(step, params, jax.ShapeDtypeStruct((b, s, 64), jnp.float32))
    for b, s in ((2, 512), (8, 128)):
        xla = jaxmem.xla_peak_bytes(jax.jit(step).lower(params, jnp.ones((b, s, 64))).compile())
        assert abs(report.peak_bytes_at(b=b, s=s) / xla - 1) <= 0.05, (b, s)
