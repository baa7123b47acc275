"""Broadcast operands of a dot's fused epilogue (``jaxmem.memory.epilogues``) against
XLA's buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.lower import compiler_options
from jaxmem.memory import liveness


def _rotary_layers(ws, x, t):
    cos = jnp.cos(t)
    for w in ws:  # each layer broadcasts the table anew in the jaxpr
        x = jnp.tanh((x @ w) * cos[None])
    return x


def test_one_buffer_per_broadcast_xla_cse_merges() -> None:
    # Each layer's ``cos[None]`` is its own broadcast in the jaxpr; XLA's CSE makes them
    # one buffer (the f32 Llama's rotary tables: level 0 at (8, 512) +5.0 -> +2.1 %).
    d = 256
    specs = ([jax.ShapeDtypeStruct((d, d), jnp.float32)] * 3,
             jax.ShapeDtypeStruct((16, 256, d), jnp.float32),
             jax.ShapeDtypeStruct((256, d), jnp.float32))
    g = build_graph(jax.make_jaxpr(_rotary_layers)(*specs))
    assert sum(n.primitive == "broadcast_in_dim" for n in g.nodes) == 3
    assert len([b for b in liveness(g) if b.note == "broadcast epilogue operand"]) == 1
    compiled = jax.jit(_rotary_layers).lower(*specs).compile(
        compiler_options=compiler_options("cpu"))
    actual = jaxmem.xla_peak_bytes(compiled)
    predicted = jaxmem.analyze(_rotary_layers, *specs).peak_bytes_at()
    assert abs(predicted - actual) <= 0.05 * actual, (predicted, actual)
