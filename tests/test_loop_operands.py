"""``jaxmem.memory.loop_operands``: the bfloat16 loop operands XLA's CPU backend widens.

XLA is the oracle: which operands it converts to float32 outside the loop is read
from the optimized HLO of each case, and a bf16 scanned train step's peak is checked
against XLA's (without the rule it was 34-38 % under, so the bound can fail).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from programs import level_error, small_gpt_scan_bf16

from jaxmem.graph import build_graph
from jaxmem.memory.loop_operands import as_run, widened_inputs, widened_loop_operands

BF, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
S = jax.ShapeDtypeStruct
L, B, D = 4, 16, 32

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU rules")


def _scan(body, c, xs):
    return jax.lax.scan(body, c, xs)


# (name, fn, specs): a carry, and one operand the body reads (xs stacked, or a const).
CASES = [
    ("xs added", lambda c, xs: _scan(lambda c, x: (c + x, None), c, xs)[0],
     (S((B, D), BF), S((L, B, D), BF))),
    ("xs by a native dot", lambda c, xs: _scan(
        lambda c, x: (c + jnp.matmul(x, x.T, preferred_element_type=F32), None),
        c, xs)[0], (S((B, B), F32), S((L, B, D), BF))),
    ("xs sliced into the carry", lambda c, xs: _scan(
        lambda c, x: (jax.lax.dynamic_update_slice(c, x[:4], (0, 0)), None), c, xs)[0],
     (S((B, D), BF), S((L, B, D), BF))),
    ("const added", lambda c, w: _scan(lambda c, _: (c + w, None), c, jnp.zeros(L))[0],
     (S((B, D), BF), S((B, D), BF))),
    ("const by a native dot", lambda c, w: _scan(
        lambda c, _: (c + jnp.matmul(c.astype(BF), w, preferred_element_type=F32), None),
        c, jnp.zeros(L))[0], (S((B, D), F32), S((D, D), BF))),
    ("float16 xs", lambda c, xs: _scan(lambda c, x: (c + x, None), c, xs)[0],
     (S((B, D), F16), S((L, B, D), F16))),
]


def _xla_widens(fn, specs) -> bool:
    """Whether XLA's entry computation converts the second argument to float32 whole."""
    txt = jax.jit(fn).lower(*specs).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    param = re.search(r"%(\S+) = \w+\[[^\]]*\]\S* parameter\(1\)", entry).group(1)
    dims = ",".join(str(d) for d in specs[1].shape)
    return re.search(rf"= f32\[{dims}\]\S* (?:fusion|convert)\(%{re.escape(param)}\)",
                     entry) is not None


@cpu_only
@pytest.mark.parametrize(("name", "fn", "specs"), CASES, ids=[c[0] for c in CASES])
def test_widened_operands_are_the_ones_xla_converts(name, fn, specs) -> None:
    g = build_graph(jax.make_jaxpr(fn)(*specs))
    copies, _ = widened_loop_operands(g, range(len(g.nodes)), "cpu")
    assert any(x.value == g.inputs[1] for x in copies) == _xla_widens(fn, specs)
    assert not any(x.value == g.inputs[0] for x in copies)  # a carry stays as it is


def test_other_backends_widen_nothing() -> None:
    fn, specs = CASES[0][1], CASES[0][2]
    g = build_graph(jax.make_jaxpr(fn)(*specs))
    assert widened_loop_operands(g, range(len(g.nodes)), "gpu") == ([], {})


def test_the_operand_dies_at_its_convert_and_the_copy_lives_through_the_loop() -> None:
    # xs made by a sin before the loop: converted right after it, dead from there.
    fn = lambda c, a: _scan(lambda c, x: (c + x, None), c, jnp.sin(a))[0]  # noqa: E731
    g = build_graph(jax.make_jaxpr(fn)(S((B, D), BF), S((L, B, D), BF)))
    copies, ends = widened_loop_operands(g, range(len(g.nodes)), "cpu")
    (copy,), loop = copies, len(g.nodes) - 1
    assert (copy.start, copy.end, copy.nbytes) == (1, loop, L * B * D * 4)
    assert ends == {copy.value: (loop, 0)}


FILLED = {  # a (B, D) bf16 const a loop computes on: a constant's broadcast, or an argument's
    "a constant's broadcast": lambda a: jnp.full((B, D), 0.5, BF),
    "an argument's broadcast": lambda a: jnp.broadcast_to(a[None], (B, D)),
}


@cpu_only
@pytest.mark.parametrize("name", list(FILLED))
def test_a_broadcast_of_a_constant_is_made_in_the_body_not_widened(name) -> None:
    # XLA sinks a constant's broadcast into the loop body: no copy of it outside.
    def fn(c, a):
        w = FILLED[name](a)
        return _scan(lambda c, _: (jnp.tanh(c * w), None), c, jnp.zeros(L))[0]

    specs = (S((B, D), BF), S((D,), BF))
    g = build_graph(jax.make_jaxpr(fn)(*specs))
    copies, _ = widened_loop_operands(g, range(len(g.nodes)), "cpu")
    txt = jax.jit(fn).lower(*specs).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    xla_widens = re.search(rf"= f32\[{B},{D}\]\S* (?:fusion|convert)\(", entry) is not None
    assert bool(copies) == xla_widens == (name == "an argument's broadcast")


def test_bodies_as_run_read_float32_copies() -> None:
    fn, specs = CASES[0][1], CASES[0][2]
    g = build_graph(jax.make_jaxpr(fn)(*specs))
    scan = next(n for n in g.nodes if n.primitive == "scan")
    traced = scan.subgraphs[0]
    body = as_run(traced, widened_inputs(g, scan, "cpu"))
    x = body.inputs[-1]  # the slice of xs
    assert (traced.values[x].dtype, body.values[x].dtype) == ("bfloat16", "float32")
    assert body.values[x].nbytes == 2 * traced.values[x].nbytes
    assert widened_inputs(g, scan, "gpu") == frozenset()
    assert as_run(traced, frozenset()) is traced


@cpu_only
@pytest.mark.parametrize("dims", [{"b": 2, "s": 64}, {"b": 8, "s": 256}])
def test_scanned_bf16_step_level_0_within_ten_percent_of_xla(dims) -> None:
    assert abs(level_error(small_gpt_scan_bf16(), 0, dims)) <= 0.10
