"""Fuzzing the analyzer with random jaxprs over symbolic dims (issue 7, item 5).

A hypothesis strategy draws a small straight-line program from a vocabulary of
``lax`` ops (add, mul, tanh, exp, dot_general, reduce_sum, broadcast_in_dim,
reshape, transpose, concatenate, slice) over arguments whose dims are the symbols
``b, s`` or small constants. The recipe records every shape as dim *expressions*
(strings like ``"(b*s)"``), so the same recipe traces with symbolic dims and at any
concrete point, and ``lax`` (not ``jnp``) keeps the jaxpr the same at both: jnp may
specialise on a concrete dim (size-1 broadcasts, no-op reshapes), lax does not.

Properties (which equality holds, and why):

* ``jaxmem.analyze`` never crashes on such a program.
* ``memory_model(..., reuse_outputs=False)`` (a ``Max`` of polynomials) of the
  symbolic graph, evaluated at a random point, equals the same model of the graph
  traced at that point's concrete shapes **exactly** -- at *generic* points, where
  no two distinct symbolic value sizes coincide. At degenerate points (``b == 1``,
  ``b == s``, ...) the concrete model may share a buffer between values of equal sizes
  there, or see a broadcast keep the size: the symbolic model errs high, so
  ``symbolic >= concrete`` is checked (about 8 % of examples), unless a dot is an
  elementwise product there (XLA simplifies it; the concrete model fuses it).
* The default model (``reuse_outputs=True``, ``Report.peak_bytes_at``) cannot be
  compared exactly: :mod:`jaxmem.memory.reuse` leaves out output allocations below
  ``MIN_ALLOCATION_BYTES`` / ``MIN_GROUP_FRACTION`` and size classes below
  ``TOLERANCE`` judged over the *domain* (its upper corner, its sample points),
  which a concrete trace (a one-point domain) judges differently: e.g. a 4-byte
  output at ``b = 1`` is a 16 KiB one at the upper corner, so only the symbolic side
  hides a temporary in it. Both values must lie in ``[no_reuse_peak - output_bytes,
  no_reuse_peak]``; about 97 % of examples agree exactly (390 of 400 in one run).
  Found bugs are pinned by the ``test_regression_*`` tests at the bottom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from jax import lax

import jaxmem
from jaxmem.graph import build_graph
from jaxmem.memory import materialised, memory_model
from jaxmem.symbolic import ShapeDomain, sym

MAX_B, MAX_S = 16, 64
CONSTRAINTS = (f"b <= {MAX_B}", f"s <= {MAX_S}")
LEAVES = ("b", "s", "2", "3", "4")

Shape = tuple[str, ...]  # each dim an expression over b, s (a Python expression string)


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a recipe: ``name`` applied to pool values ``args`` with ``param``."""

    name: str
    args: tuple[int, ...]
    param: Any
    shape: Shape  # the result's shape


@dataclasses.dataclass(frozen=True)
class Recipe:
    inputs: tuple[Shape, ...]
    ops: tuple[Op, ...]
    outputs: tuple[int, ...]

    def function(self, dims: dict[str, Any]) -> Any:
        """The program as a function of the inputs (lax only), at ``dims``."""
        ops = self.ops
        outputs = self.outputs

        def f(*xs: jax.Array) -> Any:
            pool = list(xs)
            for op in ops:
                pool.append(_apply(op, [pool[i] for i in op.args], dims))
            outs = tuple(pool[i] for i in outputs)
            return outs[0] if len(outs) == 1 else outs

        return f

    def specs(self, dims: dict[str, Any]) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(tuple(_dim(d, dims) for d in shp), jnp.float32)
                for shp in self.inputs]


def _dim(expr: str, dims: dict[str, Any]) -> Any:
    return eval(expr, {"__builtins__": {}}, dict(dims))  # noqa: S307 (our own recipe strings)


def _apply(op: Op, xs: list[jax.Array], dims: dict[str, Any]) -> jax.Array:
    x = xs[0]
    n = op.name
    if n == "tanh":
        return lax.tanh(x)
    if n == "exp":
        return lax.exp(x)
    if n == "add":
        return lax.add(x, xs[1])
    if n == "mul":
        return lax.mul(x, xs[1])
    if n == "reduce_sum":
        return lax.reduce(x, np.float32(0), lax.add, (op.param,))
    if n == "broadcast":  # a new leading dim
        new = _dim(op.shape[0], dims)
        return lax.broadcast_in_dim(x, (new, *x.shape), tuple(range(1, x.ndim + 1)))
    if n == "reshape":  # merge axes param, param + 1
        a = op.param
        return lax.reshape(x, (*x.shape[:a], x.shape[a] * x.shape[a + 1], *x.shape[a + 2:]))
    if n == "transpose":
        return lax.transpose(x, op.param)
    if n == "concatenate":
        return lax.concatenate([x, xs[1]], op.param)
    if n == "slice":  # drop the first element of axis param
        start = [0] * x.ndim
        start[op.param] = 1
        return lax.slice(x, tuple(start), x.shape)
    if n == "dot":  # contract x's last axis with y's first (y rank 2), or x @ x^T
        y = xs[1]
        if op.param == "gram":
            nd = x.ndim
            batch = tuple(range(nd - 2))
            return lax.dot_general(x, y, (((nd - 1,), (nd - 1,)), (batch, batch)))
        return lax.dot_general(x, y, (((x.ndim - 1,), (0,)), ((), ())))
    raise AssertionError(n)


