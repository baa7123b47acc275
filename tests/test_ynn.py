"""XLA CPU's YNN fusion of a row reduction with a dot and its prologue (jaxmem.memory.ynn).

XLA is the oracle: the model's peak must follow ``xla_peak_bytes`` on both sides of
the 4096-row threshold at which the fusion grows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import memory_model
from jaxmem.symbolic import ShapeDomain, sym


def _step(x, w, r, z):
    # The second gelu shares the first one's scalar constants (XLA's CSE): inside the
    # grown fusion they are materialised full-size.
    y = r + jax.nn.gelu(x) @ w
    return y - y.mean(-1, keepdims=True), jax.nn.gelu(z)


def _specs(n):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    return f32(n, 256), f32(256, 64), f32(n, 64), f32(n, 256)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA CPU rule")
def test_shared_constants_of_a_grown_ynn_fusion_follow_xla() -> None:
    (n,) = jax.export.symbolic_shape("n", constraints=("n <= 16384",))
    dom = ShapeDomain.from_constraints(("n",), ("n <= 16384",))
    model = memory_model(build_graph(jax.make_jaxpr(_step)(*_specs(n))), dom)
    for rows in (2048, 4096):  # below and at the threshold
        compiled = jax.jit(_step).lower(*_specs(rows)).compile()
        xla = jaxmem.xla_peak_bytes(compiled)
        predicted = float(model.peak_bytes.subs(sym("n"), rows))
        assert abs(predicted - xla) <= 0.02 * xla, (rows, predicted, xla)
    assert "shared constant of a YNN fusion" in {b.note for b in model.buffers}
