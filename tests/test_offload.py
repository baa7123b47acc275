"""Host offload: planned by symbolic memory, rewritten into transfers, lowered for GPU.

CPU cannot measure offload (XLA keeps ``pinned_host`` arrays in the same memory,
docs/design.md §4; JAX's CPU lowering drops the transfers), so these tests force
``offload=True`` and check what CPU can check: outputs equal ``jax.jit``'s, the
symbolic model frees the offloaded bytes, and the program lowered for CUDA
carries XLA's host-placement annotations. The H200 check lives in ``bench/gpu.sh``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.lower import as_function
from jaxmem.plan.offload import costs_for, offload_by_default, offload_supported
from jaxmem.plan.remat import apply_remat
from jaxmem.plan.residuals import find_residuals
from jaxmem.rewrite import rewrite_level


def loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
    for w in ws:
        x = jnp.tanh((x @ w) @ w)  # the inner product is a residual only a matmul rebuilds
    return (x**2).mean()


def step(ws: list[jax.Array], x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    value, grads = jax.value_and_grad(loss)(ws, x)
    return value, [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]


WS = [jnp.full((64, 64), 0.01) * (i + 1) for i in range(3)]
SPECS = {"polymorphic_shapes": (None, "b, 64"), "constraints": ("b <= 4096",)}


def rows(b: int) -> jax.Array:
    return jnp.linspace(-1, 1, b * 64).reshape(b, 64)


def test_backends_and_costs():
    assert offload_supported("gpu") and offload_supported("tpu")
    assert not offload_supported("cpu")
    # Opt-in everywhere: on an H200 no offload level lowered XLA's peak (bench/results/gpu).
    assert not any(offload_by_default(b) for b in ("cpu", "gpu", "cuda", "tpu"))
    gpu = costs_for("cuda")
    assert gpu == costs_for("gpu")
    assert gpu.transfer_s(1e9) == pytest.approx(2e9 / gpu.host_bytes_per_s)


def test_host_arrays_take_no_device_bytes():
    def f(x):
        return jax.device_put(jax.device_put(jnp.sin(x), jax.memory.Space.Host),
                              jax.memory.Space.Device) * 2

    g = build_graph(jax.make_jaxpr(f)(jnp.ones((8, 4))))
    put = [n for n in g.nodes if n.primitive == "device_put"]
    host, back = (g.values[n.outputs[0]] for n in put)
    assert host.host and host.nbytes == 0
    assert not back.host and back.nbytes == 8 * 4 * 4


def test_rewrite_moves_residuals_out_and_back():
    g = build_graph(jax.make_jaxpr(step)(WS, rows(32)))
    residuals = find_residuals(g)
    moved = [r for r in residuals if r.primitive == "dot_general"]
    assert moved
    out = apply_remat(g, [], moved)
    puts = [n for n in out.nodes if n.primitive == "device_put"]
    assert len(puts) == 2 * len(moved)
    to_host = [n for n in puts if out.values[n.outputs[0]].host]
    assert len(to_host) == len(moved)
    # Every backward reader of an offloaded residual now reads the reloaded copy.
    gone = {r.value for r in moved}
    assert not any(v in gone for n in out.nodes if n.is_backward for v in n.inputs)
    # The copy to host is pinned right after the producer: a barrier holds it with the
    # device value, and the rest of the forward pass reads the barrier's output.
    for put in to_host:
        barrier = out.nodes[put.index + 1]
        assert barrier.primitive == "optimization_barrier"
        assert put.outputs[0] in barrier.inputs and put.inputs[0] in barrier.inputs
    forward_reads = [n for n in out.nodes if not n.is_backward and n.primitive != "device_put"
                     and n.primitive != "optimization_barrier"]
    assert not any(v in gone for n in forward_reads for v in n.inputs)
    got = jax.jit(lambda *a: jaxmem.lower.as_function(out)(*a))(
        *jax.tree_util.tree_leaves((WS, rows(32))))
    want = jax.tree_util.tree_leaves(jax.jit(step)(WS, rows(32)))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def forced() -> jaxmem.Jitted:
    return jaxmem.jit(step, offload=True, **SPECS)


def test_planner_offloads_what_recomputation_cannot_free_cheaply(forced: jaxmem.Jitted):
    analysis = forced.analysis(WS, rows(256))
    levels = analysis.plans.levels
    assert analysis.offload_planned
    k = next(i for i, lv in enumerate(levels) if lv.offload)
    dims = {"b": 4096}
    assert levels[k].peak_fn(dims) < levels[k - 1].peak_fn(dims)
    assert levels[k].offload_bytes != 0
    plan = forced.compile_level(k, WS, rows(256))
    text = plan.describe()
    assert "offload   <top>:" in text and "to host memory" in text
    for a, b in zip(jax.tree_util.tree_leaves(plan.run(WS, rows(256))),
                    jax.tree_util.tree_leaves(jax.jit(step)(WS, rows(256))), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_offload_lowers_to_pinned_host_for_gpu(forced: jaxmem.Jitted):
    analysis = forced.analysis(WS, rows(256))
    k = next(i for i, lv in enumerate(analysis.plans.levels) if lv.offload)
    rewritten = rewrite_level(analysis, k, {"b": 256}, (WS, rows(256)))
    body = as_function(rewritten.graph)

    def run(*dyn):
        return body(*jax.tree_util.tree_leaves(dyn))

    specs = jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype),
                                   (WS, rows(256)))
    module = jax.export.export(jax.jit(run), platforms=["cuda"])(*specs).mlir_module()
    placements = re.findall(r'_xla_buffer_placement = "(\w+)"', module)
    n = sum(len(groups) for name, groups in analysis.plans.groups
            if name in analysis.plans.levels[k].offload)
    assert placements.count("pinned_host") == n and placements.count("device") == n


def test_cpu_does_not_plan_offload_by_default():
    f = jaxmem.jit(step, **SPECS)
    plan = f.plan_for(WS, rows(16))
    assert not plan.offload_planned
    assert "host offload is not planned: jaxmem.jit(..., offload=True)" in plan.describe()
    with pytest.raises(TypeError, match="offload must be True, False or None"):
        jaxmem.jit(step, offload="yes", **SPECS)


def test_llama_step_with_offload_and_recompute_matches_jax_jit():
    """The project's Llama step: levels that mix recomputation and offload stay exact."""
    import fractions
    import inspect

    from bench.workload import build_workload
    from train.stdlib_data import records_from_source

    w = build_workload("tiny", max_len=64, records=records_from_source(
        inspect.getsource(fractions)), n_layers=2, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
    f = jaxmem.jit(w.train_step, polymorphic_shapes=(None, "b, s"),
                   constraints=("b <= 4", "s <= 64"), offload=True)
    batch = w.batch(2, 24)
    analysis = f.analysis(w.state, batch)
    mixed = [k for k, lv in enumerate(analysis.plans.levels) if lv.offload and lv.recompute]
    assert mixed
    want = jax.tree_util.tree_leaves(jax.jit(w.train_step)(w.state, batch))
    plan = f.compile_level(mixed[-1], w.state, batch)
    got = jax.tree_util.tree_leaves(plan.run(w.state, batch))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def dropout_loss(w: jax.Array, x: jax.Array, key: jax.Array) -> jax.Array:
    state = jax.random.key_data(key).astype(jnp.uint32)
    for _ in range(4):  # residuals pile up over 4 layers
        h = x @ w
        # XLA's stateful RNG, which jaxmem never re-runs (counter-based bits it re-draws)
        state, bits = jax.lax.rng_bit_generator(jnp.tile(state, 2)[:4], h.shape)
        state = state[:2]
        keep = bits < jnp.uint32(0.9 * 2**32)
        x = jnp.tanh(jnp.where(keep, h / 0.9, 0.0) @ w)
    return (x**2).mean()


def dropout_step(w: jax.Array, x: jax.Array, key: jax.Array) -> jax.Array:
    return w - 0.1 * jax.grad(dropout_loss)(w, x, key)


def test_residual_no_chain_rebuilds_can_still_be_offloaded():
    """The dropout-masked activation cannot be recomputed (jaxmem never re-runs a stateful
    RNG op); offload is its only way out of device memory."""
    w, key = jnp.eye(64) * 0.5, jax.random.key(0)
    bits = [r for r in find_residuals(build_graph(jax.make_jaxpr(dropout_step)(
        w, rows(32), key))) if r.primitive == "rng_bit_generator"]
    assert bits and all(r.recompute_nodes == () for r in bits)
    group = bits[0].group
    f = jaxmem.jit(dropout_step, polymorphic_shapes=(None, "b, 64", None),
                   constraints=("b <= 4096",), offload=True)
    analysis = f.analysis(w, rows(256), key)
    k = next(i for i, lv in enumerate(analysis.plans.levels) if group in lv.offload)
    assert group not in analysis.plans.levels[k].recompute
    plan = f.compile_level(k, w, rows(256), key)
    np.testing.assert_allclose(plan.run(w, rows(256), key),
                               jax.jit(dropout_step)(w, rows(256), key), rtol=1e-5, atol=1e-6)
    without = jaxmem.jit(dropout_step, polymorphic_shapes=(None, "b, 64", None),
                         constraints=("b <= 4096",), offload=False)
    assert not any(group in lv.recompute for lv in without.plans(w, rows(256), key).levels)


def _faults_per_step(compiled: jax.stages.Compiled, *args: jax.Array) -> float:
    import resource

    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        jax.block_until_ready(compiled(*args))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3


def _small_pages_only() -> bool:
    """Whether anonymous memory is mapped in 4 KiB pages (transparent huge pages off or
    on request only), which the fault counts below assume."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(jax.default_backend() != "cpu" or not _small_pages_only(),
                    reason="the CPU runtime's allocator on Linux with 4 KiB pages")
def test_cpu_faults_in_a_large_temporary_buffer_at_every_step():
    """The premise of ``Costs.first_touch_s``: each execution's temporaries (here a
    128 MiB block) are faulted in page by page, the kernel's count says, at every step."""
    x, w = jnp.ones((128 * 1024, 256)), jnp.ones((256, 8))
    compiled = jax.jit(lambda x, w: (jnp.sin(x) @ w).sum() + jnp.sin(x).sum()).lower(
        x, w).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp >= x.nbytes and _faults_per_step(compiled, x, w) >= 0.8 * temp / 4096
    assert costs_for("cpu").first_touch_s(temp) > 0 == costs_for("gpu").first_touch_s(temp)