def _traced(recipe: Recipe, dims: dict[str, Any]) -> tuple[Any, list[Any]]:
    return recipe.function(dims), recipe.specs(dims)


def _size_ok(shape: Shape) -> bool:
    """Keeps values at most rank 3 and at most 3 symbolic factors (bounded bytes)."""
    return len(shape) <= 3 and sum(d.count("b") + d.count("s") for d in shape) <= 3


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    n_in = draw(st.integers(1, 3))
    inputs = tuple(tuple(draw(st.lists(st.sampled_from(LEAVES), min_size=1, max_size=3)))
                   for _ in range(n_in))
    shapes: list[Shape] = [s for s in inputs if _size_ok(s)] or [("b", "4")]
    inputs = tuple(shapes)
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 10))):
        i = draw(st.integers(0, len(shapes) - 1))
        x = shapes[i]
        name = draw(st.sampled_from(("tanh", "exp", "add", "mul", "reduce_sum", "broadcast",
                                     "reshape", "transpose", "concatenate", "slice", "dot",
                                     "dot")))
        op = _make_op(draw, name, i, x, shapes, len(inputs))
        if op is None or not _size_ok(op.shape):
            op = Op(draw(st.sampled_from(("tanh", "exp"))), (i,), None, x)
        ops.append(op)
        shapes.append(op.shape)
    n = len(shapes)
    outs = draw(st.lists(st.integers(max(0, n - 4), n - 1), min_size=1, max_size=2,
                         unique=True))
    return Recipe(inputs, tuple(ops), tuple(outs))


def _make_op(draw: st.DrawFn, name: str, i: int, x: Shape, shapes: list[Shape],
             n_inputs: int) -> Op | None:
    same = [j for j, s in enumerate(shapes) if s == x]
    if name in ("tanh", "exp"):
        return Op(name, (i,), None, x)
    if name in ("add", "mul"):
        return Op(name, (i, draw(st.sampled_from(same))), None, x)
    if name == "reduce_sum":
        if len(x) < 2:
            return None
        a = draw(st.integers(0, len(x) - 1))
        return Op(name, (i,), a, x[:a] + x[a + 1:])
    if name == "broadcast":
        # Only dims the arguments bind (a free dim var is not a function of the inputs).
        bound = [d for d in ("b", "s") if any(d in e for shp in shapes[:n_inputs] for e in shp)]
        d = draw(st.sampled_from((*bound, "3")))
        return Op(name, (i,), None, (d, *x))
    if name == "reshape":
        if len(x) < 2:
            return None
        a = draw(st.integers(0, len(x) - 2))
        return Op(name, (i,), a, (*x[:a], f"({x[a]}*{x[a + 1]})", *x[a + 2:]))
    if name == "transpose":
        perm = tuple(draw(st.permutations(range(len(x)))))
        return Op(name, (i,), perm, tuple(x[p] for p in perm))
    if name == "concatenate":
        a = draw(st.integers(0, len(x) - 1))
        compatible = [j for j, s in enumerate(shapes)
                      if len(s) == len(x) and all(s[k] == x[k] for k in range(len(x)) if k != a)]
        j = draw(st.sampled_from(compatible))
        out = list(x)
        out[a] = f"({x[a]}+{shapes[j][a]})"
        return Op(name, (i, j), a, tuple(out))
    if name == "slice":
        axes = [k for k, d in enumerate(x) if d.isdigit() and int(d) >= 2]
        if not axes:
            return None
        a = draw(st.sampled_from(axes))
        out = list(x)
        out[a] = str(int(x[a]) - 1)
        return Op(name, (i,), a, tuple(out))
    if name == "dot":
        if draw(st.booleans()) and len(x) >= 2:  # x @ x^T over leading batch axes
            return Op(name, (i, i), "gram", (*x[:-1], x[-2]))
        ys = [j for j, s in enumerate(shapes) if len(s) == 2 and s[0] == x[-1]]
        if not ys:
            return None
        j = draw(st.sampled_from(ys))
        return Op(name, (i, j), "matmul", (*x[:-1], shapes[j][1]))
    raise AssertionError(name)


