"""Tests for hlo_passes: XLA memory timeline, parsing, text plot.

Order survival (``hlo_passes.order``) is tested in ``test_hlo_order.py``.

The oracle for every byte count is ``compiled.memory_analysis()`` (and, for live
ranges, XLA's own HloLiveRange dump); no byte count is hard-coded.

Tolerance. ``temp_size_in_bytes`` is the size of XLA's packed heap: chunks are
aligned (64 bytes on CPU) and best-fit packing may fragment, so the heap is a
little larger than the most bytes ever live at once, which is what the timeline
reconstructs. Measured on the programs below the gap is at most 0.35 % of the
peak (a few hundred bytes of alignment); the tests allow 1 %. With XLA's buffer
assignment as the source the reconstruction can never exceed XLA's peak (live
slices of an allocation fit inside it), so that direction is asserted exactly.
"""

from __future__ import annotations

import doctest
import functools
import glob
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import hlo_passes
from hlo_passes import buffer_timeline, format_timeline, parse_hlo_module, xla_peak_bytes
from hlo_passes.hlo_text import ArrayShape, TupleShape, parse_shape
from hlo_passes.liveness import analyze

KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
SOURCES = ("buffer_assignment", "hlo_text")
TOLERANCE = 0.01


# --- programs -----------------------------------------------------------------------------


def _mlp_params(d: int, layers: int) -> list[tuple[jax.Array, jax.Array]]:
    return [(jnp.full((d, d), 0.01), jnp.zeros(d)) for _ in range(layers)]


@functools.cache
def mlp_adam(b: int, d: int, donate: bool = False) -> jax.stages.Compiled:
    """MLP train step with optax.adam (optionally donating params and optimizer state)."""
    params, opt = _mlp_params(d, 3), optax.adam(1e-3)

    def loss(ps, x):
        for w, bias in ps:
            x = jnp.tanh(x @ w + bias)
        return jnp.mean(x**2)

    def step(ps, state, x):
        value, grads = jax.value_and_grad(loss)(ps, x)
        updates, state = opt.update(grads, state, ps)
        return optax.apply_updates(ps, updates), state, value

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    return jitted.lower(params, opt.init(params), jnp.ones((b, d))).compile()


@functools.cache
def attention(b: int, s: int, d: int = 32) -> jax.stages.Compiled:
    """Gradient of an attention block: the s x s score tensor dominates temp."""

    def loss(q, k, v):
        scores = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 8.0, axis=-1)
        return (jnp.einsum("bqk,bkd->bqd", scores, v) ** 2).sum()

    q = jnp.ones((b, s, d))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()


@functools.cache
def checkpointed(b: int, d: int) -> jax.stages.Compiled:
    """Per-layer ``jax.checkpoint`` step, compiled so that the remat survives on CPU."""
    params = _mlp_params(d, 4)

    def loss(ps, x):
        for w, bias in ps:
            layer = jax.checkpoint(lambda h, w, bias: jnp.tanh(h @ w + bias),
                                   policy=jax.checkpoint_policies.nothing_saveable)
            x = layer(x, w, bias)
        return jnp.mean(x**2)

    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, jnp.ones((b, d)))
    return lowered.compile(compiler_options=KEEP_BARRIERS)


