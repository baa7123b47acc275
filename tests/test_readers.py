"""jaxmem.memory.readers: values XLA keeps although a reader could recompute them, each
checked against XLA's own buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from hlo_passes.timeline import buffer_timeline
from jaxmem.graph import build_graph
from jaxmem.memory import liveness, memory_model
from jaxmem.memory.fusion import materialised
from jaxmem.symbolic import sym

B = sym("b")


def graph_of(fn, *specs):
    return build_graph(jax.make_jaxpr(fn)(*specs))


def _exact_gelu_block(p, x):
    mean = x.mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    return (x + jax.nn.gelu(h @ p[0], approximate=False) @ p[1]).mean()


def test_exact_gelus_exp_is_kept_for_the_backward_pass(b_dim, b_dom) -> None:
    """erfc's expansion computes exp(-x*x) too; XLA's CSE shares it with the derivative's,
    so the exp has two readers and is kept (fused, the block under-predicted by 12 %)."""
    p = (jnp.zeros((64, 256)), jnp.zeros((256, 64)))
    step = jax.grad(_exact_gelu_block)
    g = graph_of(step, p, jax.ShapeDtypeStruct((b_dim, 64), jnp.float32))
    exps = [v for n in g.nodes if n.primitive == "exp" for v in n.outputs]
    kept = {buf.value for buf in liveness(g) if buf.kind == "temp"}
    assert exps and set(exps) <= kept
    model = memory_model(g, b_dom)
    for at in (128, 1024):
        compiled = jax.jit(step).lower(p, jnp.ones((at, 64))).compile()
        xla_exps = [buf for buf in buffer_timeline(compiled).buffers
                    if buf.kind == "temp" and buf.op_name.endswith("/exp")]
        assert [buf.size_bytes for buf in xla_exps] == [at * 256 * 4], "XLA keeps it too"
        predicted = int(model.peak_bytes.subs(B, at))
        assert abs(predicted / jaxmem.xla_peak_bytes(compiled) - 1) <= 0.06


def _sine_layer(w, b, x):
    return (jnp.sin(x @ w + b) @ w.T).astype(jnp.float32).sum()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_low_precision_arithmetic_read_twice_is_kept(b_dim, dtype) -> None:
    """``h + b`` read by sin and by its derivative's cos: a float32 add is recomputed in
    both fusions, a bf16 one gets a buffer of its own, in jaxmem's model as in XLA's."""
    w, b = jnp.ones((64, 256), dtype), jnp.ones((256,), dtype)
    step = jax.grad(_sine_layer)
    g = graph_of(step, w, b, jax.ShapeDtypeStruct((b_dim, 64), dtype))
    owner = materialised(g)
    added = [v for n in g.nodes if n.primitive == "add" and not n.is_backward
             for v in n.outputs]
    assert len(added) == 1
    compiled = jax.jit(step).lower(w, b, jnp.ones((512, 64), dtype)).compile()
    # A fusion computing the add whose root is not the sine (float32's ``add_sine_fusion``
    # is the sine, the add inside it): bf16's ``add_convert_fusion`` is ``h + b`` rounded.
    xla_adds = [buf for buf in buffer_timeline(compiled).buffers
                if buf.kind == "temp" and buf.name.startswith("add_")
                and not buf.op_name.endswith("/sin")]
    kept = owner[added[0]] == added[0]
    assert kept == (dtype == jnp.bfloat16)
    assert bool(xla_adds) == kept