@st.composite
def points(draw: st.DrawFn) -> dict[str, int]:
    return {"b": draw(st.integers(1, MAX_B)), "s": draw(st.integers(1, MAX_S))}


def _analyze(recipe: Recipe, dims: dict[str, Any]) -> jaxmem.Report:
    f, specs = _traced(recipe, dims)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemWarning)
        return jaxmem.analyze(f, *specs)


def _symbolic_dims() -> dict[str, Any]:
    b, s = jax.export.symbolic_shape("b, s", constraints=CONSTRAINTS)
    return {"b": b, "s": s}


def _at(expr: sympy.Expr, report: jaxmem.Report, point: dict[str, int]) -> int:
    subs = {sym(n): point[n] for n in report.symbols}
    return int(sympy.sympify(expr).subs(subs))


def _epilogues(model: Any) -> int:
    return sum(b.note == "broadcast epilogue operand" for b in model.buffers)


def _generic(report: jaxmem.Report, dims: dict[str, int]) -> bool:
    """True when distinct symbolic value sizes stay distinct at ``dims`` and no dim is 1
    (XLA bitcasts size-1 dims away: the concrete model drops transposed copies)."""
    sizes = {sympy.expand(v.nbytes) for v in report.graph.values}
    return len({_at(e, report, dims) for e in sizes}) == len(sizes) and 1 not in dims.values()