@functools.cache
def scanned(n: int, d: int, layers: int = 3) -> jax.stages.Compiled:
    """Gradient through ``lax.scan``: while loops with loop-state tuples and body temps."""

    def loss(ws, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return (h**2).sum()

    args = (jnp.ones((layers, d, d)), jnp.ones((n, d)))
    return jax.jit(jax.value_and_grad(loss)).lower(*args).compile()


PROGRAMS = {
    "mlp_adam_16x32": lambda: mlp_adam(16, 32),
    "mlp_adam_128x128": lambda: mlp_adam(128, 128),
    "mlp_adam_donated": lambda: mlp_adam(64, 64, donate=True),
    "attention_2x64": lambda: attention(2, 64),
    "attention_2x256": lambda: attention(2, 256),
    "checkpoint_128x64": lambda: checkpointed(128, 64),
    "scan_64x64": lambda: scanned(64, 64),
}


# --- reconstruction vs memory_analysis ------------------------------------------------------


def test_xla_peak_bytes_is_the_design_definition():
    compiled = mlp_adam(64, 64, donate=True)
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes > 0
    assert xla_peak_bytes(compiled) == (stats.argument_size_in_bytes
                                        + stats.output_size_in_bytes
                                        - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_peak_matches_memory_analysis(program, source):
    compiled = PROGRAMS[program]()
    stats = compiled.memory_analysis()
    tl = buffer_timeline(compiled, source=source)
    assert tl.source == source
    # Resident parts are allocations XLA reserves whole: they must agree exactly.
    assert tl.argument_bytes == stats.argument_size_in_bytes
    assert tl.output_bytes == stats.output_size_in_bytes
    assert tl.alias_bytes == stats.alias_size_in_bytes
    xla = xla_peak_bytes(compiled)
    assert tl.xla_peak_bytes == xla and tl.xla_temp_bytes == stats.temp_size_in_bytes
    assert abs(tl.peak_bytes - xla) <= TOLERANCE * xla, format_timeline(tl)
    if source == "buffer_assignment":
        assert tl.peak_bytes <= xla
        assert tl.temp_bytes <= stats.temp_size_in_bytes
    assert tl.peak_bytes == max(tl.timeline_bytes) == tl.timeline_bytes[tl.peak_index]
    assert tl.peak_bytes == tl.resident_bytes + tl.temp_bytes
    assert len(tl.timeline_bytes) == len(tl.instructions)


def test_attention_peak_is_where_scores_live():
    tl = buffer_timeline(attention(2, 256))
    scores = 2 * 256 * 256 * 4  # one f32[b, s, s] tensor
    biggest = tl.live_at_peak[0]
    assert biggest.size_bytes == scores and biggest.dims == (2, 256, 256)
    assert biggest.kind == "temp" and biggest.accounted_as == "temp"


def test_live_ranges_match_xla_live_range_dump(tmp_path):
    """XLA's HloLiveRange (dumped next to the buffer assignment) is the oracle."""
    params = _mlp_params(32, 3)

    def loss(ps, x):
        for w, bias in ps:
            x = jax.checkpoint(lambda h, w, bias: jnp.tanh(h @ w + bias))(x, w, bias)
        return jnp.mean(x**2)

    options = {**KEEP_BARRIERS, "xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True}
    lowered = jax.jit(jax.value_and_grad(loss), donate_argnums=(0,)).lower(
        params, jnp.ones((8, 32)))
    compiled = lowered.compile(compiler_options=options)
    dumps = glob.glob(str(tmp_path / "*after_optimizations-live-range.txt"))
    if not dumps:
        pytest.skip("this XLA does not dump live ranges")
    xla_ranges = {}
    for m in re.finditer(r"^\s+(\S+?)\{([\d,]*)\}:(\d+)-(\d+)$", open(dumps[0]).read(), re.M):
        index = tuple(int(i) for i in m.group(2).split(",") if i)
        xla_ranges[(m.group(1), index)] = (int(m.group(3)), int(m.group(4)))
    module = parse_hlo_module(compiled.as_text())
    live = analyze(module, module.entry)
    last = live.length - 1  # XLA's "end of program" is one past the last position
    ours = {(v.instruction, v.index): (v.start, v.end) for v in live.values}
    theirs = {k: (s, min(e, last)) for k, (s, e) in xla_ranges.items() if k in ours}
    assert len(theirs) == len(ours)
    assert ours == theirs


# --- tuples, aliasing, in-place, loops ------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
def test_tuple_outputs_and_forwarding_ops(source):
    compiled = mlp_adam(16, 32)
    module = parse_hlo_module(compiled.as_text())
    tl = buffer_timeline(compiled, source=source)
    root = module.entry.root
    assert isinstance(root.shape, TupleShape)
    table = [b for b in tl.buffers if b.instruction == root.name and b.shape_index == ()]
    assert len(table) == 1 and table[0].dtype == "tuple"
    assert table[0].size_bytes == 8 * len(root.shape.elements)
    assert table[0].accounted_as == "output"
    forwarding = {i.name for i in module.entry.instructions
                  if i.opcode in ("get-tuple-element", "bitcast", "opt-barrier")}
    assert not forwarding & {b.instruction for b in tl.buffers}


@pytest.mark.parametrize("source", SOURCES)
def test_donated_parameters_alias_outputs(source):
    compiled = mlp_adam(64, 64, donate=True)
    module = parse_hlo_module(compiled.as_text())
    assert module.input_output_alias  # donation reached the module header
    tl = buffer_timeline(compiled, source=source)
    assert tl.alias_bytes == compiled.memory_analysis().alias_size_in_bytes > 0
    donated = {a.parameter for a in module.input_output_alias}
    last = len(tl.instructions) - 1
    params = {b.instruction: b for b in tl.buffers if b.kind == "parameter"}
    by_number = {i.parameter_number: i.name for i in module.entry.instructions
                 if i.opcode == "parameter"}
    # A donated parameter's bytes are free after its last use; others live throughout.
    assert any(params[by_number[n]].end < last for n in donated)
    assert all(params[by_number[n]].end == last for n in by_number if n not in donated)


def test_fallback_in_place_and_bitcast_on_handwritten_hlo():
    text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[256]) -> f32[] {
  %p = f32[256]{0} parameter(0)
  %a = f32[256]{0} exponential(%p)
  %b = f32[16,16]{1,0} bitcast(%a)
  %c = f32[16,16]{1,0} negate(%b)
  %k = f32[] constant(0)
  ROOT %r = f32[] reduce(%c, %k), dimensions={0,1}, to_apply=%add
}
"""
    tl = buffer_timeline(text)
    assert tl.source == "hlo_text" and tl.xla_peak_bytes is None
    names = {b.instruction for b in tl.buffers}
    assert "b" not in names  # a bitcast is its operand's buffer
    a, c = (next(b for b in tl.buffers if b.instruction == n) for n in "ac")
    assert (a.start, a.end) == (1, 3)  # used through the bitcast by %c
    # %c overwrites %a in place (elementwise, same size, %a dies there): never 2 x 1 KiB.
    assert tl.temp_bytes == a.size_bytes == 1024
    assert tl.argument_bytes == 1024 and tl.output_bytes == 4


@pytest.mark.parametrize("source", SOURCES)
def test_loop_body_temporaries_sit_at_the_while(source):
    compiled = scanned(64, 64)
    module = parse_hlo_module(compiled.as_text())
    tl = buffer_timeline(compiled, source=source)
    whiles = {i: p for p, i in enumerate(tl.instructions)
              if module.entry.by_name()[i].opcode == "while"}
    inner = [b for b in tl.buffers if b.computation != module.entry_name
             and b.accounted_as == "temp"]
    assert whiles and inner
    assert all(b.start == b.end and b.start in whiles.values() for b in inner)
    assert tl.instructions[tl.peak_index] in whiles  # the backward loop is the peak


def test_checkpoint_needs_the_cpu_option():
    """The remat survives (barriers in HLO) and costs less temp than without the option."""
    params, x = _mlp_params(64, 4), jnp.ones((256, 64))

    def loss(ps, x):
        for w, bias in ps:
            layer = jax.checkpoint(lambda h, w, bias: jnp.tanh(h @ w + bias),
                                   policy=jax.checkpoint_policies.nothing_saveable)
            x = layer(x, w, bias)
        return jnp.mean(x**2)

    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, x)
    kept = lowered.compile(compiler_options=KEEP_BARRIERS)
    assert "opt-barrier" in kept.as_text()
    assert buffer_timeline(kept).peak_bytes < xla_peak_bytes(lowered.compile())


# --- parsing and plotting --------------------------------------------------------------------


def test_parse_shapes_with_layouts_tiles_and_memory_spaces():
    shape, _ = parse_shape("(f32[8,32]{1,0}, /*index=1*/bf16[4]{0:T(128)S(5)}, s32[], (pred[2]))")
    assert isinstance(shape, TupleShape) and len(shape.elements) == 4
    f32, bf16, s32, nested = shape.elements
    assert f32 == ArrayShape("f32", (8, 32), "1,0") and f32.size_bytes == 1024
    assert bf16.memory_space == 5 and bf16.size_bytes == 8
    assert s32.size_bytes == 4 and nested.size_bytes == 8  # tuple: pointer table
    assert parse_shape("s4[3]{0}")[0].size_bytes == 2  # packed sub-byte type


@settings(max_examples=50, deadline=None)
@given(dtype=st.sampled_from(["f32", "bf16", "s8", "pred", "f64", "u16"]),
       dims=st.lists(st.integers(0, 64), max_size=4))
def test_array_shape_round_trip(dtype, dims):
    layout = ",".join(str(i) for i in reversed(range(len(dims))))
    text = f"{dtype}[{','.join(map(str, dims))}]" + (f"{{{layout}}}" if dims else "")
    shape, used = parse_shape(text)
    assert used == len(text) and str(shape) == text
    numpy_dtype = {"f32": np.float32, "bf16": jnp.bfloat16, "s8": np.int8, "pred": np.bool_,
                   "f64": np.float64, "u16": np.uint16}[dtype]
    assert shape.size_bytes == np.zeros(dims, numpy_dtype).nbytes


def test_format_timeline_plot():
    tl = buffer_timeline(attention(2, 64))
    text = format_timeline(tl, width=40, height=6, top=3)
    lines = text.splitlines()
    assert lines[0].startswith("HloTimeline") and f"#{tl.peak_index}" in lines[0]
    bars = [ln.split("|", 1)[1] for ln in lines if "|" in ln]
    assert len(bars) == 6 and all(len(bar) == 40 for bar in bars)
    assert "#" in bars[0]  # the top row reaches the peak
    axis = next(ln for ln in lines if "+---" in ln)
    marker = next(ln for ln in lines if "^ peak" in ln)
    column = marker.index("^") - axis.index("+") - 1
    n = len(tl.instructions)
    assert column * n // 40 <= tl.peak_index < max((column + 1) * n // 40, column * n // 40 + 1)
    listed = lines[-3:]
    assert all(hlo_passes.human_bytes(b.size_bytes) in ln
               for b, ln in zip(tl.live_at_peak, listed, strict=False))
    assert any("dot_general" in ln or "exp" in ln for ln in listed)  # op_name metadata
    assert str(tl) == format_timeline(tl) and "\n" not in repr(tl)


@pytest.mark.parametrize("module", ["hlo_text", "liveness", "order", "timeline",
                                    "xla_proto", "fallback"])
def test_docstring_examples_run(module):
    failures, _ = doctest.testmod(importlib.import_module(f"hlo_passes.{module}"))
    assert failures == 0


def test_public_api_is_reexported():
    assert set(hlo_passes.__all__) <= set(dir(hlo_passes))
    assert {"buffer_timeline", "xla_peak_bytes", "order_survival", "format_timeline",
            "HloTimeline", "HloBuffer", "OrderSurvival"} <= set(hlo_passes.__all__)


def test_text_input_cannot_use_buffer_assignment():
    text = attention(2, 64).as_text()
    with pytest.raises(ValueError):
        buffer_timeline(text, source="buffer_assignment")
    assert buffer_timeline(text).peak_bytes > 0