FUZZ = settings(max_examples=400, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _event(message: str) -> None:
    """``hypothesis.event``, also callable when a test body runs outside ``@given``."""
    with contextlib.suppress(InvalidArgument):
        event(message)


@FUZZ
@given(recipe=recipes(), point=points())
def test_symbolic_peak_at_a_point_agrees_with_the_concrete_analysis(
        recipe: Recipe, point: dict[str, int]) -> None:
    report = _analyze(recipe, _symbolic_dims())  # must not crash
    assert set(report.symbols) <= {"b", "s"}
    dims = {n: point[n] for n in report.symbols}
    symbolic = report.peak_bytes_at(**dims)
    concrete = _analyze(recipe, point)
    assert concrete.symbols == ()
    conc = concrete.peak_bytes_at()
    assert symbolic > 0 and conc > 0
    # Both are the exact no-reuse peak minus what hides in output buffers, and at most
    # the (non-aliased) output bytes can hide. See the module docstring for why the
    # default (reuse) forms may differ: reuse.py's cut-offs are relative to the domain.
    upper = int(concrete.memory.argument_bytes + concrete.memory.output_bytes
                - concrete.memory.alias_bytes + concrete.memory.temp_bytes_without_reuse)
    outs = int(concrete.memory.output_bytes)
    _event("reuse peak exact" if symbolic == conc else "reuse peak differs")
    assert upper - outs <= conc <= upper, (recipe, point)
    if not _generic(report, dims):  # degenerate point: the symbolic side errs high (above)
        m = report.memory
        upper = max(upper, _at(m.argument_bytes + m.output_bytes - m.alias_bytes
                               + m.temp_bytes_without_reuse, report, dims))
    assert upper - outs <= symbolic <= upper, (recipe, point, report.peak_bytes)


@FUZZ
@given(recipe=recipes(), point=points())
def test_peak_without_output_reuse_matches_and_bounds(recipe: Recipe,
                                                      point: dict[str, int]) -> None:
    report = _analyze(recipe, _symbolic_dims())
    dims = {n: point[n] for n in report.symbols}
    plain = memory_model(report.graph, report.domain, reuse_outputs=False)
    f, specs = _traced(recipe, point)
    cgraph = build_graph(jax.make_jaxpr(f)(*specs))
    cplain = memory_model(cgraph, ShapeDomain.from_constraints(()), reuse_outputs=False)
    sym_plain = _at(plain.peak_bytes, report, dims)
    if _epilogues(plain) != _epilogues(cplain):
        # An epilogue buffer on the symbolic side only (test_regression_epilogue_*): errs high.
        _event("epilogue buffers differ: symbolic >= concrete")
        assert sym_plain >= int(cplain.peak_bytes), (recipe, point, plain.peak_bytes)
    elif _generic(report, dims):
        _event("generic point: exact")
        assert sym_plain == int(cplain.peak_bytes), (recipe, point, plain.peak_bytes)
    elif not _size_one_dots(cgraph):
        # Sizes equal here only (b == 1, b == s, ...): the concrete model may share a buffer
        # the symbolic one cannot prove equal everywhere, which then errs high, never low.
        _event("degenerate point: symbolic >= concrete")
        assert sym_plain >= int(cplain.peak_bytes), (recipe, point, plain.peak_bytes)
    # Without reuse no temporary sits in an output buffer: an upper bound of the default.
    assert sym_plain >= report.peak_bytes_at(**dims)
    assert _at(report.memory.temp_bytes_without_reuse, report, dims) == \
        _at(plain.temp_bytes, report, dims)


def _size_one_dots(graph: Any) -> bool:
    owner = materialised(graph)
    return any(n.primitive == "dot_general" and owner[n.outputs[0]] == -1 for n in graph.nodes)


def test_generator_covers_the_vocabulary() -> None:
    """The strategy reaches every op (a guard against a generator that silently narrows)."""
    seen: set[str] = set()

    @settings(max_examples=150, deadline=None, database=None)
    @given(recipe=recipes())
    def collect(recipe: Recipe) -> None:
        seen.update(op.name for op in recipe.ops)

    collect()
    assert seen >= {"tanh", "exp", "add", "mul", "reduce_sum", "broadcast", "reshape",
                    "transpose", "concatenate", "slice", "dot"}, seen


@pytest.mark.parametrize("dims", [{"b": 1, "s": 1}, {"b": MAX_B, "s": MAX_S}])
def test_domain_corners(dims: dict[str, int]) -> None:
    """A fixed program with every op, checked at the domain's corners."""
    recipe = Recipe(
        inputs=(("b", "s", "4"), ("4", "3")),
        ops=(Op("dot", (0, 1), "matmul", ("b", "s", "3")),
             Op("tanh", (2,), None, ("b", "s", "3")),
             Op("slice", (3,), 2, ("b", "s", "2")),
             Op("concatenate", (4, 4), 2, ("b", "s", "(2+2)")),
             Op("reshape", (5,), 0, ("(b*s)", "(2+2)")),
             Op("transpose", (6,), (1, 0), ("(2+2)", "(b*s)")),
             Op("dot", (6, 6), "gram", ("(b*s)", "(b*s)")),
             Op("exp", (8,), None, ("(b*s)", "(b*s)")),
             Op("reduce_sum", (9,), 1, ("(b*s)",)),
             Op("broadcast", (10,), None, ("s", "(b*s)")),
             Op("mul", (11, 11), None, ("s", "(b*s)")),
             Op("add", (12, 11), None, ("s", "(b*s)"))),
        outputs=(13, 7))
    report = _analyze(recipe, _symbolic_dims())
    assert report.symbols == ("b", "s")
    test_symbolic_peak_at_a_point_agrees_with_the_concrete_analysis.hypothesis.inner_test(
        recipe, dims)
    test_peak_without_output_reuse_matches_and_bounds.hypothesis.inner_test(recipe, dims)


# --- regressions: minimal repros of what the fuzzer found (both fixed) ---


def test_regression_degenerate_point_bounds_the_reuse_peak_by_its_own_model() -> None:
    """At b = 1 a column sum of a (b, b) input and its broadcast have one size: the concrete
    model writes one into the other's buffer, the symbolic one keeps both (20 > 16 bytes)."""
    recipe = Recipe(inputs=(("b", "b"), ("b",), ("b",)),
                    ops=(Op("reduce_sum", (0,), 0, ("b",)), Op("tanh", (0,), None, ("b", "b")),
                         Op("broadcast", (3,), None, ("b", "b"))),
                    outputs=(5,))
    test_symbolic_peak_at_a_point_agrees_with_the_concrete_analysis.hypothesis.inner_test(
        recipe=recipe, point={"b": 1, "s": 1})


def test_regression_reuse_temp_is_never_negative() -> None:
    from jaxmem.memory.reuse import point_expression

    b, s = sym("b"), sym("s")
    dom = ShapeDomain.from_constraints(("b", "s"), CONSTRAINTS)
    expr = point_expression([(8 * b * s, 1)], [(4 * b * s, 1), (4 * b * s**2, 1)], dom, {})
    values = [int(expr.subs({b: 1, s: v})) for v in (1, 2, 3, 8)]
    assert all(v >= 0 for v in values), values  # was [8, -16, -24, -64]


def test_regression_epilogue_buffer_does_not_depend_on_the_trace() -> None:
    def f(x: jax.Array) -> jax.Array:
        d = lax.dot_general(x, x, (((1,), (0,)), ((), ())))
        lax.concatenate([x, d], 0)  # dead, and nothing here is broadcast
        return d

    b, = jax.export.symbolic_shape("b", constraints=("b <= 16",))
    report = jaxmem.analyze(f, jax.ShapeDtypeStruct((b, b), jnp.float32))
    concrete = jaxmem.analyze(f, jax.ShapeDtypeStruct((2, 2), jnp.float32))
    assert report.peak_bytes_at(b=2) == concrete.peak_bytes_at()  # today: 64 != 32 (XLA: 32)
